//! The checks a message to a teammate passes before it is stored, shared by the two ways a
//! message is sent: the supervisor's `team.send`, and a sender that stores it straight in the
//! inbox (`flotilla_client::Mailer`, `flotilla team send --direct`). Both refuse the same
//! messages with the same code, so a sender can switch ways without its callers noticing; a
//! refused message is not stored.
//!
//! Pure: the caller brings the teammate's entry (read, or from a mirror of the team bucket)
//! and the time.

use crate::ErrorCode;
use crate::teammate::{Teammate, TeammateStatus};
use crate::time::Timestamp;
use crate::token::check_name;

pub use crate::teammate::DEFAULT_MAX_MESSAGE_BYTES;

/// The longest teammate name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;

/// The sender a message without `from` is from.
pub const DEFAULT_SENDER: &str = "operator";

/// A message (or a name) refused: the code, its status, and what is wrong — what
/// `team.send` answers as its `ApiError`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MailRefused {
    /// The stable code.
    pub code: ErrorCode,
    /// What is wrong, naming the value.
    pub message: String,
}

impl MailRefused {
    fn new(code: ErrorCode, message: String) -> Self {
        Self { code, message }
    }

    /// The code's status (`400`, `404`, `409`, `413`, `429`).
    pub fn status(&self) -> u16 {
        self.code.status()
    }
}

impl std::fmt::Display for MailRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.code, self.status(), self.message)
    }
}

impl std::error::Error for MailRefused {}

/// A team name: a subject token (`invalid_team`).
pub fn check_team(team: &str) -> Result<(), MailRefused> {
    check_name(team)
        .map_err(|e| MailRefused::new(ErrorCode::InvalidTeam, format!("team {team:?} {e}")))
}

/// A teammate's name: a subject token, not starting with `_`, at most [`MAX_NAME_BYTES`]
/// (`invalid_name`).
pub fn check_teammate_name(name: &str) -> Result<(), MailRefused> {
    check_name(name)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            if name.starts_with('_') {
                Err("must not start with `_`".to_owned())
            } else if name.len() > MAX_NAME_BYTES {
                Err(format!("is longer than {MAX_NAME_BYTES} bytes"))
            } else {
                Ok(())
            }
        })
        .map_err(|e| {
            MailRefused::new(
                ErrorCode::InvalidName,
                format!("teammate name {name:?} {e}"),
            )
        })
}

/// The sender, [`DEFAULT_SENDER`] when none is named: a subject token, since it is the
/// inbox subject's last token (`invalid_sender`).
pub fn check_sender(from: Option<&str>) -> Result<String, MailRefused> {
    let from = from.unwrap_or(DEFAULT_SENDER);
    check_name(from)
        .map_err(|e| MailRefused::new(ErrorCode::InvalidSender, format!("sender {from:?} {e}")))?;
    Ok(from.to_owned())
}

/// A message's text against the cap `max_bytes` (`message_too_large`).
pub fn check_size(text: &str, max_bytes: usize) -> Result<(), MailRefused> {
    if text.len() > max_bytes {
        return Err(MailRefused::new(
            ErrorCode::MessageTooLarge,
            format!(
                "the message is {} bytes; the message size cap (max-message-bytes) is {max_bytes}",
                text.len()
            ),
        ));
    }
    Ok(())
}

/// Whether `mate` takes one more message at `now`: not shut down (`shut_down`), under its
/// hourly cap of turns (`turns_per_hour`).
pub fn check_accepts(mate: &Teammate, now: Timestamp) -> Result<(), MailRefused> {
    if mate.status == TeammateStatus::Shutdown || mate.shutdown_requested {
        return Err(MailRefused::new(
            ErrorCode::ShutDown,
            format!(
                "teammate {:?} of team {:?} is shut down",
                mate.name, mate.team
            ),
        ));
    }
    if mate.check_rate(now, mate.turns_per_hour).is_err() {
        let cap = mate.turns_per_hour;
        return Err(MailRefused::new(
            ErrorCode::TurnsPerHour,
            format!(
                "teammate {:?} ran {cap} turns in the last hour; the cap (turns-per-hour) is {cap}",
                mate.name
            ),
        ));
    }
    Ok(())
}

/// No teammate `name` in `team`; `others`: the team's teammates, listed in the message.
pub fn not_found(team: &str, name: &str, others: &[String]) -> MailRefused {
    let listed = if others.is_empty() {
        "none".to_owned()
    } else {
        others.join(", ")
    };
    MailRefused::new(
        ErrorCode::NotFound,
        format!("team {team:?} has no teammate named {name:?} (teammates: {listed})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mate() -> Teammate {
        Teammate::spawn("t1", "ann", "analyst", "a", "default", "", Timestamp::now())
    }

    #[test]
    fn names_and_senders_are_subject_tokens() {
        assert!(check_team("t1").is_ok());
        assert_eq!(check_team("a.b").unwrap_err().code, ErrorCode::InvalidTeam);
        assert!(check_teammate_name("ann").is_ok());
        for bad in ["_hidden", "a b", "a.b", "", &"n".repeat(MAX_NAME_BYTES + 1)] {
            let e = check_teammate_name(bad).unwrap_err();
            assert_eq!(
                (e.code, e.status()),
                (ErrorCode::InvalidName, 400),
                "{bad:?}"
            );
        }
        assert_eq!(check_sender(None).unwrap(), DEFAULT_SENDER);
        assert_eq!(check_sender(Some("bob")).unwrap(), "bob");
        assert_eq!(
            check_sender(Some("b*")).unwrap_err().code,
            ErrorCode::InvalidSender
        );
    }

    #[test]
    fn the_size_cap_is_inclusive() {
        assert!(check_size("abcd", 4).is_ok());
        let e = check_size("abcde", 4).unwrap_err();
        assert_eq!((e.code, e.status()), (ErrorCode::MessageTooLarge, 413));
        assert!(e.message.contains("5 bytes"), "{e}");
    }

    #[test]
    fn shut_down_and_capped_teammates_take_no_mail() {
        let now = Timestamp::now();
        let mut m = mate();
        assert!(check_accepts(&m, now).is_ok());
        m.shutdown_requested = true;
        assert_eq!(
            check_accepts(&m, now).unwrap_err().code,
            ErrorCode::ShutDown
        );
        let mut m = mate();
        m.turns_per_hour = 2;
        m.recent_turns = vec![now.unix_ms() - 10, now.unix_ms() - 20];
        let e = check_accepts(&m, now).unwrap_err();
        assert_eq!((e.code, e.status()), (ErrorCode::TurnsPerHour, 429));
        // Turns older than an hour no longer count.
        m.recent_turns = vec![now.unix_ms() - 3_700_000, now.unix_ms() - 10];
        assert!(check_accepts(&m, now).is_ok());
    }

    #[test]
    fn an_entry_without_a_cap_omits_it_and_reads_back_without_one() {
        let json = serde_json::to_value(mate()).unwrap();
        assert!(
            json.get("max_message_bytes").is_none(),
            "omitted when absent"
        );
        let back: Teammate = serde_json::from_value(json).unwrap();
        assert_eq!(back.max_message_bytes, None);
    }
}
