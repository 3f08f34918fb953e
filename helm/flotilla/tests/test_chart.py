"""Checks of the Flotilla Helm chart without a cluster.

Lints the chart strictly, renders it with the default values and with every feature on,
validates the rendered manifests against the Kubernetes 1.33 schemas (kubernetes-validate,
strict), asserts on the rendered objects, and proves that bad values fail with a clear
message. Run by scripts/check-helm (which prepares the virtualenv); needs helm-python-sdk and
kubernetes-validate. With FLOTILLA_BIN set to a built `flotilla`, every rendered flotilla.toml
is also loaded by the real binary.

Prints one line per check and ends with "N passed, M failed".
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import traceback
from pathlib import Path

import helm_python
import yaml

CHART = Path(__file__).resolve().parents[1]
ROOT = CHART.parents[1]
KUBE_VERSION = "1.33.0"
# The one lint finding allowed: the optional NATS dependency is declared but not vendored
# (see README.md, "NATS"). Anything else at warning level or above fails.
MISSING_NATS = "chart directory is missing these dependencies: nats"

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def render(values: dict, name: str = "rel", namespace: str = "flotilla", chart: Path = CHART) -> list[dict]:
    """Renders like `helm template` and returns the objects (NOTES.txt left out)."""
    with helm_python.Chart.load(str(chart)) as chart:
        files = chart.render(values, name=name, namespace=namespace, is_install=True)
    objects = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("_source", path)
                objects.append(doc)
    return objects


def render_error(values: dict) -> str:
    try:
        render(values)
    except helm_python.HelmError as e:
        return str(e)
    raise AssertionError(f"values were accepted: {values}")


def find(objects, kind, name=None):
    found = [
        o
        for o in objects
        if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert found, f"no {kind} {name or ''} rendered; have {[(o['kind'], o['metadata']['name']) for o in objects]}"
    return found


def one(objects, kind, name):
    return find(objects, kind, name)[0]


def pod_specs(objects):
    for o in objects:
        if o["kind"] in ("Deployment", "Job"):
            yield o, o["spec"]["template"]["spec"]


def configs(objects) -> dict[str, dict]:
    cm = one(objects, "ConfigMap", "rel-flotilla-config")
    return {k: tomllib.loads(v) for k, v in cm["data"].items()}


def kubernetes_validate(objects) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "rendered.yaml"
        clean = [{k: v for k, v in o.items() if k != "_source"} for o in objects]
        path.write_text(yaml.safe_dump_all(clean))
        bin_dir = Path(sys.executable).parent
        out = subprocess.run(
            [str(bin_dir / "kubernetes-validate"), "--strict", "-k", KUBE_VERSION, str(path)],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        # Custom resources have no bundled schema: they are checked by hand below.
        for line in (out.stdout + out.stderr).splitlines():
            if line.startswith("WARN"):
                assert "ScaledObject" in line or "ServiceMonitor" in line, line


ALL_ON = {
    "prefix": "acme-ai",
    "jetstream": {"replicas": 3},
    "nats": {
        "enabled": False,
        "url": "nats://nats-0.nats:4222, nats://nats-1.nats:4222",
        "monitoringEndpoint": "nats.messaging.svc:8222",
        "account": "FLOTILLA",
        "authKind": "creds-file",
        "tls": {"enabled": True, "caSecret": "nats-ca"},
    },
    "extraConfig": '[coordinator]\nshards = 32\n[worker]\nheartbeat = "3s"\n[supervisor]\nstale-after = "5m"\n',
    "workerPools": [
        {"name": "default", "replicas": 7},
        {
            "name": "gpu",
            "concurrency": 1,
            "shutdownGraceSeconds": 120,
            "agents": '[agents.vision]\nkind = "scripted"\nreply = "seen"\n',
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "envFrom": [{"secretRef": {"name": "llm-keys"}}],
            "keda": {"enabled": True, "minReplicas": 1, "maxReplicas": 8, "lagThreshold": 5},
        },
        {
            "name": "batch",
            "hpa": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "env": [{"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm", "key": "openai"}}}],
        },
    ],
    "metrics": {"serviceMonitor": {"enabled": True}},
    "networkPolicy": {"enabled": True},
    "supervisor": {
        "replicas": 3,
        "nodeSelector": {"pool": "system"},
        "settings": {"teamSize": 20, "recruit": {"allowedRoles": ["analyst"], "answerWait": "10s"}},
    },
}


# Two tenants (README.md, "Tenants"): acme with pools default and gpu (the gpu pool's settings
# come from its workerPools entry) and person bob, beta with the default pool and person
# carol; root administers every tenant.
TENANTS = {
    "nats": {"monitoringEndpoint": "nats.messaging.svc:8222"},
    "workerPools": [
        {"name": "default"},
        {
            "name": "gpu",
            "concurrency": 1,
            "agents": '[agents.vision]\nkind = "scripted"\nreply = "seen"\n',
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "keda": {"enabled": True, "minReplicas": 1, "maxReplicas": 8},
        },
    ],
    "tenancy": {
        "tenants": [
            {"name": "acme", "pools": ["default", "gpu"], "people": ["bob"], "workers": {"replicas": 2}},
            {"name": "beta", "people": ["carol"], "coordinator": {"replicas": 2}},
        ],
        "admins": ["root"],
        "natsConfig": {"enabled": True},
    },
}
# The same tenants as `flotilla tenant nats-config --from-file` reads them (tenant records).
TENANT_RECORDS = [
    {"name": "acme", "pools": ["default", "gpu"], "people": ["bob"], "created_ms": 0},
    {"name": "beta", "pools": ["default"], "people": ["carol"], "created_ms": 0},
]
# Per tenant or shared (README.md, "Tenants"): acme (pools default and gpu) and beta (pool
# default) are served by one shared set of services (`--tenants`), gamma by its own.
SHARED = {
    "nats": {"monitoringEndpoint": "nats.messaging.svc:8222"},
    "workerPools": TENANTS["workerPools"],
    "tenancy": {
        "tenants": [
            {"name": "acme", "shared": True, "pools": ["default", "gpu"], "people": ["bob"]},
            {"name": "beta", "shared": True, "people": ["carol"]},
            {"name": "gamma"},
        ],
        "admins": ["root"],
        "natsConfig": {"enabled": True},
    },
}

@check
def lint_is_strictly_clean():
    for values in ({}, ALL_ON, TENANTS, SHARED):
        result = helm_python.lint(str(CHART), values, strict=True, namespace="flotilla", kube_version=KUBE_VERSION)
        bad = [m for m in result["messages"] if m["severity"] >= 2 and m["error"] != MISSING_NATS]
        assert not bad, bad
        missing = [m for m in result["messages"] if m["error"] == MISSING_NATS]
        if (CHART / "charts").is_dir() and any((CHART / "charts").glob("nats*")):
            assert not missing, missing


@check
def defaults_render_and_validate():
    objects = render({})
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "Job", "PodDisruptionBudget", "Service", "ServiceAccount"]
    ), kinds
    kubernetes_validate(objects)


@check
def every_feature_renders_and_validates():
    objects = render(ALL_ON)
    for kind in ("ScaledObject", "HorizontalPodAutoscaler", "ServiceMonitor", "NetworkPolicy"):
        find(objects, kind)
    kubernetes_validate(objects)


@check
def every_pod_is_locked_down():
    for values in ({}, ALL_ON, TENANTS, SHARED):
        for obj, spec in pod_specs(render(values)):
            name = obj["metadata"]["name"]
            assert spec["enableServiceLinks"] is False, name
            assert spec["automountServiceAccountToken"] is False, name
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, name
            assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
            for c in spec["containers"]:
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, name
                assert sc["allowPrivilegeEscalation"] is False, name
                assert sc["capabilities"]["drop"] == ["ALL"], name
                assert sc["seccompProfile"]["type"] == "RuntimeDefault", name


@check
def services_have_probes_metrics_and_a_writable_tmp():
    for obj, spec in pod_specs(render({})):
        if obj["kind"] != "Deployment":
            continue
        name = obj["metadata"]["name"]
        (c,) = spec["containers"]
        assert c["ports"] == [{"name": "http", "containerPort": 9464, "protocol": "TCP"}], name
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}, name
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}, name
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz", name
        ann = obj["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9464", name
        assert ann["prometheus.io/path"] == "/metrics", name
        assert "checksum/config" in ann, name
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/etc/flotilla/flotilla.toml"} <= mounts, name
        env = {e["name"]: e for e in c["env"]}
        assert env["FLOTILLA_CONFIG"]["value"] == "/etc/flotilla/flotilla.toml", name


@check
def coordinators_are_replicated_and_protected():
    objects = render({})
    d = one(objects, "Deployment", "rel-flotilla-coordinator")
    assert d["spec"]["replicas"] >= 2
    assert d["spec"]["template"]["spec"]["containers"][0]["args"] == ["coordinator"]
    pdb = one(objects, "PodDisruptionBudget", "rel-flotilla-coordinator")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
    env = {e["name"]: e for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FLOTILLA_NATS__AUTH__KIND"]["value"] == "user-password"
    assert env["FLOTILLA_NATS__AUTH__PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "flotilla-nats-coordinator",
        "key": "password",
    }


@check
def supervisors_are_replicated_and_protected():
    objects = render({})
    d = one(objects, "Deployment", "rel-flotilla-supervisor")
    assert d["spec"]["replicas"] == 2
    spec = d["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"] == ["supervisor"]
    pdb = one(objects, "PodDisruptionBudget", "rel-flotilla-supervisor")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
    assert d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "supervisor"
    # Its own NATS user (least privilege), its own config (every agent's member card).
    env = {e["name"]: e for e in c["env"]}
    assert env["FLOTILLA_NATS__AUTH__KIND"]["value"] == "user-password"
    for key in ("user", "password"):
        assert env[f"FLOTILLA_NATS__AUTH__{key.upper()}"]["valueFrom"]["secretKeyRef"] == {
            "name": "flotilla-nats-supervisor",
            "key": key,
        }
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["config"]["configMap"]["items"] == [{"key": "supervisor.toml", "path": "flotilla.toml"}]
    cfg = configs(objects)["supervisor.toml"]
    assert cfg["telemetry"]["http-addr"] == "0.0.0.0:9464"
    cm = one(objects, "ConfigMap", "rel-flotilla-config")
    assert cm["data"]["supervisor.toml"].startswith("# flotilla.toml rendered by the Helm chart helm/flotilla (supervisor)")
    # A config change rolls the supervisors, not because the coordinators' config changed.
    ann = d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    coord = one(objects, "Deployment", "rel-flotilla-coordinator")
    assert ann != coord["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


@check
def supervisor_values_reach_its_pods():
    objects = render(ALL_ON)
    d = one(objects, "Deployment", "rel-flotilla-supervisor")
    assert d["spec"]["replicas"] == 3
    spec = d["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "system"}
    # creds-file: the supervisor's Secret mounted as its creds file; TLS CA mounted.
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["nats-credentials"]["secret"]["secretName"] == "flotilla-nats-supervisor"
    assert vols["nats-ca"]["secret"]["secretName"] == "nats-ca"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["FLOTILLA_NATS__AUTH__PATH"]["value"] == "/etc/flotilla/nats/nats.creds"
    objects = render({"nats": {"credentials": {"supervisor": "team-keeper"}}})
    env = {e["name"]: e for e in one(objects, "Deployment", "rel-flotilla-supervisor")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FLOTILLA_NATS__AUTH__USER"]["valueFrom"]["secretKeyRef"]["name"] == "team-keeper"


@check
def the_supervisor_can_be_left_out_or_run_alone():
    objects = render({"supervisor": {"enabled": False}})
    assert not [o for o in objects if o["metadata"]["name"] == "rel-flotilla-supervisor"]
    assert "supervisor.toml" not in one(objects, "ConfigMap", "rel-flotilla-config")["data"]
    kubernetes_validate(objects)
    # One replica: no budget that would block every drain.
    objects = render({"supervisor": {"replicas": 1}})
    assert one(objects, "Deployment", "rel-flotilla-supervisor")["spec"]["replicas"] == 1
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"] == ["rel-flotilla-coordinator"]


@check
def notes_name_every_service():
    with helm_python.Chart.load(str(CHART)) as chart:
        on = chart.render({}, name="rel", namespace="flotilla", is_install=True)
        off = chart.render({"supervisor": {"enabled": False}}, name="rel", namespace="flotilla", is_install=True)
    notes = next(v for k, v in on.items() if k.endswith("NOTES.txt"))
    assert "coordinators: 2" in notes and "supervisors: 2" in notes, notes
    assert "flotilla --nats-url <url> team" in notes, notes
    notes = next(v for k, v in off.items() if k.endswith("NOTES.txt"))
    assert "supervisors: off" in notes and " team" not in notes, notes


@check
def worker_pools_become_deployments():
    objects = render(ALL_ON)
    default = one(objects, "Deployment", "rel-flotilla-worker-default")
    assert default["spec"]["replicas"] == 7
    c = default["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == ["worker", "--pool", "default", "--concurrency", "4"]
    assert default["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 25
    gpu = one(objects, "Deployment", "rel-flotilla-worker-gpu")
    spec = gpu["spec"]["template"]["spec"]
    assert "replicas" not in gpu["spec"], "KEDA owns the replica count"
    assert spec["terminationGracePeriodSeconds"] > 120
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["containers"][0]["envFrom"] == [{"secretRef": {"name": "llm-keys"}}]
    assert spec["containers"][0]["args"][-1] == "1"
    batch = one(objects, "Deployment", "rel-flotilla-worker-batch")
    assert "replicas" not in batch["spec"], "the HPA owns the replica count"
    env = {e["name"] for e in batch["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "OPENAI_API_KEY" in env
    # Each pool connects as its own NATS user; creds-file mounts the pool's Secret.
    for pool in ("default", "gpu", "batch"):
        d = one(objects, "Deployment", f"rel-flotilla-worker-{pool}")
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert vols["nats-credentials"]["secret"]["secretName"] == f"flotilla-nats-worker-{pool}"
        assert vols["config"]["configMap"]["items"] == [{"key": f"pool-{pool}.toml", "path": "flotilla.toml"}]
        env = {e["name"]: e for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["FLOTILLA_NATS__AUTH__PATH"]["value"] == "/etc/flotilla/nats/nats.creds"


@check
def keda_scales_on_the_pool_consumer():
    objects = render(ALL_ON)
    (so,) = find(objects, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["metadata"]["name"] == "rel-flotilla-worker-gpu"
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rel-flotilla-worker-gpu"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 8)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "nats-jetstream"
    assert trigger["metadata"] == {
        "natsServerMonitoringEndpoint": "nats.messaging.svc:8222",
        "account": "FLOTILLA",
        "stream": "ACME_AI_TASKS",
        "consumer": "pool-gpu",
        "lagThreshold": "5",
        "activationLagThreshold": "0",
        "useHttps": "false",
    }
    (hpa,) = find(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "rel-flotilla-worker-batch"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


@check
def rendered_configs_say_what_each_role_needs():
    cfgs = configs(render(ALL_ON))
    assert set(cfgs) == {"coordinator.toml", "supervisor.toml", "pool-default.toml", "pool-gpu.toml", "pool-batch.toml"}
    for name, cfg in cfgs.items():
        assert cfg["pools"] == ["default", "gpu", "batch"], name
        assert cfg["nats"]["urls"] == ["nats://nats-0.nats:4222", "nats://nats-1.nats:4222"], name
        assert cfg["nats"]["prefix"] == "acme-ai", name
        assert cfg["nats"]["tls"] == {"required": True, "ca": "/etc/flotilla/nats-ca/ca.crt"}, name
        assert "auth" not in cfg["nats"], "credentials come from Secrets, never the ConfigMap"
        assert cfg["jetstream"] == {"replicas": 3, "storage": "file"}, name
        assert cfg["coordinator"]["shards"] == 32, "extraConfig reaches every role"
        assert cfg["default-agent"] == "echo"
    for name in ("coordinator.toml", "supervisor.toml"):
        assert "worker" not in cfgs[name] or "pool" not in cfgs[name]["worker"], name
    # The coordinator knows every pool's agents, and so does the supervisor (every agent is a
    # team member); each pool only its own.
    assert set(cfgs["coordinator.toml"]["agents"]) == {"echo", "vision"}
    assert cfgs["supervisor.toml"]["agents"] == cfgs["coordinator.toml"]["agents"]
    # Presence follows the workers' heartbeat; [supervisor] settings arrive through
    # supervisor.settings, merged over extraConfig's.
    assert cfgs["supervisor.toml"]["worker"]["heartbeat"] == "3s"
    assert cfgs["supervisor.toml"]["supervisor"] == {
        "stale-after": "5m",
        "team-size": 20,
        "recruit": {"allowed-roles": ["analyst"], "answer-wait": "10s"},
    }
    assert set(cfgs["pool-default.toml"]["agents"]) == {"echo"}
    assert set(cfgs["pool-gpu.toml"]["agents"]) == {"echo", "vision"}
    gpu = cfgs["pool-gpu.toml"]["worker"]
    assert gpu == {"pool": "gpu", "concurrency": 1, "shutdown-grace": "120s", "heartbeat": "3s"}, gpu


@check
def provisioning_runs_before_the_services_with_jetstream_replicas():
    job = one(render({"jetstream": {"replicas": 5}}), "Job", "rel-flotilla-provision")
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "pre-install,pre-upgrade"
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == ["--nats-url", "nats://nats:4222", "nats", "provision", "--pools", "default"]
    env = {e["name"]: e for e in c["env"]}
    assert env["FLOTILLA_JETSTREAM__REPLICAS"]["value"] == "5"
    assert env["FLOTILLA_NATS__PREFIX"]["value"] == "flotilla"
    assert env["FLOTILLA_NATS__AUTH__USER"]["valueFrom"]["secretKeyRef"]["name"] == "flotilla-nats-operator"


@check
def provisioning_creates_every_pools_consumer_ahead_of_keda():
    job = one(render(ALL_ON), "Job", "rel-flotilla-provision")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pools") + 1] == "default,gpu,batch", args


@check
def chart_secrets_store_every_scalar_as_text():
    values = {
        "secrets": {
            "flotilla-nats-operator": {"user": "operator", "password": 123456},
            "llm-keys": {"BIG": 12345678901, "RATIO": 0.5, "ON": True, "TEXT": "sk-1", "ZIP": "0123"},
        }
    }
    objects = render(values)
    kubernetes_validate(objects)
    op = one(objects, "Secret", "flotilla-nats-operator")
    assert op["stringData"] == {"user": "operator", "password": "123456"}, op
    assert op["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(op["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0, "before the provisioning job"
    keys = one(objects, "Secret", "llm-keys")["stringData"]
    assert keys == {"BIG": "12345678901", "RATIO": "0.5", "ON": "true", "TEXT": "sk-1", "ZIP": "0123"}, keys
    assert all(isinstance(v, str) for v in keys.values())
    # None by default.
    assert not [o for o in render({}) if o["kind"] == "Secret"]
    fails_with({"secrets": {"llm-keys": {"nested": {"a": 1}}}}, "/secrets/llm-keys/nested")
    fails_with({"secrets": {"Bad_Name": {"k": "v"}}}, "/secrets", "Bad_Name")
    fails_with({"secrets": {"llm-keys": {"bad key": "v"}}}, "/secrets/llm-keys", "bad key")


@check
def an_evaluation_install_creates_every_roles_secret():
    """The README's evaluation values: every Secret a pod reads is one the chart creates."""
    values = {
        "secrets": {
            f"flotilla-nats-{role}": {"user": user, "password": f"{user}-dev-password"}
            for role, user in (
                ("operator", "operator"),
                ("coordinator", "coordinator"),
                ("supervisor", "supervisor"),
                ("worker-default", "worker-default"),
            )
        }
    }
    objects = render(values)
    kubernetes_validate(objects)
    created = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    read = set()
    for obj, spec in pod_specs(objects):
        for e in spec["containers"][0]["env"]:
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                read.add((obj["metadata"]["name"], ref["name"]))
    assert ("rel-flotilla-supervisor", "flotilla-nats-supervisor") in read, read
    assert {secret for _, secret in read} == created, (read, created)


