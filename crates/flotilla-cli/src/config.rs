//! `flotilla.toml`: one file configures every role.
//!
//! Layers, later wins: built-in defaults → the config file (`--config`, `$FLOTILLA_CONFIG`,
//! or `./flotilla.toml`, or `./config/flotilla.toml`) → `FLOTILLA_*` environment variables
//! (`__` separates sections: `FLOTILLA_NATS__PREFIX=acme`) → command-line flags. The result is
//! validated before anything connects.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use flotilla_bus::{JetStreamOptions, NatsOptions};
use flotilla_coordinator::CoordinatorOptions;
use flotilla_model::team::MemberCard;
use flotilla_model::validate::{AgentCatalog, ValidationContext};
use flotilla_supervisor::SupervisorOptions;
use flotilla_telemetry::TelemetryOptions;
use flotilla_worker::{AgentDefinition, AgentEntry, AgentRegistry, RoleConfig, WorkerOptions};
use serde::{Deserialize, Serialize};

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub(crate) struct Config {
    /// How to reach NATS.
    pub(crate) nats: NatsOptions,
    /// Streams and buckets.
    pub(crate) jetstream: JetStreamOptions,
    /// Worker pools that exist in this installation; plans naming another pool are rejected.
    pub(crate) pools: Vec<String>,
    /// The agent that runs tasks naming none.
    pub(crate) default_agent: Option<String>,
    /// Agent definitions with their member cards, by name.
    pub(crate) agents: BTreeMap<String, AgentEntry>,
    /// System prompts of team roles for LLM agents (on top of the shipped ones).
    pub(crate) roles: BTreeMap<String, RoleConfig>,
    /// Coordinator settings.
    pub(crate) coordinator: CoordinatorOptions,
    /// Worker settings.
    pub(crate) worker: WorkerOptions,
    /// Supervisor settings.
    pub(crate) supervisor: SupervisorOptions,
    /// Humans in the loop: which tasks wait for a person's approval, and for how long.
    pub(crate) hitl: flotilla_machine::policy::HitlConfig,
    /// Health, readiness and metrics listener; log format.
    pub(crate) telemetry: TelemetryOptions,
    /// The web console: where it listens, identities and operators.
    pub(crate) console: flotilla_console::ConsoleOptions,
    /// The NATS Agent Protocol: which agents the coordinators expose on the `agents` micro
    /// service, under which owner, how often they beat.
    pub(crate) agents_protocol: flotilla_agents::AgentsProtocolOptions,
    /// Directory of the config file: relative agent paths resolve against it.
    #[serde(skip)]
    pub(crate) base_dir: PathBuf,
    /// The config file read, if any (none: defaults and `FLOTILLA_*` variables only).
    #[serde(skip)]
    pub(crate) file: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nats: NatsOptions::default(),
            jetstream: JetStreamOptions::default(),
            // Every installation has the default pool.
            pools: vec![flotilla_model::plan::DEFAULT_POOL.to_owned()],
            default_agent: None,
            agents: BTreeMap::new(),
            roles: BTreeMap::new(),
            coordinator: CoordinatorOptions::default(),
            worker: WorkerOptions::default(),
            supervisor: SupervisorOptions::default(),
            hitl: flotilla_machine::policy::HitlConfig::default(),
            telemetry: TelemetryOptions::default(),
            console: flotilla_console::ConsoleOptions::default(),
            agents_protocol: flotilla_agents::AgentsProtocolOptions::default(),
            base_dir: PathBuf::from("."),
            file: None,
        }
    }
}

/// Picks the config file: explicit path, `$FLOTILLA_CONFIG`, then the usual places.
fn config_file(explicit: Option<&Path>) -> anyhow::Result<Option<PathBuf>> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!("config file {} does not exist", p.display());
        }
        return Ok(Some(p.to_path_buf()));
    }
    if let Some(p) = std::env::var_os("FLOTILLA_CONFIG") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("FLOTILLA_CONFIG={} does not exist", p.display());
        }
        return Ok(Some(p));
    }
    Ok(["flotilla.toml", "config/flotilla.toml"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file()))
}

