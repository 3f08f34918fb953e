{{/* Names ------------------------------------------------------------------------------- */}}

{{- define "flotilla.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flotilla.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "flotilla.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "flotilla.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flotilla
{{- end -}}

{{- define "flotilla.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flotilla.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flotilla.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "flotilla.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "flotilla.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* NATS --------------------------------------------------------------------------------- */}}

{{/* The NATS chart's full name when it is a dependency of this release. */}}
{{- define "flotilla.natsFullname" -}}
{{- if contains "nats" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-nats" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* NATS URLs as a JSON list. */}}
{{- define "flotilla.natsUrls" -}}
{{- if .Values.nats.enabled -}}
{{- list (printf "nats://%s.%s.svc:4222" (include "flotilla.natsFullname" .) .Release.Namespace) | toJson -}}
{{- else -}}
{{- $urls := list -}}
{{- range splitList "," .Values.nats.url -}}
{{- if trim . -}}{{- $urls = append $urls (trim .) -}}{{- end -}}
{{- end -}}
{{- $urls | toJson -}}
{{- end -}}
{{- end -}}

{{- define "flotilla.natsMonitoringEndpoint" -}}
{{- if .Values.nats.monitoringEndpoint -}}
{{- .Values.nats.monitoringEndpoint -}}
{{- else if .Values.nats.enabled -}}
{{- printf "%s-headless.%s.svc:8222" (include "flotilla.natsFullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "flotilla.tasksStream" -}}
{{- printf "%s_TASKS" (.Values.prefix | upper | replace "-" "_") -}}
{{- end -}}

{{/* The Secret name of a worker pool's NATS credentials. Args: root, pool. */}}
{{- define "flotilla.workerSecret" -}}
{{- default (replace "{pool}" .pool.name .root.Values.nats.credentials.worker) .pool.natsSecret -}}
{{- end -}}

{{/*
Credential environment and volumes of one role. Args: root, secret.
The binary reads FLOTILLA_NATS__AUTH__* (`__` nests config sections).
*/}}
{{- define "flotilla.natsAuthEnv" -}}
{{- $kind := .root.Values.nats.authKind -}}
{{- if ne $kind "none" }}
- name: FLOTILLA_NATS__AUTH__KIND
  value: {{ $kind | quote }}
{{- end }}
{{- if eq $kind "user-password" }}
- name: FLOTILLA_NATS__AUTH__USER
  valueFrom:
    secretKeyRef: {name: {{ .secret | quote }}, key: user}
- name: FLOTILLA_NATS__AUTH__PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ .secret | quote }}, key: password}
{{- else if eq $kind "token" }}
- name: FLOTILLA_NATS__AUTH__TOKEN
  valueFrom:
    secretKeyRef: {name: {{ .secret | quote }}, key: token}
{{- else if eq $kind "nkey" }}
- name: FLOTILLA_NATS__AUTH__SEED
  valueFrom:
    secretKeyRef: {name: {{ .secret | quote }}, key: seed}
{{- else if eq $kind "creds-file" }}
- name: FLOTILLA_NATS__AUTH__PATH
  value: /etc/flotilla/nats/nats.creds
{{- end }}
{{- end -}}

{{- define "flotilla.natsAuthMounts" -}}
{{- if eq .Values.nats.authKind "creds-file" }}
- name: nats-credentials
  mountPath: /etc/flotilla/nats
  readOnly: true
{{- end }}
{{- if and .Values.nats.tls.enabled .Values.nats.tls.caSecret }}
- name: nats-ca
  mountPath: /etc/flotilla/nats-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "flotilla.natsAuthVolumes" -}}
{{- if eq .root.Values.nats.authKind "creds-file" }}
- name: nats-credentials
  secret:
    secretName: {{ .secret | quote }}
    items:
      - {key: creds, path: nats.creds}
{{- end }}
{{- if and .root.Values.nats.tls.enabled .root.Values.nats.tls.caSecret }}
- name: nats-ca
  secret:
    secretName: {{ .root.Values.nats.tls.caSecret | quote }}
    items:
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{/* Configuration ------------------------------------------------------------------------ */}}

{{/*
Parses TOML into the dict `into` (merged key by key), or fails naming where it came from.
Args: into, toml, what. The data never passes through JSON, which would turn TOML integers
into floats (`shards = 32` would come back as `32.0`).
*/}}
{{- define "flotilla.mergeToml" -}}
{{- if trim (default "" .toml) -}}
{{- $parsed := fromToml .toml -}}
{{- if hasKey $parsed "Error" -}}
{{- fail (printf "%s is not valid TOML: %v" .what (get $parsed "Error")) -}}
{{- end -}}
{{- $_ := mustMergeOverwrite .into $parsed -}}
{{- end -}}
{{- end -}}

{{/*
Adds the agents of a TOML `[agents.*]` block to the dict `into`; an agent already there must
be defined the same way. Args: into, toml, what.
*/}}
{{- define "flotilla.addAgents" -}}
{{- $parsed := dict -}}
{{- include "flotilla.mergeToml" (dict "into" $parsed "toml" .toml "what" .what) -}}
{{- range $k, $_ := $parsed -}}
{{- if ne $k "agents" -}}
{{- fail (printf "%s may only hold [agents.NAME] tables, found %q" $.what $k) -}}
{{- end -}}
{{- end -}}
{{- range $name, $def := (get $parsed "agents" | default dict) -}}
{{- if and (hasKey $.into $name) (ne (toJson (get $.into $name)) (toJson $def)) -}}
{{- fail (printf "agent %q is defined twice, differently (again in %s); the coordinator needs one definition per name: rename one" $name $.what) -}}
{{- end -}}
{{- $_ := set $.into $name $def -}}
{{- end -}}
{{- end -}}

{{/*
The worker pools with their defaults filled in, as a JSON list: every key a pool does not
give comes from workerPoolDefaults; keda and hpa are filled key by key. (Zero values such as
`replicas: 0` are kept, unlike Helm's merge functions.)
*/}}
{{- define "flotilla.pools" -}}
{{- $pools := list -}}
{{- range $i, $pool := .Values.workerPools -}}
{{- if not (kindIs "map" $pool) -}}
{{- fail (printf "workerPools[%d] must be a map with at least a name" $i) -}}
{{- end -}}
{{- $p := deepCopy $.Values.workerPoolDefaults -}}
{{- range $k, $v := $pool -}}
{{- if and (has $k (list "keda" "hpa")) (kindIs "map" $v) -}}
{{- $m := get $p $k | default dict -}}
{{- range $k2, $v2 := $v -}}{{- $_ := set $m $k2 $v2 -}}{{- end -}}
{{- $_ := set $p $k $m -}}
{{- else -}}
{{- $_ := set $p $k $v -}}
{{- end -}}
{{- end -}}
{{- $pools = append $pools $p -}}
{{- end -}}
{{- $pools | toJson -}}
{{- end -}}

{{/* Checks the values the schema cannot express; fails with a clear message. */}}
{{- define "flotilla.validate" -}}
{{- $seen := dict -}}
{{- if not .Values.workerPools -}}
{{- fail "workerPools is empty: configure at least one worker pool" -}}
{{- end -}}
{{- range $i, $p := include "flotilla.pools" . | fromJsonArray -}}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$" (toString $p.name)) -}}
{{- fail (printf "workerPools[%d].name %q is not a valid pool name: use lowercase letters, digits and '-' (a DNS label of at most 40 characters); it names Kubernetes objects and NATS subject tokens" $i (toString $p.name)) -}}
{{- end -}}
{{- if hasKey $seen $p.name -}}
{{- fail (printf "workerPools: pool %q is listed twice" $p.name) -}}
{{- end -}}
{{- $_ := set $seen $p.name true -}}
{{- if and ($p.keda | default dict).enabled ($p.hpa | default dict).enabled -}}
{{- fail (printf "workerPools[%d] (%s): keda.enabled and hpa.enabled are both true; choose one autoscaler per pool" $i $p.name) -}}
{{- end -}}
{{- if and ($p.keda | default dict).enabled (not (include "flotilla.natsMonitoringEndpoint" $)) -}}
{{- fail (printf "workerPools[%d] (%s): keda.enabled needs nats.monitoringEndpoint (host:port of the NATS monitoring port)" $i $p.name) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.nats.enabled (not (hasKey .Subcharts "nats")) -}}
{{- fail "nats.enabled is true but the NATS chart is not in helm/flotilla/charts: run `helm dependency build helm/flotilla` first (or set nats.enabled=false and nats.url to an existing NATS)" -}}
{{- end -}}
{{- if and (not .Values.nats.enabled) (eq (include "flotilla.natsUrls" . | fromJsonArray | len) 0) -}}
{{- fail "nats.url is empty: give the URL of an existing NATS, or set nats.enabled=true" -}}
{{- end -}}
{{- include "flotilla.validateTenants" . -}}
{{- end -}}

{{/*
The structured `supervisor.settings` values as `[supervisor]` (and `[supervisor.recruit]`) keys
of the dict `into`. Only keys that are set (not null) are written, so everything left unset
keeps the binary's default. Args: into, root. Integers are converted back from the floats
Helm reads YAML numbers as (`team-size = 10`, not `10.0`).
*/}}
{{- define "flotilla.supervisorSettings" -}}
{{- $s := .root.Values.supervisor.settings | default dict -}}
{{- $sup := dict -}}
{{- $recruit := dict -}}
{{- range $key, $kebab := dict "presenceTimeout" "presence-timeout" "staleAfter" "stale-after" -}}
{{- $v := ternary (get $s $key) nil (hasKey $s $key) -}}
{{- if not (kindIs "invalid" $v) -}}{{- $_ := set $sup $kebab (toString $v) -}}{{- end -}}
{{- end -}}
{{- range $key, $kebab := dict "teamSize" "team-size" "turnsPerHour" "turns-per-hour" "maxMessageBytes" "max-message-bytes" -}}
{{- $v := ternary (get $s $key) nil (hasKey $s $key) -}}
{{- if not (kindIs "invalid" $v) -}}{{- $_ := set $sup $kebab (int64 $v) -}}{{- end -}}
{{- end -}}
{{- $r := get $s "recruit" | default dict -}}
{{- range $key, $kebab := dict "allowedRoles" "allowed-roles" "recruiters" "recruiters" -}}
{{- $v := ternary (get $r $key) nil (hasKey $r $key) -}}
{{- if not (kindIs "invalid" $v) -}}{{- $_ := set $recruit $kebab $v -}}{{- end -}}
{{- end -}}
{{- range $key, $kebab := dict "maxTeam" "max-team" "maxRecruits" "max-recruits" -}}
{{- $v := ternary (get $r $key) nil (hasKey $r $key) -}}
{{- if not (kindIs "invalid" $v) -}}{{- $_ := set $recruit $kebab (int64 $v) -}}{{- end -}}
{{- end -}}
{{- if and (hasKey $r "answerWait") (not (kindIs "invalid" (get $r "answerWait"))) -}}
{{- $_ := set $recruit "answer-wait" (toString (get $r "answerWait")) -}}
{{- end -}}
{{- if $recruit -}}{{- $_ := set $sup "recruit" $recruit -}}{{- end -}}
{{- if $sup -}}{{- $_ := set .into "supervisor" $sup -}}{{- end -}}
{{- end -}}

{{/*
flotilla.toml of one role. Args: root, pool (a worker pool; nil for the coordinator and the
supervisor), role (the name in the file's heading when pool is nil; default coordinator),
tenant (optional: a tenant of flotilla.tenants, whose pools replace workerPools; its
services act for it through FLOTILLA_NATS__TENANT), shared (optional: flotilla.shared, whose
pools replace workerPools; its services act for each shared tenant through --tenants).
The coordinator knows every pool's agents, so plan validation rejects unknown agents; the
supervisor knows them too (every agent is a team member, with its card). An agent defined by
two pools must be defined the same way.
*/}}
{{- define "flotilla.config" -}}
{{- $v := .root.Values -}}
{{- $pools := list -}}
{{- $all := include "flotilla.pools" .root | fromJsonArray -}}
{{- $tenant := get . "tenant" -}}
{{- if $tenant -}}{{- $all = $tenant.pools -}}{{- end -}}
{{- $shared := get . "shared" -}}
{{- if $shared -}}{{- $all = $shared.pools -}}{{- end -}}
{{- range $all -}}{{- $pools = append $pools .name -}}{{- end -}}
{{- $agents := dict -}}
{{- if .pool -}}
{{- include "flotilla.addAgents" (dict "into" $agents "toml" $v.agents "what" "agents") -}}
{{- include "flotilla.addAgents" (dict "into" $agents "toml" .pool.agents "what" (printf "workerPools %s: agents" .pool.name)) -}}
{{- else -}}
{{- range $p := $all -}}
{{- $own := dict -}}
{{- include "flotilla.addAgents" (dict "into" $own "toml" $v.agents "what" "agents") -}}
{{- include "flotilla.addAgents" (dict "into" $own "toml" $p.agents "what" (printf "workerPools %s: agents" $p.name)) -}}
{{- include "flotilla.addAgents" (dict "into" $agents "toml" (toToml (dict "agents" $own)) "what" (printf "workerPools %s: agents" $p.name)) -}}
{{- end -}}
{{- end -}}
{{- $nats := dict "urls" (include "flotilla.natsUrls" .root | fromJsonArray) "prefix" $v.prefix -}}
{{- if $v.nats.tls.enabled -}}
{{- $tls := dict "required" true -}}
{{- if $v.nats.tls.caSecret -}}{{- $_ := set $tls "ca" "/etc/flotilla/nats-ca/ca.crt" -}}{{- end -}}
{{- $_ := set $nats "tls" $tls -}}
{{- end -}}
{{- $cfg := dict
  "pools" $pools
  "nats" $nats
  "jetstream" (dict "replicas" (int $v.jetstream.replicas) "storage" $v.jetstream.storage)
-}}
{{- /* Always the exact probe port: the binary's default (`auto`) would move to the next
free port if another process held this one, and the probes would miss it. A fixed address
fails loudly instead. */ -}}
{{- $_ := set $cfg "telemetry" (dict "http-addr" (printf "0.0.0.0:%d" (int $v.metrics.port))) -}}
{{- if $agents -}}{{- $_ := set $cfg "agents" $agents -}}{{- end -}}
{{- if $v.defaultAgent -}}
{{- if not (hasKey $agents $v.defaultAgent) -}}
{{- fail (printf "defaultAgent %q is not defined for %s: add it to agents (shared by every pool)" $v.defaultAgent (ternary (printf "worker pool %s" (.pool | default dict).name) (printf "the %s" (.role | default "coordinator")) (not (empty .pool)))) -}}
{{- end -}}
{{- $_ := set $cfg "default-agent" $v.defaultAgent -}}
{{- end -}}
{{- if and (not .pool) (eq (.role | default "") "supervisor") -}}
{{- include "flotilla.supervisorSettings" (dict "into" $cfg "root" .root) -}}
{{- end -}}
{{- if and (not .pool) (eq (.role | default "") "console") -}}
{{- /* The console listens on every interface of its pod (the Service and Ingress reach it);
identity comes from the proxy header, read only from the trusted proxies' addresses, and/or
the tokens Secret (environment). */ -}}
{{- $con := dict "listen" (printf "0.0.0.0:%d" (int $v.console.port)) "operators" ($v.console.operators | default list) -}}
{{- if $v.console.identityHeader -}}{{- $_ := set $con "identity-header" $v.console.identityHeader -}}{{- end -}}
{{- if $v.console.trustedProxies -}}{{- $_ := set $con "trusted-proxies" $v.console.trustedProxies -}}{{- end -}}
{{- $_ := set $cfg "console" $con -}}
{{- end -}}
{{- if .pool -}}
{{- $_ := set $cfg "worker" (dict "pool" .pool.name "concurrency" (int .pool.concurrency) "shutdown-grace" (printf "%ds" (int .pool.shutdownGraceSeconds))) -}}
{{- end -}}
{{- $extra := dict -}}
{{- include "flotilla.mergeToml" (dict "into" $extra "toml" $v.extraConfig "what" "extraConfig") -}}
{{- $cfg = mustMergeOverwrite $extra $cfg -}}
# flotilla.toml rendered by the Helm chart helm/flotilla ({{ with $tenant }}tenant {{ .name }}, {{ end }}{{ with $shared }}shared by tenants {{ join ", " ((get $ "pool" | default dict).tenants | default .tenants) }}, {{ end }}{{ if .pool }}worker pool {{ .pool.name }}{{ else }}{{ .role | default "coordinator" }}{{ end }}).
# NATS credentials come from the environment (FLOTILLA_NATS__AUTH__*), not from this file.
{{ toToml $cfg }}
{{- end -}}

{{/* Pod pieces ---------------------------------------------------------------------------- */}}

{{- define "flotilla.probes" -}}
startupProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
livenessProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
readinessProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
{{- end -}}

{{- define "flotilla.podAnnotations" -}}
{{- if .Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