@check
def hooks_need_nothing_the_release_creates():
    """A pre-install hook runs before the release's own objects exist."""
    objects = render({})
    created = {(o["kind"], o["metadata"]["name"]) for o in objects if "helm.sh/hook" not in o["metadata"].get("annotations", {})}
    job = one(objects, "Job", "rel-flotilla-provision")
    spec = job["spec"]["template"]["spec"]
    if "serviceAccountName" in spec:
        assert ("ServiceAccount", spec["serviceAccountName"]) not in created
    for v in spec.get("volumes", []):
        if "configMap" in v:
            assert ("ConfigMap", v["configMap"]["name"]) not in created, v
    for e in spec["containers"][0]["env"]:
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        assert not ref or ("ConfigMap", ref["name"]) not in created, e


@check
def with_the_nats_dependency_flotilla_finds_it():
    """Renders a copy of the chart with a stand-in for the fetched NATS chart (only its name
    matters to our templates; the real one comes from `helm dependency build`)."""
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "flotilla"
        shutil.copytree(CHART, copy, ignore=shutil.ignore_patterns("tests"))
        stub = copy / "charts" / "nats"
        stub.mkdir(parents=True)
        (stub / "Chart.yaml").write_text("apiVersion: v2\nname: nats\nversion: 2.14.2\n")
        values = {"nats": {"enabled": True}, "workerPools": [{"name": "default", "keda": {"enabled": True}}]}
        objects = render(values, chart=copy)
    job = one(objects, "Job", "rel-flotilla-provision")
    # NATS starts with the release, so provisioning runs after install and upgrade.
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][1] == "nats://rel-nats.flotilla.svc:4222"
    for name, cfg in configs(objects).items():
        assert cfg["nats"]["urls"] == ["nats://rel-nats.flotilla.svc:4222"], name
    (so,) = find(objects, "ScaledObject")
    assert so["spec"]["triggers"][0]["metadata"]["natsServerMonitoringEndpoint"] == "rel-nats-headless.flotilla.svc:8222"