/// What to say when a deployment starts without agents and without a config file: it would
/// run, and fail every task `unknown_agent`. `None` when there is a file or an agent.
pub(crate) fn no_agents_warning(config: &Config) -> Option<String> {
    if config.file.is_some() || !config.agents.is_empty() {
        return None;
    }
    Some(
        "warning: no configuration file found (--config, $FLOTILLA_CONFIG, ./flotilla.toml, ./config/flotilla.toml) and no agents in FLOTILLA_AGENTS__*: this deployment has no agents, so every task fails unknown_agent. Run `flotilla init` for a starter flotilla.toml with working agents, pass --config FILE, or run it in the Flotilla repository's root (its config/flotilla.toml has the example agents)".to_owned(),
    )
}

/// `--tenant`, set once before any configuration is loaded.
static TENANT_FLAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Records `--tenant`: every configuration loaded after acts for that tenant.
pub(crate) fn set_tenant_flag(tenant: &str) {
    let _ = TENANT_FLAG.set(tenant.to_owned());
}

/// Loads and validates the configuration.
pub(crate) fn load(explicit: Option<&Path>, nats_url: Option<&str>) -> anyhow::Result<Config> {
    let file = config_file(explicit)?;
    let mut figment = Figment::from(Serialized::defaults(Config::default()));
    if let Some(f) = &file {
        figment = figment.merge(Toml::file(f));
    }
    figment = figment.merge(
        Env::prefixed("FLOTILLA_")
            .map(|k| env_key(k.as_str()).into())
            .filter(|k| is_config_key(k.as_str())),
    );
    let mut config: Config = figment.extract().map_err(|e| {
        let source = file
            .as_ref()
            .map(|f| f.display().to_string())
            .unwrap_or_else(|| "defaults".into());
        anyhow::anyhow!("invalid configuration ({source}): {e}")
    })?;
    if let Some(t) = TENANT_FLAG.get() {
        config.nats.tenant = Some(t.clone());
    }
    if let Some(url) = nats_url {
        config.nats.urls = url.split(',').map(str::to_owned).collect();
    } else if std::env::var_os("FLOTILLA_NATS__URLS").is_none()
        && let Some(url) = running_up_url(Path::new(LOCAL_DIR))
    {
        // A `flotilla up` running in this directory: its embedded server wins over the
        // config file (but not over an explicit flag or environment variable).
        tracing::debug!(%url, "Using the NATS server of `flotilla up` in this directory");
        config.nats.urls = vec![url];
    }
    config.base_dir = file
        .as_ref()
        .and_then(|f| f.parent().map(Path::to_path_buf))
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| PathBuf::from("."));
    // The memory bucket's age is the supervisor's setting; every process that provisions
    // gives the bucket the same age.
    config.jetstream.memory_max_age = config.supervisor.memory.max_age;
    // The coordinator admits runs with the deployment's escalation policy.
    config.coordinator.hitl = config.hitl.clone();
    config.file = file.clone();
    config.validate()?;
    tracing::debug!(file = ?file, "Configuration loaded");
    Ok(config)
}

/// Top-level keys of `flotilla.toml`: `FLOTILLA_*` variables map onto these (`__` separates
/// sections, `_` stands for `-`).
const TOP_LEVEL_KEYS: &[&str] = &[
    "nats",
    "jetstream",
    "pools",
    "default-agent",
    "agents",
    "roles",
    "coordinator",
    "worker",
    "supervisor",
    "hitl",
    "telemetry",
    "console",
    "agents-protocol",
];

/// `FLOTILLA_*` variables that are not configuration: Flotilla's own (set for exec agents,
/// selecting the config file and log level, or naming the model endpoint of
/// `scripts/demo-llm` and the opt-in real-model tests). Ignored silently.
const NON_CONFIG_VARS: &[&str] = &[
    "CONFIG",
    "LOG",
    "NATS_URL",
    "RUN_ID",
    "ROOT_RUN_ID",
    "TASK_ID",
    "ATTEMPT",
    "ATTEMPT_ID",
    "DELIVERY",
    "SESSION_ID",
    "PREFIX",
    "PRODUCES",
    "DATAFLOW",
    "ROLE",
    "BIN",
    "SHIM_PARENT",
    "NATS_USER",
    "NATS_PASSWORD",
    "NATS_TOKEN",
    "NATS_CREDS",
    "NATS_NKEY",
    "LLM_BASE_URL",
    "LLM_MODEL",
    "LLM_API_KEY",
    "LLM_HOME",
    "LLM_JOBS",
    "LLM_THREADS",
    "LLM_CTX",
];

