//! The prompt of one attempt: a system message and a user message rendered from the task
//! envelope.
//!
//! **System message**: the role's prompt ([`crate::Roles`]), then the agent's `instruction`
//! with `{key}` placeholders filled from session state (`{key?}`: empty when unset; a missing
//! `{key}` fails the task with `missing_state_key`).
//!
//! **User message**, in this order (sections without content are left out):
//!
//! ```text
//! # Query
//! <the run's query>
//!
//! # Your task (<task id>)
//! <the task description>
//!
//! # Input
//! <the subtask's input, as JSON>
//!
//! # Results of the tasks you depend on
//! ## <task id> (succeeded, numeric value 12.5)
//! <response>
//!
//! # Results of earlier tasks
//! ## <task id> (failed)
//! <response>
//!
//! # Workspace entries you consume
//! ## Topic <topic> (<n> entries; more after seq <s>: read them with workspace_read)
//! - seq <s> from <writer>: <entry as JSON>
//!
//! # Workspace topics you produce
//! <topics> — write entries with the workspace_write tool.
//! ```
//!
//! "Results of earlier tasks" lists the `previous_results` that are not also direct
//! dependencies. The message is capped at `max-prompt-chars`: when it is larger, sections
//! are cut in reverse order of priority — workspace entries first, then earlier results,
//! dependency results, input, query, and the task description last — and every cut is
//! marked in the text (`[… N characters cut: …]`), never silent.

use flotilla_model::task::{DependencyResult, TaskEnvelope};
use serde_json::Value;

/// Renders the user message of `task`, at most `cap` characters (plus cut markers).
pub fn user_message(task: &TaskEnvelope, cap: usize) -> String {
    // (order of appearance, priority: lower is kept first, text)
    let mut sections: Vec<(u8, u8, String)> = Vec::new();
    if let Some(q) = task.query.as_deref().filter(|q| !q.trim().is_empty()) {
        sections.push((0, 1, format!("# Query\n{q}\n\n")));
    }
    sections.push((
        1,
        0,
        format!(
            "# Your task ({})\n{}\n\n",
            task.task_id,
            if task.description.trim().is_empty() {
                "(no description)"
            } else {
                &task.description
            }
        ),
    ));
    if !task.input.is_null() {
        let input = serde_json::to_string_pretty(&task.input).unwrap_or_default();
        sections.push((2, 3, format!("# Input\n```json\n{input}\n```\n\n")));
    }
    if !task.dependency_results.is_empty() {
        let mut s = String::from("# Results of the tasks you depend on\n");
        for (id, r) in &task.dependency_results {
            push_result(&mut s, id.as_str(), r);
        }
        sections.push((3, 4, s));
    }
    let earlier: Vec<_> = task
        .previous_results
        .iter()
        .filter(|(id, _)| !task.dependency_results.contains_key(*id))
        .collect();
    if !earlier.is_empty() {
        let mut s = String::from("# Results of earlier tasks\n");
        for (id, r) in earlier {
            push_result(&mut s, id.as_str(), r);
        }
        sections.push((4, 5, s));
    }
    if !task.consumed.is_empty() {
        let mut s = String::from("# Workspace entries you consume\n");
        for (topic, c) in &task.consumed {
            s.push_str(&format!(
                "## Topic {topic} ({} entr{}{})\n",
                c.entries.len(),
                if c.entries.len() == 1 { "y" } else { "ies" },
                if c.truncated {
                    format!(
                        "; more after seq {}: read them with workspace_read",
                        c.next_since_seq
                    )
                } else {
                    String::new()
                }
            ));
            for e in &c.entries {
                let writer = e
                    .writer
                    .as_ref()
                    .and_then(|w| {
                        w.task_id
                            .as_ref()
                            .map(ToString::to_string)
                            .or_else(|| w.by.clone())
                    })
                    .unwrap_or_else(|| "unknown".into());
                s.push_str(&format!(
                    "- seq {} from {writer}: {}\n",
                    e.seq,
                    Value::Object(e.entry.clone())
                ));
            }
        }
        s.push('\n');
        sections.push((5, 6, s));
    }
    if !task.produces.is_empty() {
        sections.push((
            6,
            2,
            format!(
                "# Workspace topics you produce\n{} — write entries with the workspace_write tool.\n\n",
                task.produces.join(", ")
            ),
        ));
    }
    fit(sections, cap).trim_end().to_owned()
}