@check
def a_single_coordinator_gets_no_blocking_budget():
    objects = render({"coordinator": {"replicas": 1}})
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"] == ["rel-flotilla-supervisor"]
    assert one(objects, "Deployment", "rel-flotilla-coordinator")["spec"]["replicas"] == 1


@check
def metrics_service_monitor_and_network_policy():
    objects = render(ALL_ON)
    svc = one(objects, "Service", "rel-flotilla-metrics")
    assert svc["spec"]["ports"][0]["port"] == 9464
    (sm,) = find(objects, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (np,) = find(objects, "NetworkPolicy")
    # One Service and one policy for every Flotilla pod: the supervisors are scraped through
    # the same ServiceMonitor endpoint and restricted by the same policy as the coordinators.
    for name in ("rel-flotilla-coordinator", "rel-flotilla-supervisor", "rel-flotilla-worker-gpu"):
        labels = one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items(), name
    ports = [p["port"] for rule in np["spec"]["egress"] for p in rule.get("ports", [])]
    assert 4222 in ports and 53 in ports and 443 in ports, ports
    assert np["spec"]["ingress"][0]["ports"] == [{"port": 9464, "protocol": "TCP"}]


@check
def the_probe_port_is_configured_exactly():
    # The binary's default listener (`auto`) moves to the next free port when 9464 is taken;
    # the chart pins the port its probes use, so a clash fails the pod instead.
    for name, cfg in configs(render({})).items():
        assert cfg["telemetry"]["http-addr"] == "0.0.0.0:9464", name


@check
def a_changed_metrics_port_reaches_the_binary():
    objects = render({"metrics": {"port": 9100}})
    for name, cfg in configs(objects).items():
        assert cfg["telemetry"]["http-addr"] == "0.0.0.0:9100", name
    for name in ("rel-flotilla-coordinator", "rel-flotilla-supervisor"):
        d = one(objects, "Deployment", name)
        assert d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 9100, name


@check
def rendered_configs_load_in_the_real_binary():
    binary = os.environ.get("FLOTILLA_BIN")
    if not binary:
        print("    (skipped: FLOTILLA_BIN not set)")
        return
    with tempfile.TemporaryDirectory() as d:
        plan = Path(d) / "plan.json"
        plan.write_text('{"subtasks":[{"id":"a"},{"id":"b","dependencies":["a"]}]}')
        for values in ({}, ALL_ON, TENANTS, SHARED):
            for name, text in one(render(values), "ConfigMap", "rel-flotilla-config")["data"].items():
                path = Path(d) / name
                path.write_text(text)
                out = subprocess.run(
                    [binary, "--config", str(path), "plan", "validate", str(plan)],
                    capture_output=True,
                    text=True,
                    env={k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_")},
                )
                assert out.returncode == 0, f"{name}: {out.stdout}{out.stderr}"


CONSOLE_ON = {
    "networkPolicy": {"enabled": True},
    "console": {
        "enabled": True,
        "identityHeader": "X-Forwarded-User",
        "trustedProxies": ["10.244.0.0/16", "127.0.0.1"],
        "operators": ["alice@example.com"],
        "tokensSecret": "console-tokens",
        "ingress": {"enabled": True, "className": "nginx", "host": "flotilla.example.com",
                    "tls": [{"hosts": ["flotilla.example.com"], "secretName": "flotilla-tls"}]},
    },
}


@check
def the_console_gets_a_deployment_a_service_and_an_ingress():
    assert not [o for o in render({}) if "console" in o["metadata"]["name"]], "off by default"
    objects = render(CONSOLE_ON)
    kubernetes_validate(objects)
    d = one(objects, "Deployment", "rel-flotilla-console")
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["console"]
    assert {"name": "console", "containerPort": 9480, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["envFrom"] == [{"prefix": "FLOTILLA_CONSOLE__TOKENS__", "secretRef": {"name": "console-tokens"}}]
    env = {e["name"]: e for e in c["env"]}
    assert env["FLOTILLA_NATS__AUTH__USER"]["valueFrom"]["secretKeyRef"]["name"] == "flotilla-nats-console"
    svc = one(objects, "Service", "rel-flotilla-console")
    assert svc["spec"]["ports"] == [{"name": "console", "port": 80, "targetPort": "console", "protocol": "TCP"}]
    assert svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ing = one(objects, "Ingress", "rel-flotilla-console")
    assert ing["spec"]["ingressClassName"] == "nginx"
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rel-flotilla-console", "port": {"name": "console"}}
    cfg = configs(objects)["console.toml"]["console"]
    assert cfg == {
        "listen": "0.0.0.0:9480",
        "identity-header": "X-Forwarded-User",
        "trusted-proxies": ["10.244.0.0/16", "127.0.0.1"],
        "operators": ["alice@example.com"],
    }, cfg
    (np,) = find(objects, "NetworkPolicy")
    (rule,) = [r for r in np["spec"]["ingress"] if {"port": 9480, "protocol": "TCP"} in r["ports"]]
    # Only the ingress controller's namespace reaches the console's port by default.
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    ], rule
    binary = os.environ.get("FLOTILLA_BIN")
    if binary:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "console.toml"
            path.write_text(one(objects, "ConfigMap", "rel-flotilla-config")["data"]["console.toml"])
            plan = Path(tmp) / "plan.json"
            plan.write_text('{"subtasks":[{"id":"a"}]}')
            out = subprocess.run(
                [binary, "--config", str(path), "plan", "validate", "--offline", str(plan)],
                capture_output=True,
                text=True,
                env={k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_")},
            )
            assert out.returncode == 0, out.stdout + out.stderr


@check
def the_console_port_admits_whom_network_policy_from_says():
    proxy = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "auth"}},
              "podSelector": {"matchLabels": {"app": "oauth2-proxy"}}}]
    for peers, expected in ((proxy, proxy), ([], None)):
        values = {**CONSOLE_ON, "console": {**CONSOLE_ON["console"], "networkPolicy": {"from": peers}}}
        objects = render(values)
        kubernetes_validate(objects)
        (np,) = find(objects, "NetworkPolicy")
        (rule,) = [r for r in np["spec"]["ingress"] if {"port": 9480, "protocol": "TCP"} in r["ports"]]
        assert rule.get("from") == expected, rule
        # The metrics rule is its own.
        assert np["spec"]["ingress"][0]["ports"] == [{"port": 9464, "protocol": "TCP"}]