/// The config key path of a `FLOTILLA_` variable's name (prefix already removed).
fn env_key(name: &str) -> String {
    name.to_ascii_lowercase()
        .replace("__", ".")
        .replace('_', "-")
}

/// Whether a key path (from [`env_key`]) names configuration.
fn is_config_key(key: &str) -> bool {
    let top = key.split('.').next().unwrap_or_default();
    TOP_LEVEL_KEYS.contains(&top)
}

/// Warns once about `FLOTILLA_*` variables that are neither configuration nor Flotilla's own.
/// Kubernetes injects such variables for a Service named `flotilla` (`FLOTILLA_PORT=tcp://…`,
/// `FLOTILLA_SERVICE_HOST`); they must not stop anything from starting.
/// Call once logging is set up (services load their config before that).
pub(crate) fn warn_unknown_env() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let unknown: Vec<String> = std::env::vars()
        .filter_map(|(n, _)| n.strip_prefix("FLOTILLA_").map(str::to_owned))
        .filter(|n| !NON_CONFIG_VARS.contains(&n.as_str()) && !is_config_key(&env_key(n)))
        .map(|n| format!("FLOTILLA_{n}"))
        .collect();
    if !unknown.is_empty() {
        WARNED.call_once(|| {
            tracing::warn!(
                variables = %unknown.join(", "),
                "Ignoring environment variables that are not Flotilla settings (Kubernetes service links set such variables; `enableServiceLinks: false` avoids them)"
            );
        });
    }
}

/// Where `flotilla up` keeps its data by default, relative to the working directory.
pub(crate) const LOCAL_DIR: &str = ".flotilla";

/// The URL of the embedded NATS of a `flotilla up` that is running with `dir` as its data
/// directory (its `nats-url` file holds the URL and the process id; a stale file of a
/// stopped process is ignored).
pub(crate) fn running_up_url(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("nats-url")).ok()?;
    let mut lines = text.lines();
    let url = lines.next()?.trim().to_owned();
    let pid: i32 = lines.next()?.trim().parse().ok()?;
    let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok();
    (alive && !url.is_empty()).then_some(url)
}

