//! `flotilla trust show [NAME]`, `trust set NAME LEVEL`, `trust incident NAME`: earned trust
//! levels of agents and roles, kept by the supervisor (`<prefix>.api.trust.*`). Exit 0 done,
//! 1 refused (`not_found`, `invalid_request`), 2 no supervisor.

use std::process::ExitCode;

use flotilla_model::team::RecordScope;
use flotilla_model::trust::{
    TrustGetRequest, TrustIncidentRequest, TrustLevel, TrustList, TrustListRequest, TrustRecord,
    TrustSetRequest,
};

use super::person;
use super::team::{answer, connect};
use crate::config::Config;

/// `flotilla trust`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum TrustCommand {
    /// Every agent's and role's level, or one with its history.
    Show {
        /// One agent (or, with --role, one role).
        name: Option<String>,
        /// NAME is a role.
        #[arg(long)]
        role: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Pin a level (`novice`, `proficient`, `expert`), or `auto` to go back to the earned one.
    Set {
        /// The agent (or, with --role, the role).
        name: String,
        /// `novice`, `proficient`, `expert` or `auto`.
        #[arg(value_parser = parse_level)]
        level: LevelArg,
        /// NAME is a role.
        #[arg(long)]
        role: bool,
        /// Why (recorded).
        #[arg(long)]
        reason: String,
        /// Who (default: $USER, else your operating-system user name).
        #[arg(long)]
        by: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Record an incident: the earned level falls at once.
    Incident {
        /// The agent (or, with --role, the role).
        name: String,
        /// NAME is a role.
        #[arg(long)]
        role: bool,
        /// What happened (recorded).
        #[arg(long)]
        reason: String,
        /// Who (default: $USER, else your operating-system user name).
        #[arg(long)]
        by: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

/// A level, or `auto`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LevelArg(Option<TrustLevel>);

fn parse_level(s: &str) -> Result<LevelArg, String> {
    if s == "auto" {
        return Ok(LevelArg(None));
    }
    TrustLevel::parse(s)
        .map(|l| LevelArg(Some(l)))
        .ok_or_else(|| format!("{s:?} is not a level: novice, proficient, expert or auto"))
}

fn scope(role: bool) -> RecordScope {
    if role {
        RecordScope::Role
    } else {
        RecordScope::Agent
    }
}

pub(crate) async fn trust(config: &Config, command: TrustCommand) -> anyhow::Result<ExitCode> {
    let client = connect(config).await?;
    let protocol = flotilla_model::PROTOCOL_VERSION;
    match command {
        TrustCommand::Show {
            name: None, json, ..
        } => answer(&client, &TrustListRequest { protocol }, json, print_list).await,
        TrustCommand::Show {
            name: Some(name),
            role,
            json,
        } => {
            let r = TrustGetRequest {
                protocol,
                scope: scope(role),
                name,
            };
            answer(&client, &r, json, print_record).await
        }
        TrustCommand::Set {
            name,
            level,
            role,
            reason,
            by,
            json,
        } => {
            let r = TrustSetRequest {
                protocol,
                scope: scope(role),
                name,
                level: level.0,
                reason,
                by: person(by)?,
            };
            answer(&client, &r, json, print_record).await
        }
        TrustCommand::Incident {
            name,
            role,
            reason,
            by,
            json,
        } => {
            let r = TrustIncidentRequest {
                protocol,
                scope: scope(role),
                name,
                reason,
                by: person(by)?,
            };
            answer(&client, &r, json, print_record).await
        }
    }
}

fn print_list(l: &TrustList) {
    outln!(
        "Earned trust {} admissions.",
        if l.enabled {
            "sets the oversight of"
        } else {
            "is kept, not used by ([hitl.trust] enabled = false)"
        }
    );
    outln!(
        "{:<6} {:<24} {:<11} {:<8} {:<10} {}",
        "SCOPE",
        "NAME",
        "LEVEL",
        "PINNED",
        "INCIDENTS",
        "SINCE"
    );
    for t in &l.records {
        outln!(
            "{:<6} {:<24} {:<11} {:<8} {:<10} {}",
            t.scope.as_str(),
            t.name,
            t.level().as_str(),
            if t.pinned.is_some() { "yes" } else { "-" },
            t.incidents,
            t.first_seen
        );
    }
}

fn print_record(t: &TrustRecord) {
    outln!(
        "{} {}: {} (earned {}{}), mode {}",
        t.scope.as_str(),
        t.name,
        t.level().as_str(),
        t.earned.as_str(),
        t.pinned
            .map(|p| format!(", pinned {}", p.as_str()))
            .unwrap_or_default(),
        flotilla_machine::policy::trust::mode_of_level(t.level()).as_str()
    );
    outln!(
        "  first counted {}, {} incident(s)",
        t.first_seen,
        t.incidents
    );
    if let Some(i) = &t.last_incident {
        outln!("  last incident {} by {}: {}", i.at, i.by, i.reason);
    }
    for c in &t.history {
        outln!(
            "  {}  {} -> {}  by {}: {}",
            c.at,
            c.from.as_str(),
            c.to.as_str(),
            c.by,
            c.reason
        );
    }
}
