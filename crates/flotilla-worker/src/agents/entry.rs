//! `[agents.NAME]` as written: an agent definition and its member card in one table.
//!
//! ```toml
//! [agents.analyst]
//! kind = "llm"
//! model = "smollm2"
//! roles = ["analyst", "writer"]          # the member card: team roles,
//! description = "Reads filings"          # what it is for,
//! capabilities = ["filings", "tables"]   # and what it can do
//! compensate = "retract"                 # the agent that undoes its tasks on a rollback
//! expose = true                          # an agent of the NATS Agent Protocol too
//! ```
//!
//! The card's keys (and `compensate`, `expose`) are taken out before the rest is read as the
//! definition, so every kind keeps refusing keys it does not know.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use flotilla_model::team::MemberCard;

use super::AgentDefinition;

/// The keys of `[agents.NAME]` that belong to the member card.
const CARD_KEYS: [&str; 3] = ["roles", "description", "capabilities"];

/// One `[agents.NAME]` table.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentEntry {
    /// How to run it.
    pub definition: AgentDefinition,
    /// What the team knows of it.
    pub card: MemberCard,
    /// The agent that undoes its tasks' work when their run is cancelled with `rollback`
    /// (a plan's subtask may name its own).
    pub compensate: Option<String>,
    /// Whether the coordinators expose it as an agent of the NATS Agent Protocol (the
    /// `agents` micro service), so any client of that protocol can prompt it.
    pub expose: bool,
}

impl From<AgentDefinition> for AgentEntry {
    fn from(definition: AgentDefinition) -> Self {
        Self {
            definition,
            card: MemberCard::default(),
            compensate: None,
            expose: false,
        }
    }
}

impl<'de> Deserialize<'de> for AgentEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut table = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        let mut card = serde_json::Map::new();
        for k in CARD_KEYS {
            if let Some(v) = table.remove(k) {
                card.insert(k.to_owned(), v);
            }
        }
        let compensate = match table.remove("compensate") {
            None => None,
            Some(serde_json::Value::String(agent)) => {
                flotilla_model::token::check_name(&agent)
                    .map_err(|e| D::Error::custom(format!("compensate: agent {agent:?} {e}")))?;
                Some(agent)
            }
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "compensate: expected an agent name, found {other}"
                )));
            }
        };
        let expose = match table.remove("expose") {
            None => false,
            Some(serde_json::Value::Bool(b)) => b,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "expose: expected true or false, found {other}"
                )));
            }
        };
        let card = MemberCard::deserialize(serde_json::Value::Object(card))
            .map_err(|e| D::Error::custom(format!("member card: {e}")))?;
        card.validate()
            .map_err(|e| D::Error::custom(format!("member card: {e}")))?;
        let definition = AgentDefinition::deserialize(serde_json::Value::Object(table))
            .map_err(D::Error::custom)?;
        Ok(Self {
            definition,
            card,
            compensate,
            expose,
        })
    }
}

impl Serialize for AgentEntry {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut v = serde_json::to_value(&self.definition).map_err(S::Error::custom)?;
        if let (Some(table), serde_json::Value::Object(card)) = (
            v.as_object_mut(),
            serde_json::to_value(&self.card).map_err(S::Error::custom)?,
        ) {
            table.extend(card);
            if let Some(agent) = &self.compensate {
                table.insert("compensate".into(), agent.clone().into());
            }
            if self.expose {
                table.insert("expose".into(), true.into());
            }
        }
        v.serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_card_rides_along_with_any_kind() {
        let e: AgentEntry = serde_json::from_value(serde_json::json!({
            "kind": "scripted",
            "reply": "ok",
            "roles": ["analyst"],
            "description": "answers",
            "compensate": "retract",
            "expose": true,
        }))
        .expect("entry");
        assert!(e.expose);
        assert_eq!(e.card.roles, ["analyst"]);
        assert_eq!(e.compensate.as_deref(), Some("retract"));
        assert!(matches!(e.definition, AgentDefinition::Scripted(_)));
        let back = serde_json::to_value(&e).expect("encode");
        assert_eq!(back["roles"], serde_json::json!(["analyst"]));
        assert_eq!(
            serde_json::from_value::<AgentEntry>(back).expect("decode"),
            e
        );
    }

    #[test]
    fn bad_cards_and_unknown_keys_are_refused() {
        let bad_role = serde_json::from_value::<AgentEntry>(serde_json::json!({
            "kind": "scripted", "reply": "ok", "roles": ["no spaces"],
        }))
        .expect_err("bad role");
        assert!(
            bad_role.to_string().contains("role \"no spaces\""),
            "{bad_role}"
        );
        let unknown = serde_json::from_value::<AgentEntry>(serde_json::json!({
            "kind": "scripted", "reply": "ok", "rolez": ["a"],
        }))
        .expect_err("unknown key");
        assert!(unknown.to_string().contains("rolez"), "{unknown}");
        let bad_compensation = serde_json::from_value::<AgentEntry>(serde_json::json!({
            "kind": "scripted", "reply": "ok", "compensate": 3,
        }))
        .expect_err("not a name");
        assert!(
            bad_compensation.to_string().contains("compensate"),
            "{bad_compensation}"
        );
    }
}