impl Config {
    /// Checks every section without I/O.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        self.nats.validate().context("invalid [nats] section")?;
        self.jetstream
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid [jetstream] section: {e}"))?;
        if self.pools.is_empty() {
            bail!("pools is empty: configure at least one worker pool");
        }
        for p in &self.pools {
            flotilla_model::token::check_name(p)
                .map_err(|e| anyhow::anyhow!("pools: pool {p:?} {e}"))?;
        }
        self.coordinator
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid [coordinator] section: {e}"))?;
        self.console.validate()?;
        self.agents_protocol
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid [agents-protocol] section: {e}"))?;
        flotilla_agents::Exposer::addresses(
            &self.agents_protocol,
            self.nats.effective_prefix().as_str(),
            &self.exposed_agents(),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.detail()))?;
        if let Some(p) = self.hitl.problems().first() {
            bail!("invalid [hitl] section: {p}");
        }
        let planner = &self.coordinator.planner;
        if let Some(agent) = &planner.agent
            && !self.agents.contains_key(agent)
        {
            bail!(
                "invalid [coordinator.planner] section: agent {agent:?} is not defined in [agents]"
            );
        }
        if planner.agent.is_some() && !self.pools.contains(&planner.pool) {
            bail!(
                "invalid [coordinator.planner] section: pool {:?} is not one of pools",
                planner.pool
            );
        }
        self.worker
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid [worker] section: {e}"))?;
        self.supervisor
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid [supervisor] section: {e}"))?;
        self.telemetry
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid [telemetry] section: {e}"))?;
        for (name, entry) in &self.agents {
            if let Some(undo) = &entry.compensate
                && !self.agents.contains_key(undo)
            {
                bail!(
                    "invalid [agents.{name}]: compensate names agent {undo:?}, which is not defined in [agents]"
                );
            }
        }
        self.agent_registry()?;
        Ok(())
    }

    /// The agents this configuration defines, with the roles their member cards give them
    /// (a worker claims anycast tasks of those roles).
    pub(crate) fn agent_registry(&self) -> anyhow::Result<AgentRegistry> {
        let cards = self.member_cards();
        Ok(AgentRegistry::from_config(
            &self.agent_definitions(),
            &self.roles,
            self.default_agent.clone(),
            &self.base_dir,
        )
        .map_err(|e| anyhow::anyhow!("invalid [agents]: {e}"))?
        .with_cards(cards.iter().map(|(n, c)| (n.as_str(), c))))
    }

    /// The workflow agents, for the coordinators' embedded worker (empty: none defined).
    pub(crate) fn workflow_registry(&self) -> anyhow::Result<AgentRegistry> {
        AgentRegistry::workflows(&self.agent_definitions())
            .map_err(|e| anyhow::anyhow!("invalid [agents]: {e}"))
    }

    /// The agent definitions, without their cards.
    pub(crate) fn agent_definitions(&self) -> BTreeMap<String, AgentDefinition> {
        self.agents
            .iter()
            .map(|(n, e)| (n.clone(), e.definition.clone()))
            .collect()
    }

    /// The agent definitions the coordinators expose on the NATS Agent Protocol: those with
    /// `expose = true`, or all with `[agents-protocol] expose-all`.
    pub(crate) fn exposed_agents(&self) -> Vec<flotilla_agents::ExposedAgent> {
        self.agents
            .iter()
            .filter(|(_, e)| e.expose || self.agents_protocol.expose_all)
            .map(|(n, e)| flotilla_agents::ExposedAgent {
                name: n.clone(),
                card: e.card.clone(),
            })
            .collect()
    }

    /// The member cards of the defined agents (the supervisor's roster).
    pub(crate) fn member_cards(&self) -> BTreeMap<String, MemberCard> {
        self.agents
            .iter()
            .map(|(n, e)| (n.clone(), e.card.clone()))
            .collect()
    }

    /// What plan validation knows about this installation.
    pub(crate) fn validation_context(&self) -> ValidationContext {
        ValidationContext {
            pools: Some(self.pools.iter().cloned().collect::<BTreeSet<_>>()),
            agents: (!self.agents.is_empty()).then(|| {
                AgentCatalog {
                    names: self.agents.keys().cloned().collect(),
                    default: self.default_agent.clone(),
                    workflows: self
                        .agents
                        .iter()
                        .filter(|(_, d)| d.definition.is_workflow())
                        .map(|(n, _)| n.clone())
                        .collect(),
                    roles: Default::default(),
                    compensations: self
                        .agents
                        .iter()
                        .filter_map(|(n, e)| e.compensate.clone().map(|c| (n.clone(), c)))
                        .collect(),
                }
                .with_roles(
                    self.agents
                        .iter()
                        .map(|(n, e)| (n.as_str(), e.card.roles.as_slice())),
                )
            }),
            ..ValidationContext::default()
        }
    }
}

impl Config {
    /// A short fingerprint of what makes this a deployment: the settings that decide how a
    /// plan is validated and run — `pools`, `default-agent`, `[agents]`, `[roles]`,
    /// `[coordinator]`, `[jetstream]` — and not those that differ from one process to the
    /// next (NATS URLs and credentials, `[worker]`, `[telemetry]`). Coordinators advertise it
    /// in their micro-service metadata; `flotilla up --nats-url` compares it with its own to
    /// find another deployment's coordinators on the same prefix. The first 12 hex digits of
    /// a SHA-256 over canonical JSON (object keys sorted).
    pub(crate) fn fingerprint(&self) -> String {
        use sha2::Digest;
        let relevant = serde_json::json!({
            "pools": self.pools,
            "default-agent": self.default_agent,
            "agents": self.agents,
            "roles": self.roles,
            "coordinator": self.coordinator,
            "jetstream": self.jetstream,
        });
        let digest = sha2::Sha256::digest(canonical_json(&relevant).as_bytes());
        digest.iter().take(6).map(|b| format!("{b:02x}")).collect()
    }
}

