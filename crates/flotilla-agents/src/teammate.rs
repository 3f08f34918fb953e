//! Persistent teammates as agents of the protocol: what the supervisors advertise for one,
//! and how a prompt's answer is read from its conversation. No I/O here.
//!
//! A prompt for a teammate is a message to its inbox (`from` = [`SENDER`]); the answer is the
//! reply of the turn that reads it:
//!
//! ```text
//!  post the message ──► its inbox sequence S
//!  watch conv.<team>.<name>:  cursor < S      → still waiting
//!                             cursor ≥ S      → the turn that read S saved: its assistant line
//!                                               after the prompt's user line is the reply
//!                                               (`failed` on it: the turn failed)
//! ```

use std::collections::HashMap;

use flotilla_model::teammate::{Conversation, Speaker, Teammate};

use crate::serve::InstanceSpec;
use crate::wire::{self, AgentAddress, TokenError};

/// The sender of the messages a prompt posts (`from` in the conversation).
pub const SENDER: &str = "agents-protocol";

/// Longest `description` advertised (the first line of the instructions), in bytes.
pub const MAX_DESCRIPTION: usize = 200;

/// Metadata key naming the teammate.
pub const TEAMMATE_KEY: &str = "flotilla_teammate";

/// Metadata key naming the teammate's team.
pub const TEAM_KEY: &str = "flotilla_team";

/// A teammate's address: `agent` its name and `session` its team, each made a token the way
/// agent definitions' names are (lowercase, `_` as `-`); `owner` as for definitions.
pub fn address(owner: &str, team: &str, name: &str) -> Result<AgentAddress, TokenError> {
    let agent = wire::agent_token(name)?;
    let session = wire::agent_token(team).map_err(|e| TokenError {
        field: "session",
        ..e
    })?;
    AgentAddress::new(&agent, owner, &session)
}

/// The first line of the instructions, at most [`MAX_DESCRIPTION`] bytes; a plain sentence
/// when they are empty.
pub fn description(mate: &Teammate) -> String {
    let first = mate
        .instructions
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    if first.is_empty() {
        return format!(
            "Flotilla teammate {} ({}) of team {}",
            mate.name, mate.role, mate.team
        );
    }
    let mut end = first.len().min(MAX_DESCRIPTION);
    while !first.is_char_boundary(end) {
        end -= 1;
    }
    first[..end].to_owned()
}

/// The service instance of `mate` at `address` for the deployment `prefix`: the metadata of
/// an exposed definition (its role as `capabilities` and `roles`, the definition its turns
/// run as `flotilla_agent`, `flotilla_prefix`) plus `flotilla_teammate` and `flotilla_team`.
pub fn spec(mate: &Teammate, address: AgentAddress, prefix: &str) -> InstanceSpec {
    let mut metadata: HashMap<String, String> = crate::expose::protocol_metadata(&address, prefix);
    metadata.insert("flotilla_agent".to_owned(), mate.agent.clone());
    metadata.insert(TEAMMATE_KEY.to_owned(), mate.name.clone());
    metadata.insert(TEAM_KEY.to_owned(), mate.team.clone());
    if !mate.role.is_empty() {
        metadata.insert("capabilities".to_owned(), mate.role.clone());
        metadata.insert("roles".to_owned(), mate.role.clone());
    }
    InstanceSpec {
        name: mate.name.clone(),
        address,
        description: description(mate),
        metadata,
    }
}

/// Where the turn that reads a prompt's message is, seen from one revision of the
/// conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnOutcome {
    /// No turn has read the message yet.
    Pending,
    /// The turn that read it replied.
    Replied(String),
    /// The turn that read it failed; why.
    Failed(String),
}