@check
def a_console_without_identities_is_refused():
    fails_with({"console": {"enabled": True}}, "console.identityHeader", "console.tokensSecret")


@check
def a_proxy_header_without_trusted_proxies_is_refused():
    # Any pod reaching the console could send the header and be anyone.
    fails_with(
        {"console": {"enabled": True, "identityHeader": "X-Forwarded-User"}},
        "console.identityHeader needs console.trustedProxies",
    )
    fails_with(
        {"console": {"enabled": True, "identityHeader": "X-Forwarded-User", "tokensSecret": "t"}},
        "console.trustedProxies",
    )
    fails_with(
        {"console": {"enabled": True, "identityHeader": "X-Forwarded-User", "trustedProxies": ["anywhere"]}},
        "trustedProxies",
    )
    # With tokens only, no proxy is needed.
    render({"console": {"enabled": True, "tokensSecret": "console-tokens"}})


# --- bad values fail with a clear message ------------------------------------------------


def fails_with(values: dict, *needles: str) -> None:
    message = render_error(values)
    for n in needles:
        assert n in message, f"expected {n!r} in: {message}"


@check
def keda_and_hpa_on_one_pool_are_refused():
    fails_with(
        {"workerPools": [{"name": "gpu", "keda": {"enabled": True}, "hpa": {"enabled": True}}], "nats": {"monitoringEndpoint": "n:8222"}},
        "workerPools[0] (gpu)",
        "choose one autoscaler",
    )


@check
def pool_names_must_be_tokens_and_labels():
    for bad in ("Bad.Name", "gpu.>", "has space", "UPPER", "-dash"):
        fails_with({"workerPools": [{"name": bad}]}, "workerPools/0/name")
    fails_with({"workerPools": [{"name": "a"}, {"name": "a"}]}, 'pool "a" is listed twice')
    fails_with({"workerPools": []}, "workerPools")


@check
def agents_must_be_valid_toml_of_agents():
    fails_with({"agents": "[agents.x\nkind = 1"}, "agents is not valid TOML")
    fails_with({"workerPools": [{"name": "p", "agents": "[worker]\npool = \"x\""}]}, "workerPools p: agents may only hold [agents.NAME] tables")
    fails_with(
        {"workerPools": [
            {"name": "a", "agents": '[agents.x]\nkind = "scripted"\nreply = "1"'},
            {"name": "b", "agents": '[agents.x]\nkind = "scripted"\nreply = "2"'},
        ]},
        'agent "x" is defined twice, differently (again in workerPools b: agents)',
    )
    fails_with({"defaultAgent": "missing"}, 'defaultAgent "missing" is not defined')
    fails_with({"extraConfig": "[coordinator"}, "extraConfig is not valid TOML")


@check
def nats_choices_are_checked():
    fails_with({"nats": {"enabled": True}}, "helm dependency build helm/flotilla")
    fails_with({"nats": {"url": " "}}, "nats.url is empty")
    fails_with({"workerPools": [{"name": "gpu", "keda": {"enabled": True}}]}, "keda.enabled needs nats.monitoringEndpoint")
    fails_with({"jetstream": {"replicas": 2}}, "jetstream/replicas")
    fails_with({"nats": {"authKind": "password"}}, "authKind")
    fails_with({"workerPools": [{"name": "p", "concurrency": 0}]}, "concurrency")
    fails_with({"unknownKey": 1}, "unknownKey")


@check
def supervisor_values_are_checked():
    fails_with({"supervisor": {"replicas": -1}}, "supervisor/replicas")
    fails_with({"supervisor": {"enabled": "yes"}}, "supervisor/enabled")
    fails_with({"supervisor": {"replica": 2}}, "replica")
    fails_with({"nats": {"credentials": {"supervisor": 1}}}, "credentials/supervisor")


SUPERVISOR_SETTINGS = {
    "presenceTimeout": "15s",
    "staleAfter": "10m",
    "teamSize": 25,
    "turnsPerHour": 600,
    "maxMessageBytes": 131072,
    "recruit": {
        "allowedRoles": ["analyst", "reviewer"],
        "maxTeam": 12,
        "maxRecruits": 0,
        "recruiters": ["role:lead", "planner"],
        "answerWait": "20s",
    },
}