/// `v` as JSON with every object's keys sorted, whatever map type produced it.
fn canonical_json(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| {
                    format!(
                        "{}:{}",
                        serde_json::Value::String(k.clone()),
                        canonical_json(&map[k])
                    )
                })
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        serde_json::Value::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(canonical_json)
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {

    /// Every top-level section of the configuration can be set from the environment:
    /// `FLOTILLA_HITL__TRUST__ENABLED` was once ignored as "not a Flotilla setting".
    #[test]
    fn every_top_level_key_is_reachable_from_the_environment() {
        let value = serde_json::to_value(Config::default()).expect("the defaults serialize");
        let keys: Vec<String> = value
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        assert!(keys.len() > 5, "{keys:?}");
        for key in keys {
            assert!(
                TOP_LEVEL_KEYS.contains(&key.as_str()),
                "[{key}] cannot be set by a FLOTILLA_ variable"
            );
        }
        assert!(is_config_key(&env_key("HITL__TRUST__ENABLED")));
    }

    use super::*;

    #[test]
    fn the_fingerprint_follows_the_deployment_settings_only() {
        let base = Config::default();
        let same = base.fingerprint();
        assert_eq!(same.len(), 12);
        assert_eq!(Config::default().fingerprint(), same, "stable");
        // Per-process settings leave it alone.
        let mut process = Config::default();
        process.nats.urls = vec!["nats://elsewhere:4222".into()];
        process.worker.concurrency = 64;
        process.telemetry.http_addr = flotilla_telemetry::HttpAddr::Off;
        assert_eq!(process.fingerprint(), same);
        // What decides how plans run changes it.
        let mut pools = Config::default();
        pools.pools.push("gpu".into());
        assert_ne!(pools.fingerprint(), same);
        let agents = Config {
            default_agent: Some("echo".into()),
            ..Config::default()
        };
        assert_ne!(agents.fingerprint(), same);
    }

    #[test]
    fn the_shipped_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/flotilla.toml");
        let loaded = load(Some(&path), None).expect("shipped config loads");
        assert!(loaded.pools.contains(&"default".to_string()));
        // It documents the defaults: services started from the repository with it behave as
        // without it (two services on one host: `auto` listeners).
        assert_eq!(loaded.telemetry, TelemetryOptions::default());
        assert_eq!(loaded.worker, WorkerOptions::default());
        assert_eq!(loaded.nats, NatsOptions::default());
        assert_eq!(
            loaded.agents_protocol,
            flotilla_agents::AgentsProtocolOptions::default()
        );
        assert!(
            loaded.exposed_agents().is_empty(),
            "nothing exposed unasked"
        );
    }

    #[test]
    fn a_silent_link_is_given_up_within_two_worker_heartbeats_by_default() {
        // A worker cut off from its node reconnects elsewhere before its tasks are handed on.
        assert!(NatsOptions::default().dead_link_after() <= 2 * WorkerOptions::default().heartbeat);
    }

    #[test]
    fn exposed_agents_opt_in_and_need_distinct_tokens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        let agents = "[agents.writer]\nkind = \"scripted\"\nexpose = true\nroles = [\"writer\"]\n[agents.quiet]\nkind = \"scripted\"\n";
        std::fs::write(&path, agents).expect("write");
        let c = load(Some(&path), None).expect("loads");
        let names: Vec<String> = c.exposed_agents().into_iter().map(|a| a.name).collect();
        assert_eq!(names, ["writer"]);
        std::fs::write(
            &path,
            format!("{agents}[agents-protocol]\nexpose-all = true\n"),
        )
        .expect("write");
        assert_eq!(
            load(Some(&path), None)
                .expect("loads")
                .exposed_agents()
                .len(),
            2
        );
        for (extra, text) in [
            (
                "[agents.Writer]\nkind = \"scripted\"\nexpose = true\n",
                "agent token",
            ),
            ("[agents-protocol]\nowner = \"Not A Token\"\n", "owner"),
            (
                "[agents.x]\nkind = \"scripted\"\nexpose = \"yes\"\n",
                "expose",
            ),
        ] {
            std::fs::write(&path, format!("{agents}{extra}")).expect("write");
            let err = load(Some(&path), None).expect_err(extra);
            assert!(err.to_string().contains(text), "{extra}: {err}");
        }
    }

    #[test]
    fn the_planner_must_be_a_defined_agent_in_a_known_pool() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        let agent = "[agents.planner]\nkind = \"scripted\"\nreply = \"{}\"\n";
        for (planner, expected) in [
            ("agent = \"ghost\"", Some("not defined in [agents]")),
            (
                "agent = \"planner\"\npool = \"gpu\"",
                Some("is not one of pools"),
            ),
            ("agent = \"planner\"\nmax-repairs = 11", Some("max-repairs")),
            ("agent = \"planner\"", None),
        ] {
            std::fs::write(
                &path,
                format!("{agent}\n[coordinator.planner]\n{planner}\n"),
            )
            .expect("write");
            match (load(Some(&path), None), expected) {
                (Ok(c), None) => {
                    assert_eq!(c.coordinator.planner.agent.as_deref(), Some("planner"))
                }
                (Err(e), Some(text)) => assert!(e.to_string().contains(text), "{e}"),
                (r, _) => panic!("{planner}: {:?}", r.map(|c| c.coordinator.planner)),
            }
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        std::fs::write(&path, "[nats]\nurl = \"nats://x\"\n").expect("write");
        let err = load(Some(&path), None).expect_err("unknown key");
        assert!(err.to_string().contains("url"), "{err}");
    }

    #[test]
    fn environment_keys_map_onto_config_and_ignore_the_rest() {
        assert_eq!(env_key("NATS__URLS"), "nats.urls");
        assert_eq!(env_key("DEFAULT_AGENT"), "default-agent");
        assert_eq!(env_key("WORKER__SHUTDOWN_GRACE"), "worker.shutdown-grace");
        assert!(is_config_key("nats.urls"));
        assert!(is_config_key("default-agent"));
        // What Kubernetes injects for a Service named `flotilla`.
        for k in [
            "PORT",
            "PORT_4222_TCP",
            "SERVICE_HOST",
            "SERVICE_PORT",
            "RUN_ID",
        ] {
            assert!(!is_config_key(&env_key(k)), "{k}");
        }
    }

    #[test]
    fn a_stale_up_url_file_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("nats-url");
        std::fs::write(
            &file,
            format!("nats://127.0.0.1:1234\n{}\n", std::process::id()),
        )
        .expect("write");
        assert_eq!(
            running_up_url(dir.path()).as_deref(),
            Some("nats://127.0.0.1:1234")
        );
        // A pid that cannot be alive.
        std::fs::write(&file, "nats://127.0.0.1:1234\n2147483646\n").expect("write");
        assert_eq!(running_up_url(dir.path()), None);
    }

    #[test]
    fn the_telemetry_section_loads_and_is_validated() {
        use flotilla_telemetry::{HttpAddr, LogFormat};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        std::fs::write(
            &path,
            "[telemetry]\nhttp-addr = \"off\"\nlog-format = \"json\"\n",
        )
        .expect("write");
        let loaded = load(Some(&path), None).expect("loads");
        assert_eq!(loaded.telemetry.http_addr, HttpAddr::Off);
        assert_eq!(loaded.telemetry.log_format, LogFormat::Json);
        std::fs::write(&path, "[telemetry]\nconsumer-lag-interval = \"1ms\"\n").expect("write");
        let err = load(Some(&path), None).expect_err("too short");
        assert!(err.to_string().contains("[telemetry]"), "{err}");
    }

    #[test]
    fn the_console_section_loads_and_is_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        std::fs::write(
            &path,
            "[console]\nlisten = \"0.0.0.0:9480\"\nidentity-header = \"X-Forwarded-User\"\ntrusted-proxies = [\"10.0.0.0/8\"]\noperators = [\"alice\"]\n[console.tokens]\nbob = \"bob-token-0123456789\"\n",
        )
        .expect("write");
        let loaded = load(Some(&path), None).expect("loads");
        assert_eq!(loaded.console.operators, vec!["alice".to_owned()]);
        assert_eq!(loaded.console.tokens.len(), 1);
        // Off loopback without identities, anyone would be an operator: refused.
        std::fs::write(&path, "[console]\nlisten = \"0.0.0.0:9480\"\n").expect("write");
        let err = load(Some(&path), None).expect_err("open to the network");
        assert!(err.to_string().contains("console.listen"), "{err}");
        // A proxy header read from anyone would let anyone name an operator: refused.
        std::fs::write(&path, "[console]\nidentity-header = \"X-Forwarded-User\"\n")
            .expect("write");
        let err = load(Some(&path), None).expect_err("a header from anyone");
        assert!(err.to_string().contains("trusted-proxies"), "{err}");
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        std::fs::write(&path, "[nats]\nurls = [\"nats://file:4222\"]\n").expect("write");
        let loaded = load(Some(&path), Some("nats://flag:4222")).expect("loads");
        assert_eq!(loaded.nats.urls, vec!["nats://flag:4222".to_string()]);
    }
}