/// What `conv` says of the message stored at inbox sequence `seq` with `text` from `from`:
/// pending while the cursor is before it; else the reply of the turn that read it — the
/// assistant line(s) after the message's user line (the newest such user line: one turn
/// answers every message it read), or, when compaction dropped that line, the conversation's
/// last line. Meant for the first revision whose cursor reaches `seq`, the one the turn that
/// read the message saved.
pub fn outcome(conv: &Conversation, seq: u64, from: &str, text: &str) -> TurnOutcome {
    if conv.cursor < seq {
        return TurnOutcome::Pending;
    }
    let lines = &conv.lines;
    let asked = lines.iter().rposition(|l| {
        l.speaker == Speaker::User && l.from.as_deref() == Some(from) && l.text == text
    });
    let replies: Vec<&flotilla_model::teammate::Line> = match asked {
        Some(i) => lines[i + 1..]
            .iter()
            .skip_while(|l| l.speaker != Speaker::Assistant)
            .take_while(|l| l.speaker == Speaker::Assistant)
            .collect(),
        None => lines
            .last()
            .filter(|l| l.speaker == Speaker::Assistant)
            .into_iter()
            .collect(),
    };
    let joined = replies
        .iter()
        .map(|l| l.text.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    if replies.iter().any(|l| l.failed) {
        TurnOutcome::Failed(joined)
    } else {
        TurnOutcome::Replied(joined)
    }
}

#[cfg(test)]
mod tests {
    use flotilla_model::teammate::Line;
    use flotilla_model::time::Timestamp;

    use super::*;

    fn line(speaker: Speaker, from: Option<&str>, text: &str, failed: bool) -> Line {
        Line {
            speaker,
            from: from.map(str::to_owned),
            text: text.to_owned(),
            at: Timestamp::from_unix_ms(0),
            failed,
        }
    }

    fn conv(cursor: u64, lines: Vec<Line>) -> Conversation {
        Conversation {
            cursor,
            lines,
            ..Conversation::default()
        }
    }

    #[test]
    fn the_reply_is_the_turn_after_the_prompt() {
        let user = |f: &str, t: &str| line(Speaker::User, Some(f), t, false);
        let said = |t: &str| line(Speaker::Assistant, None, t, false);
        // Not read yet.
        assert_eq!(
            outcome(&conv(4, vec![user("op", "hi"), said("yo")]), 5, SENDER, "q"),
            TurnOutcome::Pending
        );
        // Read together with another message; the turn's one reply answers both.
        let c = conv(
            6,
            vec![
                user("op", "hi"),
                said("turn 1"),
                user(SENDER, "q"),
                user("op", "also"),
                said("turn 2"),
            ],
        );
        assert_eq!(
            outcome(&c, 5, SENDER, "q"),
            TurnOutcome::Replied("turn 2".into())
        );
        // A failed turn.
        let c = conv(
            5,
            vec![
                user(SENDER, "q"),
                line(Speaker::Assistant, None, "it broke", true),
            ],
        );
        assert_eq!(
            outcome(&c, 5, SENDER, "q"),
            TurnOutcome::Failed("it broke".into())
        );
        // The prompt's line was compacted away: the last reply.
        let c = conv(9, vec![said("only this")]);
        assert_eq!(
            outcome(&c, 5, SENDER, "q"),
            TurnOutcome::Replied("only this".into())
        );
    }

    #[test]
    fn addresses_and_descriptions() {
        let mut m = Teammate::spawn(
            "Team_A",
            "Data_Bot",
            "analyst",
            "good",
            "default",
            "\n  Crunches numbers.\nMore.",
            Timestamp::from_unix_ms(0),
        );
        let a = address("flotilla", &m.team, &m.name).expect("tokens");
        assert_eq!(a.prompt(), "agents.prompt.data-bot.flotilla.team-a");
        assert_eq!(description(&m), "Crunches numbers.");
        m.instructions = "é".repeat(300);
        assert!(description(&m).len() <= MAX_DESCRIPTION);
        let s = spec(&m, a, "flotilla");
        assert_eq!(s.metadata["flotilla_teammate"], "Data_Bot");
        assert_eq!(s.metadata["flotilla_team"], "Team_A");
        assert_eq!(s.metadata["capabilities"], "analyst");
        assert_eq!(s.metadata["session"], "team-a");
        assert_eq!(s.metadata["flotilla_prefix"], "flotilla");
    }
}
