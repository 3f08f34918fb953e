{{/* Tenants ------------------------------------------------------------------------------ */}}

{{/*
The tenants (tenancy.tenants) with their defaults filled in, as a JSON list of
{name, shared, pools, people, coordinator, supervisor, credentials}. A tenant's pools are
full pool settings: those of the workerPools entry of the same name (agents, concurrency,
resources, env, scheduling), else workerPoolDefaults; replicas come from the tenant's
workers.replicas (default 1) and no autoscaler runs for them. Shared tenants (shared: true)
are listed too, their NATS users rendered like any tenant's; their services are those of
flotilla.shared, not their own.
*/}}
{{- define "flotilla.tenants" -}}
{{- $byName := dict -}}
{{- range include "flotilla.pools" . | fromJsonArray -}}{{- $_ := set $byName .name . -}}{{- end -}}
{{- $creds := .Values.nats.credentials -}}
{{- $out := list -}}
{{- range $i, $t := (.Values.tenancy | default dict).tenants | default list -}}
{{- $workers := get $t "workers" | default dict -}}
{{- $own := get $t "credentials" | default dict -}}
{{- $pools := list -}}
{{- range $name := get $t "pools" | default (list "default") -}}
{{- $p := deepCopy (get $byName $name | default $.Values.workerPoolDefaults) -}}
{{- $_ := set $p "name" $name -}}
{{- $_ := set $p "replicas" (ternary (get $workers "replicas") 1 (hasKey $workers "replicas")) -}}
{{- $_ := set $p "keda" (dict "enabled" false) -}}
{{- $_ := set $p "hpa" (dict "enabled" false) -}}
{{- if get $own "worker" -}}{{- $_ := set $p "natsSecret" (replace "{pool}" $name (get $own "worker")) -}}{{- end -}}
{{- $pools = append $pools $p -}}
{{- end -}}
{{- $c := get $t "coordinator" | default dict -}}
{{- $s := get $t "supervisor" | default dict -}}
{{- $out = append $out (dict
  "name" $t.name
  "shared" (get $t "shared" | default false)
  "pools" $pools
  "people" (get $t "people" | default list)
  "coordinator" (dict "replicas" (ternary (get $c "replicas") 1 (hasKey $c "replicas")))
  "supervisor" (dict "replicas" (ternary (get $s "replicas") 1 (hasKey $s "replicas")))
  "credentials" (dict
    "coordinator" (get $own "coordinator" | default $creds.coordinator)
    "supervisor" (get $own "supervisor" | default $creds.supervisor))
) -}}
{{- end -}}
{{- $out | toJson -}}
{{- end -}}

