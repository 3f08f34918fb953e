//! An LLM attempt's conversation replayed from its step journal, for `runs replay`: every
//! model reply and every round of tool results is served from the `agent_step` events the
//! attempt recorded — no model is called, no tool runs — and walked the way the LLM agent
//! walks a live conversation (`flotilla_llm::agent`): a reply that calls tools is followed by
//! one round of their results, a reply without tool calls answers (with an `output_schema`,
//! one repair turn may follow an answer that did not match), and `transfer_to_agent` hands the
//! answer to a child run. The walk must reach the answer the attempt recorded, with the
//! tokens it counted; the first step where it does not is the divergence — a step missing from
//! the journal is one too, never a call.

use std::collections::BTreeMap;

use flotilla_model::event::StepEntry;
use flotilla_model::task::TaskResult;
use serde_json::Value;

/// The tool that hands a conversation to another agent (its answer is the attempt's).
const TRANSFER_TOOL: &str = "transfer_to_agent";

/// Longest text a divergence quotes of a response.
const QUOTE: usize = 200;

/// What a conversation's replay served from the journal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Served {
    /// Model replies taken from the journal instead of calling the model.
    pub(crate) replies: u32,
    /// Rounds of tool results taken from the journal instead of running the tools.
    pub(crate) rounds: u32,
}

/// Where a conversation's replay first differs from what the attempt recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepDivergence {
    /// The step (absent: the attempt's totals).
    pub(crate) step: Option<u32>,
    pub(crate) recorded: String,
    pub(crate) replayed: String,
}

impl StepDivergence {
    fn at(step: u32, recorded: impl Into<String>, replayed: impl Into<String>) -> Self {
        Self {
            step: Some(step),
            recorded: recorded.into(),
            replayed: replayed.into(),
        }
    }
}

/// Replays the conversation of `steps` and checks it answers `result`. `schema`: the task's
/// `output_schema`, whose answers are JSON.
pub(crate) fn replay_conversation(
    steps: &BTreeMap<u32, StepEntry>,
    result: &TaskResult,
    schema: Option<&Value>,
) -> Result<Served, StepDivergence> {
    let mut served = Served::default();
    let mut step = 0u32;
    let mut tokens = 0u64;
    let mut repaired = false;
    let (answer, at) = loop {
        let (content, calls) = match steps.get(&step) {
            Some(StepEntry::ModelReply {
                content,
                tool_calls,
                prompt_tokens,
                completion_tokens,
                ..
            }) => {
                tokens += prompt_tokens + completion_tokens;
                (content, tool_calls)
            }
            Some(StepEntry::ToolResults { results }) => {
                return Err(StepDivergence::at(
                    step,
                    format!("a round of {} tool results", results.len()),
                    "a model reply (the next model call)",
                ));
            }
            None => {
                return Err(StepDivergence::at(
                    step,
                    "nothing: the step is missing from the journal",
                    "a model reply (the next model call; a replay makes none)",
                ));
            }
        };
        served.replies += 1;
        let reply_step = step;
        step += 1;
        if !calls.is_empty() {
            match steps.get(&step) {
                Some(StepEntry::ToolResults { results }) if results.len() == calls.len() => {
                    served.rounds += 1;
                    step += 1;
                    continue;
                }
                // The conversation was handed over: the child run's answer is the attempt's.
                None if calls.iter().any(|c| c.name == TRANSFER_TOOL) => {
                    return finish(steps, step, served, None);
                }
                Some(StepEntry::ToolResults { results }) => {
                    return Err(StepDivergence::at(
                        step,
                        format!("{} tool results", results.len()),
                        format!(
                            "the results of the {} tool calls of step {reply_step}",
                            calls.len()
                        ),
                    ));
                }
                other => {
                    return Err(StepDivergence::at(
                        step,
                        match other {
                            None => "nothing: the step is missing from the journal".to_owned(),
                            Some(_) => "a model reply".to_owned(),
                        },
                        format!(
                            "the results of the {} tool calls of step {reply_step} (a replay runs no tool)",
                            calls.len()
                        ),
                    ));
                }
            }
        }
        let Some(_) = schema else {
            break (content.clone(), reply_step);
        };
        // An answer that does not match the schema gets one repair turn: another reply.
        let parsed = json_answer(content);
        let next_is_reply = matches!(steps.get(&step), Some(StepEntry::ModelReply { .. }));
        match parsed {
            Some(value) if !next_is_reply || repaired => break (value.to_string(), reply_step),
            _ if next_is_reply && !repaired => {
                repaired = true;
            }
            _ => {
                return Err(StepDivergence::at(
                    reply_step,
                    "an answer that is not JSON",
                    "a JSON answer for the task's output_schema",
                ));
            }
        }
    };
    if answer != result.response {
        return Err(StepDivergence::at(
            at,
            format!("the answer {:?}", quote(&result.response)),
            format!("the answer {:?}", quote(&answer)),
        ));
    }
    if tokens != result.tokens {
        return Err(StepDivergence {
            step: None,
            recorded: format!("{} tokens", result.tokens),
            replayed: format!(
                "{tokens} tokens over the journal's {} model replies",
                served.replies
            ),
        });
    }
    finish(steps, step, served, Some(at))
}

