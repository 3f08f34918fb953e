//! What one tool call gives back to the model ([`ToolOutcome`]) and the key of a child run it
//! starts ([`child_call_key`]): shared by the tool set (`tools`) and the tools in modules of
//! their own (`recruit`, `teammate_tools`, `lead_tools`, `contract_net`), which the tool set
//! calls.

use flotilla_context::ContextError;
use flotilla_model::run::RunHandle;
use serde_json::{Value, json};
use sha2::Digest;

/// Longest tool output handed back to the model, in bytes; longer output is cut with a
/// marker.
pub const MAX_TOOL_OUTPUT: usize = 64 * 1024;

/// The outcome of one call, as handed back to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutcome {
    /// The result (or `{"error": …}`).
    pub output: Value,
    /// Why it failed, when it did.
    pub error: Option<String>,
    /// The child run, when the tool was another agent (`call_agent`).
    pub run_link: Option<RunHandle>,
    /// The call was refused for good: its child run was rejected, or a transfer would loop.
    /// An attempt that then gives up fails with `child_rejected` (not retried).
    pub refused: bool,
}

impl ToolOutcome {
    pub(crate) fn ok(output: Value) -> Self {
        Self {
            output,
            error: None,
            run_link: None,
            refused: false,
        }
    }

    pub(crate) fn err(code: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            output: json!({"error": {"code": code, "message": message}}),
            error: Some(format!("{code}: {message}")),
            run_link: None,
            refused: false,
        }
    }

    /// A child run the coordinator rejected (`e` is `child_rejected`): the error carries the
    /// problems, its code is the first problem's, and the rejected child is the run link.
    pub(crate) fn rejected(e: &ContextError) -> Self {
        let problems = e.problems();
        let code = problems.first().map_or(e.code(), |p| p.code.as_str());
        let mut out = Self::err(code, e.message());
        out.output["error"]["problems"] = to_json(&problems);
        if let Some(child) = e.rejected_child() {
            out.output["error"]["run_id"] = json!(child.run_id);
        }
        out.run_link = e.rejected_child().cloned();
        out.refused = true;
        out
    }

    /// The text of the tool message: the JSON result, cut at [`MAX_TOOL_OUTPUT`].
    pub fn text(&self) -> String {
        let text = match &self.output {
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        cut(&text, MAX_TOOL_OUTPUT)
    }
}

pub(crate) fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n[… {} bytes cut: tool output is capped at {max} bytes …]",
        &text[..end],
        text.len() - end
    )
}

pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The child-call key of a model's tool call id: the id itself when it is subject-safe
/// (`call_abc123`), else a digest of it — the same for the same call on every delivery.
pub(crate) fn child_call_key(call_id: &str) -> String {
    if !call_id.is_empty()
        && call_id.len() <= 64
        && call_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        call_id.to_owned()
    } else {
        let digest = sha2::Sha256::digest(call_id.as_bytes());
        format!(
            "tc-{}",
            digest[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        )
    }
}