{{/*
The shared services of the shared tenants (tenancy.tenants[].shared), as a JSON dict, empty
when no tenant is shared: {tenants (names, in order), pools (full pool settings, each pool
of any shared tenant once, in order of first mention, with `tenants`: the shared tenants
listing it), coordinator, supervisor, workers ({replicas} each, from tenancy.shared)}. A
shared pool takes the settings of the workerPools entry of its name, else
workerPoolDefaults, like a tenant's, at fixed replicas (tenancy.shared.workers.replicas) and
on the deployment's own credentials (nats.credentials, the pool's natsSecret).
*/}}
{{- define "flotilla.shared" -}}
{{- $names := list -}}
{{- $pools := list -}}
{{- $byName := dict -}}
{{- range $t := include "flotilla.tenants" . | fromJsonArray -}}
{{- if $t.shared -}}
{{- $names = append $names $t.name -}}
{{- range $t.pools -}}
{{- if not (hasKey $byName .name) -}}
{{- $_ := set $byName .name (list) -}}
{{- $pools = append $pools .name -}}
{{- end -}}
{{- $_ := set $byName .name (append (get $byName .name) $t.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $names -}}
{{- $settings := dict -}}
{{- range include "flotilla.pools" . | fromJsonArray -}}{{- $_ := set $settings .name . -}}{{- end -}}
{{- $cfg := (.Values.tenancy | default dict).shared | default dict -}}
{{- $replicas := dict -}}
{{- range $role := list "coordinator" "supervisor" "workers" -}}
{{- $r := get $cfg $role | default dict -}}
{{- $_ := set $replicas $role (ternary (get $r "replicas") 1 (hasKey $r "replicas")) -}}
{{- end -}}
{{- $full := list -}}
{{- range $name := $pools -}}
{{- $p := deepCopy (get $settings $name | default $.Values.workerPoolDefaults) -}}
{{- $_ := set $p "name" $name -}}
{{- $_ := set $p "tenants" (get $byName $name) -}}
{{- $_ := set $p "replicas" (get $replicas "workers") -}}
{{- $_ := set $p "keda" (dict "enabled" false) -}}
{{- $_ := set $p "hpa" (dict "enabled" false) -}}
{{- $full = append $full $p -}}
{{- end -}}
{{- dict
  "tenants" $names
  "pools" $full
  "coordinator" (dict "replicas" (get $replicas "coordinator"))
  "supervisor" (dict "replicas" (get $replicas "supervisor"))
  "workers" (dict "replicas" (get $replicas "workers"))
  | toJson -}}
{{- else -}}
{{- dict | toJson -}}
{{- end -}}
{{- end -}}

{{/* Checks of the tenants the schema cannot express. */}}
{{- define "flotilla.validateTenants" -}}
{{- $seen := dict -}}
{{- $deployments := dict (printf "%s-coordinator" (include "flotilla.fullname" .)) "the coordinators" -}}
{{- if .Values.supervisor.enabled -}}{{- $_ := set $deployments (printf "%s-supervisor" (include "flotilla.fullname" .)) "the supervisors" -}}{{- end -}}
{{- if .Values.console.enabled -}}{{- $_ := set $deployments (printf "%s-console" (include "flotilla.fullname" .)) "the console" -}}{{- end -}}
{{- range include "flotilla.pools" . | fromJsonArray -}}
{{- $_ := set $deployments (printf "%s-worker-%s" (include "flotilla.fullname" $) .name) (printf "worker pool %s" .name) -}}
{{- end -}}
{{- $shared := include "flotilla.shared" . | fromJson -}}
{{- with $shared -}}
{{- $_ := set $deployments (printf "%s-shared-coordinator" (include "flotilla.fullname" $)) "the shared tenants' coordinators" -}}
{{- if $.Values.supervisor.enabled -}}{{- $_ := set $deployments (printf "%s-shared-supervisor" (include "flotilla.fullname" $)) "the shared tenants' supervisors" -}}{{- end -}}
{{- range .pools -}}
{{- $_ := set $deployments (printf "%s-shared-worker-%s" (include "flotilla.fullname" $) .name) (printf "the shared tenants' worker pool %s" .name) -}}
{{- end -}}
{{- end -}}
{{- $raw := (.Values.tenancy | default dict).tenants | default list -}}
{{- range $i, $t := include "flotilla.tenants" . | fromJsonArray -}}
{{- if hasKey $seen $t.name -}}
{{- fail (printf "tenancy.tenants: tenant %q is listed twice" $t.name) -}}
{{- end -}}
{{- $_ := set $seen $t.name true -}}
{{- if $t.shared -}}
{{- /* Served by the shared services (flotilla.shared): nothing of its own to set. */ -}}
{{- $own := index $raw $i -}}
{{- range $key := list "credentials" "coordinator" "supervisor" "workers" -}}
{{- if hasKey $own $key -}}
{{- fail (printf "tenancy.tenants[%d] (%s): %s is not used by a shared tenant: the shared services run on the deployment's credentials with the replicas of tenancy.shared; drop it, or set shared: false" $i $t.name $key) -}}
{{- end -}}
{{- end -}}
{{- if has $.Values.nats.authKind (list "nkey" "creds-file") -}}
{{- fail (printf "tenancy.tenants[%d] (%s): shared needs nats.authKind user-password: a shared process logs in as <user>@<tenant> for each tenant with one Secret's user and password, and %s credentials name one user; set shared: false (the tenant's own credentials)" $i $t.name $.Values.nats.authKind) -}}
{{- end -}}
{{- /* The shared coordinator runs no workflow agents (flotilla coordinator --tenants). */ -}}
{{- range $p := $t.pools -}}
{{- $agents := dict -}}
{{- include "flotilla.addAgents" (dict "into" $agents "toml" $.Values.agents "what" "agents") -}}
{{- include "flotilla.addAgents" (dict "into" $agents "toml" $p.agents "what" (printf "workerPools %s: agents" $p.name)) -}}
{{- range $name, $def := $agents -}}
{{- if has (toString (get $def "kind")) (list "sequential" "parallel" "loop") -}}
{{- fail (printf "tenancy.tenants[%d] (%s): shared, but its pool %s has workflow agent %q (kind %s), which a shared coordinator does not run: set shared: false (a coordinator of its own runs it)" $i $t.name $p.name $name (toString (get $def "kind"))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $pools := dict -}}
{{- $names := dict "coordinator" "coordinator" -}}
{{- if $.Values.supervisor.enabled -}}{{- $_ := set $names "supervisor" "supervisor" -}}{{- end -}}
{{- range $t.pools -}}
{{- if hasKey $pools .name -}}
{{- fail (printf "tenancy.tenants[%d] (%s): pool %q is listed twice" $i $t.name .name) -}}
{{- end -}}
{{- $_ := set $pools .name true -}}
{{- $_ := set $names (printf "worker-%s" .name) (printf "worker pool %s" .name) -}}
{{- end -}}
{{- range $suffix, $what := ternary (dict) $names $t.shared -}}
{{- $name := printf "%s-%s-%s" (include "flotilla.fullname" $) $t.name $suffix -}}
{{- if hasKey $deployments $name -}}
{{- fail (printf "tenancy.tenants[%d] (%s): the Deployment of its %s would be named %s, like that of %s: rename the tenant or the pool" $i $t.name $what $name (get $deployments $name)) -}}
{{- end -}}
{{- $_ := set $deployments $name (printf "tenant %s's %s" $t.name $what) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.tenancy.natsConfig.enabled (ne .Values.prefix "flotilla") -}}
{{- fail (printf "tenancy.natsConfig.enabled: the NATS accounts template (deploy/nats/accounts.conf) is written for prefix `flotilla`, not %q; set prefix to flotilla, or generate the configuration yourself" .Values.prefix) -}}
{{- end -}}
{{- end -}}

{{/*
The NATS server configuration with the tenants: `files/accounts.conf` (a copy of
deploy/nats/accounts.conf; tests/test_chart.py fails when they differ) with its permission
blocks narrowed for the default tenant (stream management of its own streams, no stream
listings, discovery of its own services), a renamed copy of each block per tenant, and the
whole `accounts` section with every user — byte for
byte what `flotilla tenant nats-config --passwords env` prints for the same tenants and
administrators (crates/flotilla-tenants/src/natsconf.rs, which this mirrors step by step;
the chart test compares the two). Passwords of tenants' users and of people are references
to the NATS server's environment: $FLOTILLA_PASSWORD_<ROLE> (services, shared by every
tenant), $FLOTILLA_PASSWORD_CLIENT_<TENANT>, $FLOTILLA_PASSWORD_PERSON_<NAME>.
*/}}
{{- define "flotilla.tenants.natsConfig" -}}
{{- $base := "flotilla" -}}
{{- $template := .Files.Get "files/accounts.conf" -}}
{{- if not (contains "\naccounts = {" $template) -}}
{{- fail "files/accounts.conf: no `accounts = {` section" -}}
{{- end -}}
{{- $split := splitn "\naccounts = {" 2 $template -}}
{{- $blocks := $split._0 -}}
{{- $accounts := $split._1 -}}
{{- /* The permission blocks, `NAME = {` to a line `}`, in order. */ -}}
{{- $roles := list -}}
{{- $role := "" -}}
{{- $body := "" -}}
{{- $inBlock := false -}}
{{- range $line := splitList "\n" $blocks -}}
{{- if $inBlock -}}
{{- $body = printf "%s\n%s" $body $line -}}
{{- if eq $line "}" -}}
{{- $roles = append $roles (dict "name" $role "body" $body) -}}
{{- $inBlock = false -}}
{{- end -}}
{{- else if regexMatch "^[A-Z_]+ = \\{$" $line -}}
{{- $role = trimSuffix " = {" $line -}}
{{- $body = "{" -}}
{{- $inBlock = true -}}
{{- end -}}
{{- end -}}
{{- $roleNames := list -}}
{{- range $roles -}}{{- $roleNames = append $roleNames .name -}}{{- end -}}
{{- range list "COORDINATOR" "WORKER_DEFAULT" "CLIENT" "CONSOLE" "SUPERVISOR" -}}
{{- if not (has . $roleNames) -}}{{- fail (printf "files/accounts.conf: no %s block" .) -}}{{- end -}}
{{- end -}}
{{- $defaultUsers := include "flotilla.tenants.sectionLines" (dict "text" $accounts "account" "FLOTILLA = {" "list" "users = [") | fromJsonArray -}}
{{- $templatePeople := list -}}
{{- range include "flotilla.tenants.sectionLines" (dict "text" $accounts "account" "PEOPLE = {" "list" "users = [") | fromJsonArray -}}
{{- if and (hasPrefix "{" .) (regexMatch "user = \"[^\"]*\"" .) -}}
{{- $templatePeople = append $templatePeople (regexFind "user = \"[^\"]*\"" . | trimPrefix "user = \"" | trimSuffix "\"") -}}
{{- end -}}
{{- end -}}
{{- $sysUsers := include "flotilla.tenants.sectionLines" (dict "text" $accounts "account" "SYS = {" "list" "users = [") | fromJsonArray -}}
{{- $tenants := include "flotilla.tenants" . | fromJsonArray -}}

{{- $out := list "# Generated by `flotilla tenant nats-config` from deploy/nats/accounts.conf and the\n# deployment's tenants. Do not edit: add or change tenants and generate it again.\n\n" -}}
{{- /* The default tenant's blocks, narrowed as a tenant's are (its stream management and
discovery reach only its own streams and services), its names unchanged. */ -}}
{{- $default := dict "tenant" "" "prefix" $base "streams" (include "flotilla.tenants.streams" $base | fromJsonArray) -}}
{{- $out = append $out (printf "%s\n\n" (include "flotilla.tenants.block" (dict "body" $blocks "ctx" $default))) -}}
{{- $users := list -}}
{{- $exports := list (printf "%s.api.>" $base) -}}
{{- range $t := $tenants -}}
{{- $prefix := printf "%s-%s" $base $t.name -}}
{{- $upperTenant := $t.name | upper | replace "-" "_" -}}
{{- $upperPrefix := $prefix | upper | replace "-" "_" -}}
{{- $ctx := dict "tenant" $t.name "prefix" $prefix "upperPrefix" $upperPrefix "streams" (include "flotilla.tenants.streams" $prefix | fromJsonArray) -}}
{{- $out = append $out (printf "# === tenant %s: prefix `%s`, users `<role>@%s` ==========================\n\n" $t.name $prefix $t.name) -}}
{{- range $r := $roles -}}
{{- $pools := list "" -}}
{{- if eq $r.name "WORKER_DEFAULT" -}}
{{- $pools = list -}}
{{- range $t.pools -}}{{- $pools = append $pools .name -}}{{- end -}}
{{- end -}}
{{- range $pool := $pools -}}
{{- $var := $r.name -}}
{{- $user := lower $r.name -}}
{{- $text := $r.body -}}
{{- if eq $r.name "WORKER_DEFAULT" -}}
{{- $text = $text | replace "pool-default" (printf "pool-%s" $pool) | replace "turns-default" (printf "turns-%s" $pool) | replace "flotilla.task.default" (printf "flotilla.task.%s" $pool) | replace "flotilla.turn.default" (printf "flotilla.turn.%s" $pool) -}}
{{- $var = printf "WORKER_%s" ($pool | upper | replace "-" "_") -}}
{{- $user = printf "worker-%s" $pool -}}
{{- end -}}
{{- $var = printf "%s_T_%s" $var $upperTenant -}}
{{- $out = append $out (printf "%s = %s\n\n" $var (include "flotilla.tenants.block" (dict "body" $text "ctx" $ctx))) -}}
{{- /* Services share their role's secret across tenants; a tenant's clients have their own. */ -}}
{{- $password := printf "$FLOTILLA_PASSWORD_%s" ($user | upper | replace "-" "_") -}}
{{- if eq $user "client" -}}
{{- $password = printf "$FLOTILLA_PASSWORD_%s_%s" ($user | upper | replace "-" "_") $upperTenant -}}
{{- end -}}
{{- $users = append $users (printf "{ user = \"%s@%s\", password = %s, permissions = $%s }" $user $t.name $password $var) -}}
{{- end -}}
{{- end -}}
{{- $exports = append $exports (printf "%s.api.>" $prefix) -}}
{{- end -}}

{{- /* People: who belongs where. */ -}}
{{- $people := dict -}}
{{- range $templatePeople -}}
{{- $_ := set $people . (append (get $people . | default list) $base) -}}
{{- end -}}
{{- range $t := $tenants -}}
{{- range $t.people -}}
{{- $_ := set $people . (append (get $people . | default list) (printf "%s-%s" $base $t.name)) -}}
{{- end -}}
{{- end -}}
{{- $admins := (.Values.tenancy | default dict).admins | default list -}}
{{- range $admins -}}
{{- if not (hasKey $people .) -}}{{- $_ := set $people . list -}}{{- end -}}
{{- end -}}

{{- $out = append $out "accounts = {\n  FLOTILLA = {\n    jetstream = enabled\n    exports = [\n" -}}
{{- range $exports -}}{{- $out = append $out (printf "      { service = \"%s\" }\n" .) -}}{{- end -}}
{{- $out = append $out "    ]\n    users = [\n" -}}
{{- range $defaultUsers -}}{{- $out = append $out (printf "      %s\n" .) -}}{{- end -}}
{{- range $users -}}{{- $out = append $out (printf "      %s\n" .) -}}{{- end -}}
{{- $out = append $out "    ]\n  }\n" -}}
{{- $out = append $out "  # People: each may call only the APIs of the tenants it belongs to (administrators:\n  # every tenant's) and read only its own inboxes; connect with\n  # `nats.inbox-prefix = \"_INBOX_<name>\"`.\n" -}}
{{- $out = append $out "  PEOPLE = {\n    users = [\n" -}}
{{- range $person := keys $people | sortAlpha -}}
{{- $allowed := list -}}
{{- if has $person $admins -}}
{{- $allowed = $exports -}}
{{- else -}}
{{- range get $people $person -}}{{- $allowed = append $allowed (printf "%s.api.>" .) -}}{{- end -}}
{{- end -}}
{{- $quoted := list -}}
{{- range $allowed -}}{{- $quoted = append $quoted (printf "\"%s\"" .) -}}{{- end -}}
{{- $out = append $out (printf "      { user = \"%s\", password = $FLOTILLA_PASSWORD_PERSON_%s, permissions = { publish = { allow = [%s] }, subscribe = { allow = [\"_INBOX_%s.>\"] } } }\n" $person ($person | upper | replace "-" "_") (join ", " $quoted) $person) -}}
{{- end -}}
{{- $out = append $out "    ]\n    imports = [\n" -}}
{{- range $exports -}}
{{- $out = append $out (printf "      { service = { account = FLOTILLA, subject = \"%s\" }, share = true }\n" .) -}}
{{- end -}}
{{- $out = append $out "    ]\n  }\n  SYS = {\n    users = [\n" -}}
{{- range $sysUsers -}}{{- $out = append $out (printf "      %s\n" .) -}}{{- end -}}
{{- $out = append $out "    ]\n  }\n}\nsystem_account = SYS\n" -}}
{{- join "" $out -}}
{{- end -}}

{{/*
The entries of the list `list` (e.g. `users = [`) inside the account `account` (e.g.
`FLOTILLA = {`) of the template's accounts section `text`: its lines up to the closing `]`,
trimmed, comments kept. A JSON list.
*/}}
{{- define "flotilla.tenants.sectionLines" -}}
{{- $missing := printf "files/accounts.conf: no `%s` in `%s`" .list .account -}}
{{- if not (contains .account .text) -}}{{- fail $missing -}}{{- end -}}
{{- $rest := index (splitn .account 2 .text) "_1" -}}
{{- if not (contains .list $rest) -}}{{- fail $missing -}}{{- end -}}
{{- $rest = index (splitn .list 2 $rest) "_1" -}}
{{- if not (contains "\n    ]" $rest) -}}{{- fail $missing -}}{{- end -}}
{{- $lines := list -}}
{{- range splitList "\n" (index (splitn "\n    ]" 2 $rest) "_0") -}}
{{- if trim . -}}{{- $lines = append $lines (trim .) -}}{{- end -}}
{{- end -}}
{{- $lines | toJson -}}
{{- end -}}

{{/*
The stream names of the installation of `prefix` (`flotilla_tenants::natsconf::streams_of`):
its streams, its buckets' (flotilla_model::subjects::Bucket::ALL, in order) and its object
store's. A JSON list.
*/}}
{{- define "flotilla.tenants.streams" -}}
{{- $prefix := . -}}
{{- $streams := list -}}
{{- range list "INTAKE" "TASKS" "RUNLOG" "EVENTS" "WORKSPACE" "MAILBOX" "NOTIFY" -}}
{{- $streams = append $streams (printf "%s_%s" ($prefix | upper | replace "-" "_") .) -}}
{{- end -}}
{{- range list "runs" "team" "failures" "escalations" "control" "trust" "state" "workers" "cursors" "memory" "usage" -}}
{{- $streams = append $streams (printf "KV_%s-%s" $prefix .) -}}
{{- end -}}
{{- $streams = append $streams (printf "OBJ_%s-artifacts" $prefix) -}}
{{- $streams | toJson -}}
{{- end -}}

{{/*
Template text for one installation (`scoped`): a tenant's (ctx.tenant set: renamed) or the
default tenant's (ctx.tenant empty: names kept), with the rights that name no installation
narrowed. Args: body, ctx (tenant, prefix, upperPrefix, streams). Comments and lines without
subjects are renamed; a line of quoted subjects becomes one line per subject granted (its
trailing comment kept on each).
*/}}
{{- define "flotilla.tenants.block" -}}
{{- $ctx := .ctx -}}
{{- $out := list -}}
{{- $subscribing := false -}}
{{- range $line := splitList "\n" .body -}}
{{- $trimmed := regexReplaceAll "^\\s+" $line "" -}}
{{- if hasPrefix "publish = {" $trimmed -}}
{{- $subscribing = false -}}
{{- else if hasPrefix "subscribe = {" $trimmed -}}
{{- $subscribing = true -}}
{{- end -}}
{{- if or (hasPrefix "#" $trimmed) (not (contains "\"" $line)) -}}
{{- $out = append $out (include "flotilla.tenants.rename" (dict "s" $line "ctx" $ctx)) -}}
{{- else -}}
{{- $indent := regexFind "^\\s*" $line -}}
{{- $parts := splitList "\"" $line -}}
{{- $last := sub (len $parts) 1 -}}
{{- $lastPart := index $parts $last -}}
{{- $hasComment := contains "#" $lastPart -}}
{{- $comment := "" -}}
{{- if $hasComment -}}{{- $comment = trim (index (splitn "#" 2 $lastPart) "_1") -}}{{- end -}}
{{- $bare := true -}}
{{- $subjects := list -}}
{{- range $i, $p := $parts -}}
{{- if eq (mod $i 2) 1 -}}
{{- $subjects = concat $subjects (include "flotilla.tenants.subject" (dict "s" $p "ctx" $ctx "subscribing" $subscribing) | fromJsonArray) -}}
{{- else -}}
{{- $q := $p -}}
{{- if eq $i (int $last) -}}{{- $q = index (splitn "#" 2 $p) "_0" -}}{{- end -}}
{{- if trim (trimAll ",[]" (trim $q)) -}}{{- $bare = false -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if $bare -}}
{{- range $subjects -}}
{{- if $hasComment -}}
{{- $out = append $out (printf "%s\"%s\"   # %s" $indent . $comment) -}}
{{- else -}}
{{- $out = append $out (printf "%s\"%s\"" $indent .) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $out = append $out (include "flotilla.tenants.rename" (dict "s" $line "ctx" $ctx)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- regexReplaceAll "\\s+$" (join "\n" $out) "" -}}
{{- end -}}

{{/*
What one subject of the template grants an installation, as a JSON list: a tenant nothing of
the NATS Agent Protocol (shared by every installation: the default tenant's) nor of the
deployment's tenant records (`KV_flotilla-tenants`: the default console's); no stream
listings; stream management by wildcard only of its own streams; discovery only of its own
services (and, subscribing, the all-services pings it must answer); anything else renamed.
Args: s, ctx, subscribing.
*/}}
{{- define "flotilla.tenants.subject" -}}
{{- $s := .s -}}
{{- $ctx := .ctx -}}
{{- $out := list -}}
{{- if and $ctx.tenant (or (hasPrefix "agents." $s) (hasSuffix ".agents" $s) (hasSuffix ".agents.*" $s) (contains "KV_flotilla-tenants" $s)) -}}
{{- else if or (eq $s "$JS.API.STREAM.NAMES") (eq $s "$JS.API.STREAM.LIST") -}}
{{- else if regexMatch "^\\$JS\\.API\\.STREAM\\.[^.]*\\.\\*$" $s -}}
{{- $op := $s | trimPrefix "$JS.API.STREAM." | trimSuffix ".*" -}}
{{- range $ctx.streams -}}{{- $out = append $out (printf "$JS.API.STREAM.%s.%s" $op .) -}}{{- end -}}
{{- else if eq $s "$SRV.>" -}}
{{- $p := $ctx.prefix -}}
{{- if .subscribing -}}{{- $out = list "$SRV.PING" "$SRV.INFO" "$SRV.STATS" -}}{{- end -}}
{{- $out = concat $out (list (printf "$SRV.*.%s" $p) (printf "$SRV.*.%s.*" $p) (printf "$SRV.*.%s-supervisor" $p) (printf "$SRV.*.%s-supervisor.*" $p)) -}}
{{- else -}}
{{- $out = list (include "flotilla.tenants.rename" (dict "s" $s "ctx" $ctx)) -}}
{{- end -}}
{{- $out | toJson -}}
{{- end -}}

{{/*
`s` with the installation's names replaced by the tenant's, scanning left to right like the
binary: `_INBOX.` -> `_INBOX_<tenant>.`, `FLOTILLA_` -> `FLOTILLA_<TENANT>_`, `flotilla.` and
`flotilla-` -> `flotilla-<tenant>.` / `-`. Each match is marked first, so no replacement is
matched again. Unchanged for the default tenant (ctx.tenant empty). Args: s, ctx.
*/}}
{{- define "flotilla.tenants.rename" -}}
{{- $ctx := .ctx -}}
{{- if not $ctx.tenant -}}
{{- .s -}}
{{- else -}}
{{- regexReplaceAll "_INBOX\\.|FLOTILLA_|flotilla[.-]" .s "\x01${0}\x02"
  | replace "\x01_INBOX.\x02" (printf "_INBOX_%s." $ctx.tenant)
  | replace "\x01FLOTILLA_\x02" (printf "%s_" $ctx.upperPrefix)
  | replace "\x01flotilla.\x02" (printf "%s." $ctx.prefix)
  | replace "\x01flotilla-\x02" (printf "%s-" $ctx.prefix) -}}
{{- end -}}
{{- end -}}
