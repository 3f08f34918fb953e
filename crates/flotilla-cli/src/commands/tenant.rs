//! `flotilla tenant add|list|show|set|remove|usage|nats-config`: the deployment's tenants.
//!
//! Run by the platform's operator on the deployment's own installation (not with
//! `--tenant`). A tenant is an installation of its own (prefix `<prefix>-<tenant>`): `add`
//! records it in `<prefix>-tenants` and provisions its streams and buckets; `nats-config`
//! writes the NATS users and permissions that pin each tenant's users to its prefix, for
//! the NATS server to load (`deploy/nats/`, or the Helm chart's `tenancy` values). Exit 0
//! done, 1 refused (named, changing nothing).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use flotilla_bus::Bus;
use flotilla_model::tenant::{QuotaKind, Quotas, TenantName, TenantRecord};
use flotilla_model::time::Timestamp;
use flotilla_tenants::ledger::{Ledger, Usage};
use flotilla_tenants::natsconf::{self, Deployment, Passwords};
use flotilla_tenants::{TenantErrorKind, TenantStore};
use serde_json::json;

use crate::config::Config;

/// `flotilla tenant`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum TenantCommand {
    /// Add a tenant: its record, and its installation's streams and buckets. Then write
    /// the NATS configuration again (`tenant nats-config`) and reload the server.
    Add {
        /// Its name: lowercase letters, digits and inner `-`, at most 32.
        name: String,
        #[command(flatten)]
        changes: Changes,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Every tenant.
    List {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// One tenant: its record, prefix and NATS users.
    Show {
        /// The tenant.
        name: String,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Change a tenant's quotas, pools or people (what is not given stays).
    Set {
        /// The tenant.
        name: String,
        #[command(flatten)]
        changes: Changes,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Remove a tenant's record: its users go with the next NATS configuration. Its runs,
    /// workspace and history stay unless --purge deletes its streams and buckets.
    Remove {
        /// The tenant.
        name: String,
        /// Also delete its streams and buckets (everything it stored; cannot be undone).
        #[arg(long)]
        purge: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// A tenant's usage: its quotas and counters now, and tokens, cost and model calls by
    /// day, agent and model.
    Usage {
        /// The tenant.
        name: String,
        /// From this long ago (default 7d).
        #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
        since: std::time::Duration,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Write the NATS configuration with every tenant's users and permissions (the shipped
    /// deploy/nats/accounts.conf and, per tenant, the same blocks pinned to its prefix).
    NatsConfig {
        /// Write it here (default: stdout).
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// Tenants from this JSON file (an array of records, as `tenant list --json` prints)
        /// instead of the deployment's bucket: no NATS needed.
        #[arg(long, value_name = "FILE")]
        from_file: Option<PathBuf>,
        /// A person who sees every tenant (repeatable).
        #[arg(long = "admin", value_name = "USER")]
        admins: Vec<String>,
        /// `dev`: the development passwords (`<role>-dev-password`); `env`: references to
        /// the server's environment (`$FLOTILLA_PASSWORD_<ROLE>`), for production.
        #[arg(long, default_value = "dev", value_parser = ["dev", "env"])]
        passwords: String,
    },
}

/// What `add` sets and `set` changes (what `set` is not given stays).
#[derive(Debug, clap::Args)]
pub(crate) struct Changes {
    /// A worker pool it may use (repeatable; `add`: default `default`; `set`: replaces its
    /// pools). Each gets a user `worker-<pool>@<tenant>`.
    #[arg(long = "pool", value_name = "POOL")]
    pools: Vec<String>,
    /// A person (a NATS user of the PEOPLE account) who acts for it (repeatable; `set`:
    /// replaces its people).
    #[arg(long = "person", value_name = "USER")]
    people: Vec<String>,
    /// A quota, `KIND=LIMIT`, or `KIND=none` to lift it (repeatable): concurrent_runs,
    /// runs_per_hour, tokens_per_day, cost_per_month (US dollars, e.g.
    /// `cost_per_month=250.50`), model_requests_per_minute, model_tokens_per_minute,
    /// workspace_bytes, mailbox_bytes, persistent_teammates.
    #[arg(long = "quota", value_name = "KIND=LIMIT")]
    quotas: Vec<String>,
    /// A quota that queues a submission until it frees instead of refusing it (repeatable;
    /// only concurrent_runs; `set`: replaces them, `none` for none).
    #[arg(long = "queue", value_name = "KIND")]
    queue: Vec<String>,
}

/// A refusal: named, printed, exit 1.
fn refuse(json: bool, code: &str, message: String) -> anyhow::Result<ExitCode> {
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&json!({"error": code, "message": message}))?
        );
    } else {
        errln!("error: {message}");
    }
    Ok(ExitCode::from(1))
}

/// `flotilla tenant`.
pub(crate) async fn tenant(config: &Config, command: TenantCommand) -> anyhow::Result<ExitCode> {
    if let Some(t) = &config.nats.tenant {
        anyhow::bail!(
            "`flotilla tenant` manages the deployment's tenants as its operator: run it without --tenant / nats.tenant (set to {t:?})"
        );
    }
    match command {
        TenantCommand::Add {
            name,
            changes,
            json,
        } => {
            let record = match new_record(&name, changes) {
                Ok(r) => r,
                Err(e) => return refuse(json, "invalid_request", e),
            };
            let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
            let store = TenantStore::open(&bus, true).await?;
            match store.add(&record).await {
                Ok(()) => {}
                Err(e) if e.kind() == TenantErrorKind::AlreadyExists => {
                    return refuse(json, "already_exists", e.to_string());
                }
                Err(e) => return Err(e.into()),
            }
            provision_and_set_quotas(config, &record).await.with_context(|| {
                format!(
                    "tenant {} was recorded, but its streams and buckets could not be provisioned: run `flotilla tenant add` again after fixing this, or `flotilla --tenant {} nats provision`",
                    record.name, record.name
                )
            })?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&shown(config, &record))?);
            } else {
                print_record(config, &record);
                outln!(
                    "\nNext: `flotilla tenant nats-config --out <the server's accounts file>` and reload nats-server (`nats-server --signal reload`); its services run with `--tenant {}`.",
                    record.name
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        TenantCommand::List { json } => {
            let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
            let records = list(&bus).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&records)?);
            } else if records.is_empty() {
                outln!("No tenants: the deployment serves its default tenant only.");
            } else {
                outln!("{:<24} {:<28} {:<20} QUOTAS", "TENANT", "PREFIX", "POOLS");
                for r in &records {
                    outln!(
                        "{:<24} {:<28} {:<20} {}",
                        r.name,
                        r.name.prefix(&config.nats.prefix),
                        r.pools.join(","),
                        quotas_line(&r.quotas)
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        TenantCommand::Show { name, json } => {
            let (_, record) = match existing(config, &name, json).await? {
                Ok(found) => found,
                Err(refused) => return Ok(refused),
            };
            if json {
                outln!("{}", serde_json::to_string_pretty(&shown(config, &record))?);
            } else {
                print_record(config, &record);
            }
            Ok(ExitCode::SUCCESS)
        }
        TenantCommand::Set {
            name,
            changes,
            json,
        } => {
            let (bus, mut record) = match existing(config, &name, json).await? {
                Ok(found) => found,
                Err(refused) => return Ok(refused),
            };
            if let Err(e) = change(&mut record, changes) {
                return refuse(json, "invalid_request", e);
            }
            TenantStore::open(&bus, false).await?.put(&record).await?;
            set_quotas(&tenant_bus(config, &record.name).await?, &record).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&shown(config, &record))?);
            } else {
                print_record(config, &record);
            }
            Ok(ExitCode::SUCCESS)
        }
        TenantCommand::Remove { name, purge, json } => {
            let (bus, TenantRecord { name, .. }) = match existing(config, &name, json).await? {
                Ok(found) => found,
                Err(refused) => return Ok(refused),
            };
            let mut deleted = Vec::new();
            if purge {
                deleted = purge_installation(&tenant_bus(config, &name).await?).await?;
            }
            TenantStore::open(&bus, false).await?.remove(&name).await?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"removed": name, "purged": purge, "deleted_streams": deleted})
                    )?
                );
            } else {
                outln!(
                    "Removed tenant {name}{}. Write the NATS configuration again (`tenant nats-config`) and reload the server to remove its users.",
                    if purge {
                        format!(" and deleted its {} streams and buckets", deleted.len())
                    } else {
                        " (its streams and buckets stay; --purge deletes them)".to_owned()
                    }
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        TenantCommand::Usage { name, since, json } => {
            let (_, TenantRecord { name, .. }) = match existing(config, &name, json).await? {
                Ok(found) => found,
                Err(refused) => return Ok(refused),
            };
            let tenant_bus = tenant_bus(config, &name).await?;
            let since_ms = Timestamp::now().unix_ms()
                - i64::try_from(since.as_millis()).unwrap_or(i64::MAX / 2);
            let usage = Ledger::open(&tenant_bus)
                .await?
                .with_tenant(Some(name.clone()))
                .usage(since_ms)
                .await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&usage)?);
            } else {
                print_usage(&name, &usage);
            }
            Ok(ExitCode::SUCCESS)
        }
        TenantCommand::NatsConfig {
            out,
            from_file,
            admins,
            passwords,
        } => {
            let tenants: Vec<TenantRecord> = match &from_file {
                Some(f) => {
                    let text = std::fs::read_to_string(f)
                        .with_context(|| format!("reading {}", f.display()))?;
                    serde_json::from_str(&text).with_context(|| {
                        format!("{} is not a JSON array of tenants", f.display())
                    })?
                }
                None => {
                    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
                    list(&bus).await?
                }
            };
            let conf = natsconf::render(&Deployment {
                base: &config.nats.prefix,
                tenants: &tenants,
                admins: &admins,
                passwords: if passwords == "env" {
                    Passwords::Env
                } else {
                    Passwords::Dev
                },
            })?;
            match out {
                Some(path) => {
                    std::fs::write(&path, conf)
                        .with_context(|| format!("writing {}", path.display()))?;
                    errln!(
                        "Wrote {} ({} tenants). Reload the NATS server to apply it.",
                        path.display(),
                        tenants.len()
                    );
                }
                None => out!("{conf}"),
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn list(bus: &Bus) -> anyhow::Result<Vec<TenantRecord>> {
    match TenantStore::open(bus, false).await {
        Ok(store) => Ok(store.list().await?),
        Err(e) if e.kind() == TenantErrorKind::NoTenants => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

async fn get(bus: &Bus, name: &TenantName) -> anyhow::Result<Option<TenantRecord>> {
    match TenantStore::open(bus, false).await {
        Ok(store) => Ok(store.get(name).await?),
        Err(e) if e.kind() == TenantErrorKind::NoTenants => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Tenant `name` and the operator's connection to the deployment, or the refusal already
/// printed (its exit code): a name that is not a tenant's, or no such tenant.
async fn existing(
    config: &Config,
    name: &str,
    json: bool,
) -> anyhow::Result<Result<(Bus, TenantRecord), ExitCode>> {
    let name = match TenantName::new(name) {
        Ok(n) => n,
        Err(e) => {
            return refuse(json, "invalid_request", format!("tenant {name:?} {e}")).map(Err);
        }
    };
    let bus = Bus::connect(&config.nats, "flotilla-cli").await?;
    match get(&bus, &name).await? {
        Some(record) => Ok(Ok((bus, record))),
        None => refuse(json, "not_found", format!("no tenant {name}")).map(Err),
    }
}

/// The operator's connection to tenant `name`'s installation: the same user, the tenant's
/// prefix.
async fn tenant_bus(config: &Config, name: &TenantName) -> anyhow::Result<Bus> {
    let mut opts = config.nats.clone();
    opts.prefix = name.prefix(&config.nats.prefix);
    Ok(Bus::connect(&opts, "flotilla-cli").await?)
}

/// Creates tenant `record`'s streams and buckets and writes its quotas where its
/// coordinators read them (its installation's usage bucket).
async fn provision_and_set_quotas(config: &Config, record: &TenantRecord) -> anyhow::Result<()> {
    let bus = tenant_bus(config, &record.name).await?;
    let p = flotilla_bus::provision::plan(bus.js(), bus.names(), &config.jetstream).await?;
    anyhow::ensure!(
        p.is_compatible(),
        "the tenant's installation has incompatible streams:\n{}",
        p.report().planned()
    );
    p.apply(bus.js()).await?;
    set_quotas(&bus, record).await
}

/// Writes `record`'s quotas to its installation's usage bucket, and its byte quotas to its
/// workspace and mailbox streams (where the NATS server holds them).
async fn set_quotas(tenant_bus: &Bus, record: &TenantRecord) -> anyhow::Result<()> {
    Ledger::open(tenant_bus)
        .await?
        .set_quotas(&record.quotas)
        .await?;
    flotilla_tenants::space::apply(tenant_bus, &record.quotas).await?;
    Ok(())
}

/// Deletes every stream of the tenant's installation (`tenant_bus`'s); their names.
async fn purge_installation(tenant_bus: &Bus) -> anyhow::Result<Vec<String>> {
    let mut deleted = Vec::new();
    for s in natsconf::installation_streams(tenant_bus.names()) {
        match tenant_bus.js().delete_stream(&s).await {
            Ok(_) => deleted.push(s),
            Err(e) if e.to_string().contains("not found") => {}
            Err(e) => return Err(anyhow::anyhow!("deleting stream {s}: {e}")),
        }
    }
    Ok(deleted)
}

fn new_record(name: &str, changes: Changes) -> Result<TenantRecord, String> {
    let name = TenantName::new(name).map_err(|e| format!("tenant {name:?} {e}"))?;
    let mut record = TenantRecord {
        name,
        pools: vec!["default".to_owned()],
        people: Vec::new(),
        quotas: Quotas::default(),
        created_ms: Timestamp::now().unix_ms(),
    };
    change(&mut record, changes)?;
    Ok(record)
}

/// Applies the flags of `add` / `set` to `record`; the first problem, named.
fn change(record: &mut TenantRecord, changes: Changes) -> Result<(), String> {
    let Changes {
        pools,
        people,
        quotas,
        queue,
    } = changes;
    for (what, list) in [("--pool", &pools), ("--person", &people)] {
        let mut seen = std::collections::BTreeSet::new();
        for n in list {
            flotilla_model::token::check_name(n).map_err(|e| format!("{what} {n:?} {e}"))?;
            if !seen.insert(n) {
                return Err(format!("{what} {n:?} is given twice"));
            }
        }
    }
    if !pools.is_empty() {
        record.pools = pools;
    }
    if !people.is_empty() {
        record.people = people;
    }
    for q in &quotas {
        let (kind, limit) = parse_quota(q)?;
        record.quotas.set(kind, limit);
    }
    if !queue.is_empty() {
        record.quotas.queue = if queue == ["none"] {
            Vec::new()
        } else {
            queue
                .iter()
                .map(|k| {
                    QuotaKind::parse(k)
                        .ok_or_else(|| format!("--queue {k:?} is not a quota; {}", kinds()))
                })
                .collect::<Result<_, _>>()?
        };
    }
    flotilla_tenants::ledger::check_quotas(&record.quotas)?;
    Ok(())
}

fn kinds() -> String {
    let all: Vec<&str> = QuotaKind::ALL.iter().map(|k| k.as_str()).collect();
    format!("one of {}", all.join(", "))
}

/// `KIND=LIMIT` (a cost in dollars, kept in millionths), or `KIND=none`.
fn parse_quota(s: &str) -> Result<(QuotaKind, Option<u64>), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("--quota {s:?} is not KIND=LIMIT"))?;
    let kind = QuotaKind::parse(k.trim())
        .ok_or_else(|| format!("--quota {s:?}: {k:?} is not a quota; {}", kinds()))?;
    let v = v.trim();
    if v == "none" {
        return Ok((kind, None));
    }
    let limit = if kind == QuotaKind::CostPerMonth {
        let dollars: f64 = v
            .parse()
            .map_err(|_| format!("--quota {s:?}: {v:?} is not an amount of dollars"))?;
        if !dollars.is_finite() || !(0.0..=1e12).contains(&dollars) {
            return Err(format!("--quota {s:?}: {v:?} is not an amount of dollars"));
        }
        (dollars * 1e6).round() as u64
    } else {
        v.parse::<u64>()
            .map_err(|_| format!("--quota {s:?}: {v:?} is not a whole number (or `none`)"))?
    };
    Ok((kind, Some(limit)))
}

fn quotas_line(q: &Quotas) -> String {
    let mut parts = Vec::new();
    for k in QuotaKind::ALL {
        if let Some(l) = q.limit(k) {
            let shown = if k == QuotaKind::CostPerMonth {
                format!("${:.2}", l as f64 / 1e6)
            } else {
                l.to_string()
            };
            let queued = if q.queue.contains(&k) {
                " (queued)"
            } else {
                ""
            };
            parts.push(format!("{k}={shown}{queued}"));
        }
    }
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(" ")
    }
}

fn users_of(r: &TenantRecord) -> Vec<String> {
    let mut users: Vec<String> = ["coordinator", "supervisor", "client", "console"]
        .iter()
        .map(|role| r.name.user(role))
        .collect();
    users.extend(r.pools.iter().map(|p| r.name.user(&format!("worker-{p}"))));
    users
}

fn shown(config: &Config, r: &TenantRecord) -> serde_json::Value {
    let mut v = serde_json::to_value(r).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("prefix".into(), json!(r.name.prefix(&config.nats.prefix)));
        o.insert("inbox_prefix".into(), json!(r.name.inbox_prefix()));
        o.insert("users".into(), json!(users_of(r)));
    }
    v
}

fn print_usage(name: &TenantName, u: &Usage) {
    let c = &u.current;
    let limit = |k: QuotaKind| match u.quotas.limit(k) {
        Some(l) if k == QuotaKind::CostPerMonth => format!(" of ${:.2}", l as f64 / 1e6),
        Some(l) => format!(" of {l}"),
        None => String::new(),
    };
    outln!("tenant {name}: quotas {}", quotas_line(&u.quotas));
    outln!(
        "  concurrent runs   {}{}",
        c.concurrent_runs,
        limit(QuotaKind::ConcurrentRuns)
    );
    outln!(
        "  runs this hour    {}{}   (resets {})",
        c.runs_this_hour,
        limit(QuotaKind::RunsPerHour),
        Timestamp::from_unix_ms(c.hour_resets_at_ms)
    );
    outln!(
        "  tokens today      {}{}   (resets {})",
        c.tokens_today,
        limit(QuotaKind::TokensPerDay),
        Timestamp::from_unix_ms(c.day_resets_at_ms)
    );
    outln!(
        "  cost this month   ${:.4}{}   (resets {})",
        c.cost_this_month_micros as f64 / 1e6,
        limit(QuotaKind::CostPerMonth),
        Timestamp::from_unix_ms(c.month_resets_at_ms)
    );
    outln!(
        "  workspace bytes   {}{}",
        c.workspace_bytes,
        limit(QuotaKind::WorkspaceBytes)
    );
    outln!(
        "  mailbox bytes     {}{}",
        c.mailbox_bytes,
        limit(QuotaKind::MailboxBytes)
    );
    if let Some(n) = c.persistent_teammates {
        outln!(
            "  teammates         {n}{}",
            limit(QuotaKind::PersistentTeammates)
        );
    }
    if let Some(l) = u.quotas.model_requests_per_minute {
        outln!("  model requests    at most {l} a minute");
    }
    if let Some(l) = u.quotas.model_tokens_per_minute {
        outln!("  model tokens      at most {l} a minute");
    }
    if u.days.is_empty() {
        outln!("  no model use recorded in the period");
        return;
    }
    outln!(
        "\n  {:<12} {:<20} {:<24} {:>10} {:>12} {:>7}",
        "DAY",
        "AGENT",
        "MODEL",
        "TOKENS",
        "COST",
        "CALLS"
    );
    for d in &u.days {
        for a in &d.by {
            outln!(
                "  {:<12} {:<20} {:<24} {:>10} {:>12} {:>7}",
                d.day,
                a.agent,
                a.model,
                a.spend.tokens,
                format!("${:.4}", a.spend.cost_micros as f64 / 1e6),
                a.spend.calls
            );
        }
    }
}

fn print_record(config: &Config, r: &TenantRecord) {
    outln!("tenant        {}", r.name);
    outln!("prefix        {}", r.name.prefix(&config.nats.prefix));
    outln!("inboxes       {}.>", r.name.inbox_prefix());
    outln!("pools         {}", r.pools.join(", "));
    outln!(
        "people        {}",
        if r.people.is_empty() {
            "none".to_owned()
        } else {
            r.people.join(", ")
        }
    );
    outln!("quotas        {}", quotas_line(&r.quotas));
    outln!("nats users    {}", users_of(r).join(", "));
    outln!("added         {}", Timestamp::from_unix_ms(r.created_ms));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_parse_or_name_the_problem() {
        assert_eq!(
            parse_quota("concurrent_runs=3"),
            Ok((QuotaKind::ConcurrentRuns, Some(3)))
        );
        assert_eq!(
            parse_quota("cost-per-month=2.5"),
            Ok((QuotaKind::CostPerMonth, Some(2_500_000)))
        );
        assert_eq!(
            parse_quota("tokens_per_day=none"),
            Ok((QuotaKind::TokensPerDay, None))
        );
        assert!(parse_quota("runs").unwrap_err().contains("KIND=LIMIT"));
        assert!(parse_quota("bogus=1").unwrap_err().contains("not a quota"));
        assert!(
            parse_quota("runs_per_hour=-1")
                .unwrap_err()
                .contains("whole number")
        );
        assert!(
            parse_quota("cost_per_month=abc")
                .unwrap_err()
                .contains("dollars")
        );
        let none = || Changes {
            pools: vec![],
            people: vec![],
            quotas: vec![],
            queue: vec![],
        };
        let e = new_record("Acme", none()).unwrap_err();
        assert!(e.contains("\"Acme\""), "{e}");
        let twice = Changes {
            pools: vec!["a".into(), "a".into()],
            ..none()
        };
        let e = new_record("acme", twice).unwrap_err();
        assert!(e.contains("twice"), "{e}");
    }
}