/// Nothing may follow the step that ended the conversation.
fn finish(
    steps: &BTreeMap<u32, StepEntry>,
    next: u32,
    served: Served,
    answered_at: Option<u32>,
) -> Result<Served, StepDivergence> {
    match steps.range(next..).next() {
        None => Ok(served),
        Some((&extra, _)) => Err(StepDivergence::at(
            extra,
            "a step after the conversation ended",
            match answered_at {
                Some(at) => format!("nothing: step {at} answered"),
                None => format!("nothing: step {} handed the conversation over", next - 1),
            },
        )),
    }
}

/// The JSON in an answer, a Markdown code fence around it tolerated (as the agent reads it).
fn json_answer(text: &str) -> Option<Value> {
    serde_json::from_str(flotilla_model::task::unfenced_json(text)).ok()
}

fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_model::event::StepToolCall;

    fn reply(content: &str, calls: &[&str], tokens: u64) -> StepEntry {
        StepEntry::ModelReply {
            content: content.into(),
            tool_calls: calls
                .iter()
                .enumerate()
                .map(|(i, n)| StepToolCall {
                    id: format!("c{i}"),
                    name: (*n).into(),
                    arguments: "{}".into(),
                })
                .collect(),
            prompt_tokens: tokens,
            completion_tokens: 0,
            model: "m".into(),
        }
    }

    fn results(n: usize) -> StepEntry {
        StepEntry::ToolResults {
            results: vec!["ok".into(); n],
        }
    }

    fn result(response: &str, tokens: u64) -> TaskResult {
        TaskResult {
            response: response.into(),
            tokens,
            success: true,
            tools_used: Vec::new(),
            numeric_value: None,
            error: None,
            confidence: None,
        }
    }

    fn journal(steps: Vec<StepEntry>) -> BTreeMap<u32, StepEntry> {
        steps
            .into_iter()
            .enumerate()
            .map(|(i, s)| (i as u32, s))
            .collect()
    }

    #[test]
    fn a_whole_conversation_reaches_the_recorded_answer() {
        let steps = journal(vec![
            reply("", &["a", "b"], 10),
            results(2),
            reply("done", &[], 5),
        ]);
        assert_eq!(
            replay_conversation(&steps, &result("done", 15), None),
            Ok(Served {
                replies: 2,
                rounds: 1
            })
        );
    }

    #[test]
    fn a_missing_step_is_a_divergence_not_a_call() {
        let mut steps = journal(vec![reply("", &["a"], 1), results(1), reply("x", &[], 1)]);
        steps.remove(&1);
        let d = replay_conversation(&steps, &result("x", 2), None).expect_err("gap");
        assert_eq!(d.step, Some(1));
        assert!(d.recorded.contains("missing"), "{d:?}");
        let d = replay_conversation(&journal(vec![reply("", &["a"], 1)]), &result("", 1), None)
            .expect_err("no results");
        assert_eq!(d.step, Some(1));
    }

    #[test]
    fn another_answer_or_other_tokens_diverge() {
        let steps = journal(vec![reply("yes", &[], 3)]);
        let d = replay_conversation(&steps, &result("no", 3), None).expect_err("answer");
        assert_eq!(d.step, Some(0));
        let d = replay_conversation(&steps, &result("yes", 4), None).expect_err("tokens");
        assert_eq!(d.step, None);
        let steps = journal(vec![reply("", &["a", "b"], 1), results(1)]);
        let d = replay_conversation(&steps, &result("", 1), None).expect_err("count");
        assert!(d.replayed.contains("2 tool calls"), "{d:?}");
        let steps = journal(vec![reply("yes", &[], 3), reply("again", &[], 1)]);
        let d = replay_conversation(&steps, &result("yes", 3), None).expect_err("extra");
        assert_eq!(d.step, Some(1));
    }

    #[test]
    fn a_schema_answer_may_be_repaired_once_and_a_transfer_hands_over() {
        let schema = serde_json::json!({"type": "object"});
        let steps = journal(vec![
            reply("not json", &[], 1),
            reply("```json\n{\"n\": 1}\n```", &[], 1),
        ]);
        assert_eq!(
            replay_conversation(&steps, &result("{\"n\":1}", 2), Some(&schema)).map(|s| s.replies),
            Ok(2)
        );
        let steps = journal(vec![reply("", &[TRANSFER_TOOL], 1)]);
        assert_eq!(
            replay_conversation(&steps, &result("the child's answer", 1), None)
                .map(|s| (s.replies, s.rounds)),
            Ok((1, 0))
        );
    }
}