@check
def supervisor_settings_are_unset_by_default():
    # Nothing set: no [supervisor] table, so every key keeps the binary's default.
    cfgs = configs(render({}))
    assert "supervisor" not in cfgs["supervisor.toml"], cfgs["supervisor.toml"]
    # A key set alone is rendered alone (0 is a value, not "unset").
    cfgs = configs(render({"supervisor": {"settings": {"recruit": {"maxRecruits": 0}}}}))
    assert cfgs["supervisor.toml"]["supervisor"] == {"recruit": {"max-recruits": 0}}
    # Explicit nulls are unset too.
    cfgs = configs(render({"supervisor": {"settings": {"teamSize": None, "recruit": None}}}))
    assert "supervisor" not in cfgs["supervisor.toml"], cfgs["supervisor.toml"]


@check
def supervisor_settings_render_into_its_config_only():
    cfgs = configs(render({"supervisor": {"settings": SUPERVISOR_SETTINGS}}))
    assert cfgs["supervisor.toml"]["supervisor"] == {
        "presence-timeout": "15s",
        "stale-after": "10m",
        "team-size": 25,
        "turns-per-hour": 600,
        "max-message-bytes": 131072,
        "recruit": {
            "allowed-roles": ["analyst", "reviewer"],
            "max-team": 12,
            "max-recruits": 0,
            "recruiters": ["role:lead", "planner"],
            "answer-wait": "20s",
        },
    }
    # Integers stay integers (Helm reads YAML numbers as floats).
    text = one(render({"supervisor": {"settings": SUPERVISOR_SETTINGS}}), "ConfigMap", "rel-flotilla-config")["data"]["supervisor.toml"]
    assert "team-size = 25\n" in text and "max-team = 12\n" in text, text
    for name, cfg in cfgs.items():
        if name != "supervisor.toml":
            assert "supervisor" not in cfg, name


@check
def supervisor_settings_win_over_extra_config_key_by_key():
    values = {
        "extraConfig": '[supervisor]\nstale-after = "5m"\nbatch = 64\n[supervisor.recruit]\nmax-team = 3\nanswer-wait = "1s"\n',
        "supervisor": {"settings": {"staleAfter": "7m", "recruit": {"maxTeam": 4}}},
    }
    cfgs = configs(render(values))
    assert cfgs["supervisor.toml"]["supervisor"] == {
        "stale-after": "7m",
        "batch": 64,
        "recruit": {"max-team": 4, "answer-wait": "1s"},
    }
    # The other roles keep extraConfig as written.
    assert cfgs["coordinator.toml"]["supervisor"]["stale-after"] == "5m"


@check
def supervisor_settings_are_checked():
    for bad, needle in (
        ({"teamSize": 0}, "teamSize"),
        ({"teamSize": "10"}, "teamSize"),
        ({"turnsPerHour": 0}, "turnsPerHour"),
        ({"maxMessageBytes": 524289}, "maxMessageBytes"),
        ({"staleAfter": "120"}, "staleAfter"),
        ({"staleAfter": 120}, "staleAfter"),
        ({"presenceTimeout": "soon"}, "presenceTimeout"),
        ({"teamsize": 10}, "teamsize"),
        ({"recruit": {"maxTeam": 0}}, "maxTeam"),
        ({"recruit": {"maxRecruits": -1}}, "maxRecruits"),
        ({"recruit": {"allowedRoles": ["a.b"]}}, "allowedRoles"),
        ({"recruit": {"allowedRoles": "analyst"}}, "allowedRoles"),
        ({"recruit": {"recruiters": ["has space"]}}, "recruiters"),
        ({"recruit": {"answerWait": "5"}}, "answerWait"),
        ({"recruit": {"max-team": 3}}, "max-team"),
    ):
        fails_with({"supervisor": {"settings": bad}}, needle)