fn push_result(s: &mut String, id: &str, r: &DependencyResult) {
    let status = if r.success { "succeeded" } else { "failed" };
    match r.numeric_value {
        Some(v) => s.push_str(&format!("## {id} ({status}, numeric value {v})\n")),
        None => s.push_str(&format!("## {id} ({status})\n")),
    }
    s.push_str(r.response.trim_end());
    s.push_str("\n\n");
}

/// Keeps sections by priority within `cap` characters, cutting the first one that does not
/// fit and dropping the rest (each with a marker), then joins them in order of appearance.
fn fit(mut sections: Vec<(u8, u8, String)>, cap: usize) -> String {
    let total: usize = sections.iter().map(|s| s.2.chars().count()).sum();
    if total <= cap {
        sections.sort_by_key(|s| s.0);
        return sections.into_iter().map(|s| s.2).collect();
    }
    sections.sort_by_key(|s| s.1);
    let mut left = cap;
    for (_, _, text) in &mut sections {
        let len = text.chars().count();
        if len <= left {
            left -= len;
            continue;
        }
        let keep = left;
        let cut = len - keep;
        let head: String = text.chars().take(keep).collect();
        *text = format!(
            "{head}\n[… {cut} characters cut: the prompt is capped at {cap} characters (max-prompt-chars) …]\n\n"
        );
        left = 0;
    }
    sections.sort_by_key(|s| s.0);
    sections.into_iter().map(|s| s.2).collect()
}

pub use flotilla_model::template::{fill, placeholders};

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_model::TaskId;

    fn envelope() -> TaskEnvelope {
        serde_json::from_value(serde_json::json!({
            "run_id": flotilla_model::RunId::new(),
            "task_id": "report",
            "attempt": 1,
            "attempt_id": flotilla_model::ids::AttemptId::new(),
            "pool": "default",
            "required": true,
            "timeout": 60,
            "description": "Write the report.",
            "query": "How did Q3 go?",
            "input": {"quarter": "Q3"},
            "produces": ["report"],
            "dispatched_at": "2026-01-01T00:00:00Z"
        }))
        .expect("envelope")
    }

    fn result(response: &str, value: Option<f64>) -> DependencyResult {
        DependencyResult {
            response: response.into(),
            tokens: 1,
            success: true,
            tools_used: Vec::new(),
            numeric_value: value,
        }
    }

    #[test]
    fn sections_render_in_the_documented_order() {
        let mut t = envelope();
        t.dependency_results
            .insert(TaskId::new("growth"), result("Growth was 6.7%.", Some(6.7)));
        t.previous_results
            .insert(TaskId::new("growth"), result("Growth was 6.7%.", Some(6.7)));
        t.previous_results
            .insert(TaskId::new("fetch"), result("raw numbers", None));
        let m = user_message(&t, 48_000);
        let order = [
            "# Query\nHow did Q3 go?",
            "# Your task (report)\nWrite the report.",
            "# Input\n```json",
            "# Results of the tasks you depend on\n## growth (succeeded, numeric value 6.7)\nGrowth was 6.7%.",
            "# Results of earlier tasks\n## fetch (succeeded)\nraw numbers",
            "# Workspace topics you produce\nreport",
        ];
        let mut at = 0;
        for part in order {
            let found = m[at..]
                .find(part)
                .unwrap_or_else(|| panic!("{part:?} in\n{m}"));
            at += found + part.len();
        }
        assert_eq!(m.matches("Growth was").count(), 1, "{m}");
        assert!(!m.contains("characters cut"));
    }

    #[test]
    fn the_cap_cuts_low_priority_sections_first_and_says_so() {
        let mut t = envelope();
        t.previous_results
            .insert(TaskId::new("fetch"), result(&"x".repeat(5000), None));
        let m = user_message(&t, 1000);
        assert!(m.contains("Write the report."), "the task stays");
        assert!(m.contains("How did Q3 go?"), "the query stays");
        assert!(
            m.contains(
                "characters cut: the prompt is capped at 1000 characters (max-prompt-chars)"
            ),
            "{m}"
        );
        assert!(m.chars().count() < 1300, "{}", m.chars().count());
    }
}