@check
def supervisor_settings_load_in_the_real_binary():
    """The rendered [supervisor] table is the binary's: it loads, and what only the binary
    checks (answer-wait at most 60s, progress-resolution below stale-after) is refused."""
    binary = os.environ.get("FLOTILLA_BIN")
    if not binary:
        print("    (skipped: FLOTILLA_BIN not set)")
        return

    def load(settings: dict) -> subprocess.CompletedProcess:
        text = one(render({"supervisor": {"settings": settings}}), "ConfigMap", "rel-flotilla-config")["data"]["supervisor.toml"]
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "supervisor.toml"
            path.write_text(text)
            plan = Path(d) / "plan.json"
            plan.write_text('{"subtasks":[{"id":"a"}]}')
            return subprocess.run(
                [binary, "--config", str(path), "plan", "validate", str(plan)],
                capture_output=True,
                text=True,
                env={k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_")},
            )

    out = load(SUPERVISOR_SETTINGS)
    assert out.returncode == 0, out.stdout + out.stderr
    out = load({"recruit": {"answerWait": "2m"}})
    assert out.returncode != 0 and "answer-wait must be at most 60s" in out.stderr, out.stdout + out.stderr
    out = load({"staleAfter": "1s"})
    assert out.returncode != 0 and "progress-resolution must be shorter than stale-after" in out.stderr, out.stderr


# --- tenants -------------------------------------------------------------------------------


def render_files(values: dict) -> dict[str, str]:
    """The rendered files, path -> text, as `helm template` writes them."""
    with helm_python.Chart.load(str(CHART)) as chart:
        return chart.render(values, name="rel", namespace="flotilla", is_install=True)


def accounts_conf(values: dict) -> str:
    cm = one(render(values), "ConfigMap", "rel-flotilla-nats-accounts")
    return cm["data"]["accounts.conf"]


def container_env(deployment: dict) -> dict[str, dict]:
    return {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def nats_server_binary() -> str | None:
    for candidate in (os.environ.get("NATS_SERVER_BIN"), shutil.which("nats-server")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@check
def the_charts_accounts_template_is_the_shipped_one():
    """The chart renders tenants from its own copy of deploy/nats/accounts.conf (Helm reads
    only files inside the chart): the copy must be the file itself."""
    shipped = (ROOT / "deploy" / "nats" / "accounts.conf").read_bytes()
    copy = (CHART / "files" / "accounts.conf").read_bytes()
    assert copy == shipped, (
        "helm/flotilla/files/accounts.conf differs from deploy/nats/accounts.conf: "
        "cp deploy/nats/accounts.conf helm/flotilla/files/accounts.conf"
    )


@check
def without_tenants_nothing_changes():
    plain = render_files({})
    explicit = render_files({"tenancy": {"tenants": [], "admins": [], "natsConfig": {"enabled": False}}})
    assert plain == explicit
    objects = render({})
    assert not [o for o in objects if "flotilla.dev/tenant" in o["metadata"].get("labels", {})]
    assert not [o for o in objects if o["metadata"]["name"] == "rel-flotilla-nats-accounts"]
    assert not [k for k in configs(objects) if k.startswith("tenant-")]
    # Tenants add objects and configs; they change none of the deployment's own.
    base = {k: v for k, v in TENANTS.items() if k != "tenancy"}
    before = {(o["kind"], o["metadata"]["name"]): o for o in render(base)}
    after = {(o["kind"], o["metadata"]["name"]): o for o in render(TENANTS)}
    for key, obj in before.items():
        if key == ("ConfigMap", "rel-flotilla-config"):
            assert obj["data"].items() <= after[key]["data"].items()
        else:
            assert after[key] == obj, key


@check
def tenants_get_their_own_services():
    objects = render(TENANTS)
    kubernetes_validate(objects)
    cfgs = configs(objects)
    expected = {
        "rel-flotilla-acme-coordinator": ("acme", "tenant-coordinator", 1),
        "rel-flotilla-acme-supervisor": ("acme", "tenant-supervisor", 1),
        "rel-flotilla-acme-worker-default": ("acme", "tenant-worker", 2),
        "rel-flotilla-acme-worker-gpu": ("acme", "tenant-worker", 2),
        "rel-flotilla-beta-coordinator": ("beta", "tenant-coordinator", 2),
        "rel-flotilla-beta-supervisor": ("beta", "tenant-supervisor", 1),
        "rel-flotilla-beta-worker-default": ("beta", "tenant-worker", 1),
    }
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    tenant_deployments = {n for n, d in deployments.items() if "flotilla.dev/tenant" in d["metadata"]["labels"]}
    assert tenant_deployments == set(expected), tenant_deployments
    for name, (tenant, component, replicas) in expected.items():
        d = deployments[name]
        assert d["spec"]["replicas"] == replicas, name
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert labels["flotilla.dev/tenant"] == tenant and labels["app.kubernetes.io/component"] == component, name
        env = container_env(d)
        assert env["FLOTILLA_NATS__TENANT"] == {"name": "FLOTILLA_NATS__TENANT", "value": tenant}, name
        # Its own config: the tenant's pools only.
        (vol,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
        key = vol["configMap"]["items"][0]["key"]
        assert key.startswith(f"tenant-{tenant}-"), (name, key)
        assert cfgs[key]["pools"] == (["default", "gpu"] if tenant == "acme" else ["default"]), (name, key)
    # The deployment's own services do not act for a tenant.
    for name, d in deployments.items():
        if name not in expected:
            assert "FLOTILLA_NATS__TENANT" not in container_env(d), name
    # No Deployment's (or budget's) selector picks another's pods.
    selectors = {n: d["spec"]["selector"]["matchLabels"] for n, d in deployments.items()}
    for name, d in deployments.items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        for other, sel in selectors.items():
            assert other == name or not sel.items() <= labels.items(), (other, name)
    for pdb in find(objects, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        matched = [n for n, d in deployments.items() if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert matched == [pdb["metadata"]["name"]], (pdb["metadata"]["name"], matched)
    assert ("PodDisruptionBudget", "rel-flotilla-beta-coordinator") in {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "rel-flotilla-acme-coordinator"]
    # A tenant's pool runs like the workerPools entry of its name, at its own fixed size:
    # concurrency, agents, scheduling and the pool's Secret (user worker-gpu, + @acme).
    gpu = deployments["rel-flotilla-acme-worker-gpu"]
    c = gpu["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == ["worker", "--pool", "gpu", "--concurrency", "1"]
    assert gpu["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert container_env(gpu)["FLOTILLA_NATS__AUTH__USER"]["valueFrom"]["secretKeyRef"]["name"] == "flotilla-nats-worker-gpu"
    assert set(cfgs["tenant-acme-pool-gpu.toml"]["agents"]) == {"echo", "vision"}
    assert set(cfgs["tenant-acme-coordinator.toml"]["agents"]) == {"echo", "vision"}
    assert set(cfgs["tenant-beta-coordinator.toml"]["agents"]) == {"echo"}
    (so,) = find(objects, "ScaledObject")
    assert so["metadata"]["name"] == "rel-flotilla-worker-gpu", "tenants' pools have fixed replicas"
    # Services' Secrets are the roles' (shared: the binary logs in as <user>@<tenant>), unless
    # the tenant names its own.
    acme = container_env(deployments["rel-flotilla-acme-coordinator"])
    assert acme["FLOTILLA_NATS__AUTH__USER"]["valueFrom"]["secretKeyRef"]["name"] == "flotilla-nats-coordinator"
    own = render({"tenancy": {"tenants": [{"name": "acme", "pools": ["gpu"], "credentials": {
        "coordinator": "acme-coordinator", "supervisor": "acme-supervisor", "worker": "acme-worker-{pool}"}}]}})
    for name, secret in (
        ("rel-flotilla-acme-coordinator", "acme-coordinator"),
        ("rel-flotilla-acme-supervisor", "acme-supervisor"),
        ("rel-flotilla-acme-worker-gpu", "acme-worker-gpu"),
    ):
        env = container_env(one(own, "Deployment", name))
        assert env["FLOTILLA_NATS__AUTH__PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret, name
    # Without supervisors, none for the tenants either.
    objects = render({**TENANTS, "supervisor": {"enabled": False}})
    assert not [o for o in objects if o["metadata"]["name"].endswith("-supervisor")]
    assert not [k for k in configs(objects) if k.endswith("-supervisor.toml")]
    with helm_python.Chart.load(str(CHART)) as chart:
        files = chart.render(TENANTS, name="rel", namespace="flotilla", is_install=True)
    notes = next(v for k, v in files.items() if k.endswith("NOTES.txt"))
    assert "tenant acme (prefix flotilla-acme): coordinators: 1, supervisors: 1" in notes, notes
    assert "flotilla --tenant acme --nats-url <url> submit" in notes, notes


@check
def the_nats_accounts_hold_every_tenant():
    assert not [o for o in render({**TENANTS, "tenancy": {**TENANTS["tenancy"], "natsConfig": {"enabled": False}}})
                if o["metadata"]["name"] == "rel-flotilla-nats-accounts"]
    conf = accounts_conf(TENANTS)
    cm = one(render(TENANTS), "ConfigMap", "rel-flotilla-nats-accounts")
    assert cm["metadata"]["labels"]["app.kubernetes.io/component"] == "nats-accounts"
    assert conf.startswith("# Generated by `flotilla tenant nats-config`")
    assert conf.endswith("}\nsystem_account = SYS\n")
    # The template's blocks come first, the default tenant's: its names kept, and the rights
    # that name no installation narrowed to its own (stream management of its streams, no
    # stream listing); it keeps the NATS Agent Protocol. Then each tenant's, renamed.
    default = conf.split("# === tenant acme")[0]
    template = (CHART / "files" / "accounts.conf").read_text()
    assert default.startswith("# Generated by `flotilla tenant nats-config`")
    assert template.split("\nCOORDINATOR = {")[0] in default, "the template's header, unchanged"
    for line in ('"$JS.API.STREAM.CREATE.FLOTILLA_RUNLOG"', '"$JS.API.STREAM.INFO.KV_flotilla-runs"', '"agents.hb.>"'):
        assert line in default, line
    for line in ('"$JS.API.STREAM.CREATE.*"', '"$JS.API.STREAM.LIST"', "flotilla-acme"):
        assert line not in default, line
    for line in (
        '{ user = "coordinator@acme", password = $FLOTILLA_PASSWORD_COORDINATOR, permissions = $COORDINATOR_T_ACME }',
        '{ user = "worker-gpu@acme", password = $FLOTILLA_PASSWORD_WORKER_GPU, permissions = $WORKER_GPU_T_ACME }',
        '{ user = "client@acme", password = $FLOTILLA_PASSWORD_CLIENT_ACME, permissions = $CLIENT_T_ACME }',
        '{ user = "worker-default@beta", password = $FLOTILLA_PASSWORD_WORKER_DEFAULT, permissions = $WORKER_DEFAULT_T_BETA }',
        '{ user = "bob", password = $FLOTILLA_PASSWORD_PERSON_BOB, permissions = { publish = { allow = ["flotilla-acme.api.>"] }, subscribe = { allow = ["_INBOX_bob.>"] } } }',
        '{ user = "root", password = $FLOTILLA_PASSWORD_PERSON_ROOT, permissions = { publish = { allow = ["flotilla.api.>", "flotilla-acme.api.>", "flotilla-beta.api.>"] }, subscribe = { allow = ["_INBOX_root.>"] } } }',
        '"$JS.API.STREAM.CREATE.FLOTILLA_ACME_RUNLOG"',
        '"$JS.API.CONSUMER.CREATE.FLOTILLA_ACME_TASKS.pool-gpu.flotilla-acme.task.gpu.>"   # POOL',
        '"_INBOX_beta.>"',
    ):
        assert line in conf, line
    acme = conf.split("# === tenant acme")[1].split("# === tenant beta")[0]
    for line in acme.splitlines():
        if not line.lstrip().startswith("#"):
            assert "agents." not in line and '"flotilla.' not in line and '"_INBOX.>"' not in line, line


@check
def the_nats_accounts_are_what_the_binary_generates():
    binary = os.environ.get("FLOTILLA_BIN")
    if not binary:
        print("    (skipped: FLOTILLA_BIN not set; the chart's accounts.conf is not compared with `flotilla tenant nats-config`)")
        return
    with tempfile.TemporaryDirectory() as d:
        records = Path(d) / "tenants.json"
        records.write_text(json.dumps(TENANT_RECORDS))
        out = subprocess.run(
            [binary, "tenant", "nats-config", "--passwords", "env", "--from-file", str(records), "--admin", "root"],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_")},
        )
    assert out.returncode == 0, out.stdout + out.stderr
    chart = accounts_conf(TENANTS)
    if chart != out.stdout:
        diff = "".join(difflib.unified_diff(
            out.stdout.splitlines(True), chart.splitlines(True), "flotilla tenant nats-config", "chart", n=1))
        raise AssertionError("the chart's accounts.conf differs from the binary's:\n" + diff[:6000])


@check
def nats_server_accepts_the_accounts():
    server = nats_server_binary()
    if not server:
        print("    (skipped: no nats-server on PATH or in NATS_SERVER_BIN)")
        return
    conf = accounts_conf(TENANTS)
    variables = sorted(set(re.findall(r"\$(FLOTILLA_PASSWORD_[A-Z0-9_]+)", conf)))
    assert "FLOTILLA_PASSWORD_CLIENT_BETA" in variables and "FLOTILLA_PASSWORD_PERSON_CAROL" in variables, variables
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "accounts.conf"
        path.write_text(conf)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_PASSWORD_")}
        # nats-server resolves the passwords from its environment when it loads the file.
        out = subprocess.run(
            [server, "-c", str(path), "-t"],
            capture_output=True,
            text=True,
            env={**env, **{v: f"{v.lower().replace('_', '-')}-secret" for v in variables}},
        )
        assert out.returncode == 0, out.stdout + out.stderr
        out = subprocess.run([server, "-c", str(path), "-t"], capture_output=True, text=True, env=env)
        assert out.returncode != 0 and "FLOTILLA_PASSWORD_" in out.stdout + out.stderr, out.stdout + out.stderr


@check
def tenant_values_are_checked():
    for bad in ("Acme", "-acme", "acme-", "a.b", "a_b", "x" * 33):
        fails_with({"tenancy": {"tenants": [{"name": bad}]}}, "/tenancy/tenants/0/name", f"'{bad}'")
    for reserved in ("default", "all", "tenants"):
        fails_with({"tenancy": {"tenants": [{"name": "ok"}, {"name": reserved}]}}, "/tenancy/tenants/1/name")
    fails_with({"tenancy": {"tenants": [{"pools": ["default"]}]}}, "name")
    fails_with({"tenancy": {"tenants": [{"name": "acme", "pools": ["GPU"]}]}}, "/tenancy/tenants/0/pools/0")
    fails_with({"tenancy": {"tenants": [{"name": "acme", "pools": []}]}}, "/tenancy/tenants/0/pools")
    fails_with({"tenancy": {"tenants": [{"name": "acme", "people": ["a.b"]}]}}, "/tenancy/tenants/0/people/0")
    fails_with({"tenancy": {"admins": ["has space"]}}, "/tenancy/admins/0")
    fails_with({"tenancy": {"tenants": [{"name": "acme", "workers": {"replicas": -1}}]}}, "/tenancy/tenants/0/workers/replicas")
    fails_with({"tenancy": {"tenants": [{"name": "acme", "quota": 1}]}}, "quota")
    fails_with({"tenancy": {"tenants": [{"name": "acme"}, {"name": "acme"}]}}, 'tenant "acme" is listed twice')
    fails_with({"tenancy": {"tenants": [{"name": "acme", "pools": ["gpu", "gpu"]}]}}, '(acme): pool "gpu" is listed twice')
    fails_with(
        {"workerPools": [{"name": "worker-x"}], "tenancy": {"tenants": [{"name": "worker", "pools": ["x"]}]}},
        "would be named rel-flotilla-worker-worker-x, like that of worker pool worker-x",
    )
    fails_with({"prefix": "other", "tenancy": {"natsConfig": {"enabled": True}}}, "tenancy.natsConfig.enabled", "not \"other\"")


# --- shared tenants ------------------------------------------------------------------------


def deployments_of(objects) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def config_key(deployment: dict) -> str:
    (vol,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    return vol["configMap"]["items"][0]["key"]


def assert_selectors_apart(objects) -> None:
    """No Deployment's selector picks another's pods; each budget picks its own only."""
    deployments = deployments_of(objects)
    selectors = {n: d["spec"]["selector"]["matchLabels"] for n, d in deployments.items()}
    for name, d in deployments.items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert selectors[name].items() <= labels.items(), name
        for other, sel in selectors.items():
            assert other == name or not sel.items() <= labels.items(), (other, name)
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        matched = [n for n, d in deployments.items() if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert matched == [pdb["metadata"]["name"]], (pdb["metadata"]["name"], matched)


@check
def shared_tenants_share_one_set_of_services():
    objects = render(SHARED)
    kubernetes_validate(objects)
    deployments = deployments_of(objects)
    cfgs = configs(objects)
    shared = {
        # name: (component, args, replicas, Secret, config key)
        "rel-flotilla-shared-coordinator": (
            "shared-coordinator", ["coordinator", "--tenants", "acme,beta"], 1,
            "flotilla-nats-coordinator", "shared-coordinator.toml"),
        "rel-flotilla-shared-supervisor": (
            "shared-supervisor", ["supervisor", "--tenants", "acme,beta"], 1,
            "flotilla-nats-supervisor", "shared-supervisor.toml"),
        "rel-flotilla-shared-worker-default": (
            "shared-worker", ["worker", "--pool", "default", "--concurrency", "4", "--tenants", "acme,beta"], 1,
            "flotilla-nats-worker-default", "shared-pool-default.toml"),
        "rel-flotilla-shared-worker-gpu": (
            "shared-worker", ["worker", "--pool", "gpu", "--concurrency", "1", "--tenants", "acme"], 1,
            "flotilla-nats-worker-gpu", "shared-pool-gpu.toml"),
    }
    assert {n for n in deployments if "-shared-" in n} == set(shared), sorted(deployments)
    for name, (component, args, replicas, secret, key) in shared.items():
        d = deployments[name]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == component, name
        assert d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component, name
        assert "flotilla.dev/tenant" not in labels and "flotilla.dev/tenant" not in d["metadata"]["labels"], name
        assert d["metadata"]["annotations"]["flotilla.dev/tenants"] == args[-1], name
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["args"] == args, (name, c["args"])
        assert d["spec"]["replicas"] == replicas, name
        # The deployment's own credentials; it acts for its tenants through --tenants only.
        env = container_env(d)
        assert "FLOTILLA_NATS__TENANT" not in env, name
        for k in ("USER", "PASSWORD"):
            assert env[f"FLOTILLA_NATS__AUTH__{k}"]["valueFrom"]["secretKeyRef"]["name"] == secret, name
        assert config_key(d) == key, name
        assert cfgs[key]["pools"] == ["default", "gpu"], (name, cfgs[key]["pools"])
        assert "tenant" not in cfgs[key]["nats"], name
    # A shared pool runs like the workerPools entry of its name (concurrency, agents,
    # scheduling), at fixed replicas: the deployment's own gpu pool keeps its KEDA scaler.
    gpu = deployments["rel-flotilla-shared-worker-gpu"]
    assert gpu["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (so,) = find(objects, "ScaledObject")
    assert so["metadata"]["name"] == "rel-flotilla-worker-gpu"
    assert set(cfgs["shared-pool-gpu.toml"]["agents"]) == {"echo", "vision"}
    assert set(cfgs["shared-pool-default.toml"]["agents"]) == {"echo"}
    assert cfgs["shared-pool-gpu.toml"]["worker"]["pool"] == "gpu"
    assert set(cfgs["shared-coordinator.toml"]["agents"]) == {"echo", "vision"}
    assert cfgs["shared-supervisor.toml"]["agents"] == cfgs["shared-coordinator.toml"]["agents"]
    cm = one(objects, "ConfigMap", "rel-flotilla-config")["data"]
    assert cm["shared-pool-gpu.toml"].startswith(
        "# flotilla.toml rendered by the Helm chart helm/flotilla (shared by tenants acme, worker pool gpu)")
    # Services of their own only for gamma; none, and no configs, for the shared tenants.
    per_tenant = {n for n, d in deployments.items() if "flotilla.dev/tenant" in d["metadata"]["labels"]}
    assert per_tenant == {"rel-flotilla-gamma-coordinator", "rel-flotilla-gamma-supervisor", "rel-flotilla-gamma-worker-default"}, per_tenant
    for name in per_tenant:
        assert container_env(deployments[name])["FLOTILLA_NATS__TENANT"]["value"] == "gamma", name
    assert not [k for k in cfgs if k.startswith(("tenant-acme-", "tenant-beta-"))], sorted(cfgs)
    assert "tenant-gamma-coordinator.toml" in cfgs
    assert_selectors_apart(objects)
    # One replica each by default: no budget that would block every drain.
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget" and "-shared-" in o["metadata"]["name"]]
    # Replicas from tenancy.shared; from 2 replicas the coordinators' and supervisors' budgets.
    objects = render({**SHARED, "tenancy": {**SHARED["tenancy"], "shared": {
        "coordinator": {"replicas": 3}, "supervisor": {"replicas": 2}, "workers": {"replicas": 4}}}})
    kubernetes_validate(objects)
    deployments = deployments_of(objects)
    assert deployments["rel-flotilla-shared-coordinator"]["spec"]["replicas"] == 3
    assert deployments["rel-flotilla-shared-supervisor"]["spec"]["replicas"] == 2
    assert deployments["rel-flotilla-shared-worker-default"]["spec"]["replicas"] == 4
    assert deployments["rel-flotilla-shared-worker-gpu"]["spec"]["replicas"] == 4
    budgets = {o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert {"rel-flotilla-shared-coordinator", "rel-flotilla-shared-supervisor"} <= budgets, budgets
    assert_selectors_apart(objects)
    # Without supervisors, no shared one either.
    objects = render({**SHARED, "supervisor": {"enabled": False}})
    assert not [o for o in objects if o["metadata"]["name"].endswith("-supervisor")]
    assert "shared-supervisor.toml" not in configs(objects)
    # The deployment's own services are those without tenants.
    base = {k: v for k, v in SHARED.items() if k != "tenancy"}
    before = {(o["kind"], o["metadata"]["name"]): o for o in render(base)}
    after = {(o["kind"], o["metadata"]["name"]): o for o in render(SHARED)}
    for key, obj in before.items():
        if key == ("ConfigMap", "rel-flotilla-config"):
            assert obj["data"].items() <= after[key]["data"].items()
        else:
            assert after[key] == obj, key
    notes = next(v for k, v in render_files(SHARED).items() if k.endswith("NOTES.txt"))
    assert "shared by tenants acme, beta (flotilla <role> --tenants): coordinators: 1, supervisors: 1" in notes, notes
    assert "pool gpu (acme): 1 replicas, 1 tasks each, shared" in notes, notes
    assert "tenant gamma (prefix flotilla-gamma)" in notes and "tenant acme (prefix" not in notes, notes


@check
def shared_tenants_keep_their_nats_users():
    """Shared or not, a tenant's NATS users are the same: the shared services log in as
    <user>@<tenant> for each of their tenants."""
    conf = accounts_conf(SHARED)
    unshared = {**SHARED, "tenancy": {**SHARED["tenancy"], "tenants": [
        {k: v for k, v in t.items() if k != "shared"} for t in SHARED["tenancy"]["tenants"]]}}
    assert conf == accounts_conf(unshared)
    for user in ("coordinator@acme", "supervisor@beta", "worker-default@beta", "worker-gpu@acme", "coordinator@gamma"):
        assert f'{{ user = "{user}", ' in conf, user


@check
def without_shared_tenants_nothing_shared_renders():
    for values in ({}, TENANTS):
        objects = render(values)
        assert not [o for o in objects if "-shared-" in o["metadata"]["name"]]
        assert not [k for k in configs(objects) if k.startswith("shared-")]
    # shared: false is the default; tenancy.shared alone renders nothing.
    explicit = {**TENANTS, "tenancy": {**TENANTS["tenancy"], "tenants": [
        {**t, "shared": False} for t in TENANTS["tenancy"]["tenants"]],
        "shared": {"coordinator": {"replicas": 3}, "workers": {"replicas": 2}}}}
    assert render_files(explicit) == render_files(TENANTS)
    assert render_files({"tenancy": {"shared": {"supervisor": {"replicas": 2}}}}) == render_files({})


@check
def shared_values_are_checked():
    fails_with({"tenancy": {"tenants": [{"name": "acme", "shared": "yes"}]}}, "/tenancy/tenants/0/shared")
    fails_with({"tenancy": {"shared": {"workers": {"replicas": -1}}}}, "/tenancy/shared/workers/replicas")
    fails_with({"tenancy": {"shared": {"coordinator": {"replicas": "2"}}}}, "/tenancy/shared/coordinator/replicas")
    fails_with({"tenancy": {"shared": {"console": {}}}}, "console")
    # A shared tenant has no services of its own to size or to give Secrets.
    for key, value in (("workers", {"replicas": 2}), ("coordinator", {"replicas": 2}),
                       ("supervisor", {"replicas": 1}), ("credentials", {"coordinator": "acme-c"})):
        fails_with({"tenancy": {"tenants": [{"name": "ok"}, {"name": "acme", "shared": True, key: value}]}},
                   f"tenancy.tenants[1] (acme): {key} is not used by a shared tenant", "shared: false")
    # One Secret's user and password for every tenant: nkeys and creds files name one user.
    for kind in ("nkey", "creds-file"):
        fails_with({"nats": {"authKind": kind}, "tenancy": {"tenants": [{"name": "acme", "shared": True}]}},
                   "tenancy.tenants[0] (acme): shared needs nats.authKind user-password")
    render({"nats": {"authKind": "nkey"}, "tenancy": {"tenants": [{"name": "acme", "credentials": {"coordinator": "a"}}]}})
    # The shared coordinator runs no workflow agents.
    workflow = '[agents.review]\nkind = "sequential"\nagents = ["echo"]\n'
    values = {"workerPools": [{"name": "default"}, {"name": "flows", "agents": workflow}],
              "tenancy": {"tenants": [{"name": "acme", "shared": True, "pools": ["default", "flows"]}]}}
    fails_with(values, "tenancy.tenants[0] (acme): shared, but its pool flows has workflow agent \"review\" (kind sequential)",
               "shared: false")
    values["tenancy"]["tenants"][0]["shared"] = False
    render(values)
    # A tenant named like the shared set clashes with it.
    fails_with({"tenancy": {"tenants": [{"name": "acme", "shared": True}, {"name": "shared"}]}},
               "would be named rel-flotilla-shared-coordinator, like that of the shared tenants' coordinators")
    render({"tenancy": {"tenants": [{"name": "shared", "shared": True}]}})


@check
def shared_services_start_in_the_real_binary():
    """Each shared Deployment's command, environment and rendered flotilla.toml, run by the
    binary against a NATS that is not there: it gets as far as connecting (arguments and
    configuration accepted, --tenants not combined with a tenant), and refuses once the
    environment also names a tenant."""
    binary = os.environ.get("FLOTILLA_BIN")
    if not binary:
        print("    (skipped: FLOTILLA_BIN not set)")
        return
    objects = render(SHARED)
    data = one(objects, "ConfigMap", "rel-flotilla-config")["data"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_")}
    with tempfile.TemporaryDirectory() as d:
        for name, dep in deployments_of(objects).items():
            if "-shared-" not in name:
                continue
            (c,) = dep["spec"]["template"]["spec"]["containers"]
            path = Path(d) / config_key(dep)
            cfg = tomllib.loads(data[config_key(dep)])
            path.write_text(data[config_key(dep)].replace(f'"{cfg["nats"]["urls"][0]}"', '"nats://127.0.0.1:1"'))
            env = dict(base)
            for e in c["env"]:
                env[e["name"]] = e.get("value", "from-a-secret")
            env["FLOTILLA_CONFIG"] = str(path)
            cmd = [binary, *c["args"], "--http-addr", "off"]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
            assert out.returncode != 0 and "NATS server unreachable" in out.stderr, (name, out.stdout + out.stderr)
            assert "127.0.0.1:1" in out.stderr, (name, out.stderr)
            out = subprocess.run(cmd, capture_output=True, text=True, env={**env, "FLOTILLA_NATS__TENANT": "acme"}, timeout=60)
            assert out.returncode != 0 and "--tenants serves several tenants" in out.stderr, (name, out.stdout + out.stderr)


def main() -> int:
    passed = failed = 0
    for fn in CHECKS:
        try:
            fn()
        except Exception:
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc()
        else:
            passed += 1
            print(f"ok   {fn.__name__}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
