//! Every problem of a submission or a plan that does not decode, at once.
//!
//! A strict decode stops at the first wrong field: `{"timeout": "banana", …}` would hide a
//! cycle, an unknown agent and every other type error behind one `malformed`. When the strict
//! decode fails, the document is read again leniently: first as a plain value (JSON, or
//! MessagePack turned into the same value), then field by field against the shape of the
//! message. Each field is decoded on its own, as its own Rust type — the same decoder as
//! the strict pass, so the two never disagree on what is valid — and every field that fails
//! is reported with its path (`subtasks[2].timeout`) and left out (its default applies; a
//! required one gets a stand-in). The repaired document then decodes, and is validated as
//! any submission is, so its other problems are reported too. Problems the validator finds
//! at or under a path already reported (the stand-in of a bad task id, the empty list that
//! replaced a bad `subtasks`) are not reported twice.
//!
//! Paths inside a plan are relative to the plan (`subtasks[0].id`), as the validator names
//! them; a submission's own fields are named as they are (`reply_to`, `parent.run_id`).
//!
//! This only runs for documents that failed to decode (never on the hot path), and costs a
//! few passes over the document.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::codec::{Codec, check_protocol};
use crate::ids::RunId;
use crate::plan::Plan;
use crate::problem::{Problem, ProblemCode};
use crate::submit::{SubmitForm, SubmitRequest};
use crate::validate::{
    MAX_REPORTED_PROBLEMS, ValidationContext, check_parent, truncate_problems, validate_plan,
};

/// Checks that a value decodes as a field's type.
type Check = fn(&Value) -> Result<(), String>;

/// What a field holds.
enum Kind {
    /// A value decoded as the field's own type.
    Typed(Check),
    /// An object of a known shape, read field by field.
    Object(&'static Shape),
    /// An array of objects of a known shape.
    Objects(&'static Shape),
}

/// One field of a message.
struct Field {
    name: &'static str,
    kind: Kind,
    /// For a required field: what stands in for it when it is missing or unusable, given its
    /// path. `None`: optional (left out, its default applies).
    required: Option<fn(&str) -> Value>,
    /// The field's own fields are named from it, not from the enclosing document (a plan
    /// inside a submission: validation names plan paths relative to the plan).
    restarts_paths: bool,
}

/// The fields of a message.
struct Shape {
    fields: &'static [Field],
    /// Unknown fields are refused (`deny_unknown_fields`).
    closed: bool,
}

fn check<T: DeserializeOwned>(v: &Value) -> Result<(), String> {
    T::deserialize(v).map(drop).map_err(|e| e.to_string())
}

const fn typed(name: &'static str, check: Check) -> Field {
    Field {
        name,
        kind: Kind::Typed(check),
        required: None,
        restarts_paths: false,
    }
}

/// A task id that cannot clash with a real one: the path it stands in for, in brackets.
fn task_id_stand_in(path: &str) -> Value {
    Value::String(format!("({path})"))
}

fn no_subtasks(_: &str) -> Value {
    Value::Array(Vec::new())
}

fn empty_plan(_: &str) -> Value {
    serde_json::json!({ "subtasks": [] })
}

fn nil_run(_: &str) -> Value {
    Value::String(uuid::Uuid::nil().to_string())
}

static SUBTASK: Shape = Shape {
    closed: true,
    fields: &[
        Field {
            required: Some(task_id_stand_in),
            ..typed("id", check::<crate::ids::TaskId>)
        },
        typed("description", check::<String>),
        typed("role", check::<Option<String>>),
        typed("agent", check::<Option<String>>),
        typed("pool", check::<String>),
        typed("dependencies", check::<Vec<crate::ids::TaskId>>),
        typed("produces", check::<Vec<String>>),
        typed("consumes", check::<Vec<String>>),
        typed("action", check::<Option<String>>),
        typed("risk", check::<crate::plan::Risk>),
        typed("compensate", check::<Option<String>>),
        typed("required", check::<bool>),
        typed("timeout", check::<Option<crate::time::Secs>>),
        typed("input", check::<Value>),
        typed("output_key", check::<Option<String>>),
        typed("output_schema", check::<Option<Value>>),
        typed("model", check::<Option<String>>),
    ],
};

static CONFIG: Shape = Shape {
    closed: true,
    fields: &[
        typed("max_concurrency", check::<u32>),
        typed("dependency_timeout", check::<crate::time::Secs>),
        typed("task_timeout", check::<crate::time::Secs>),
        typed("pass_dependency_results", check::<bool>),
        typed(
            "dataflow_validation",
            check::<crate::plan::DataflowValidation>,
        ),
        typed("max_retries", check::<u32>),
        typed("failure_ratio", check::<f64>),
        typed("strategy", check::<crate::plan::Strategy>),
        typed("max_tokens", check::<Option<u64>>),
        typed("max_cost", check::<Option<f64>>),
        typed("recruit_roles", check::<Option<Vec<String>>>),
        typed("max_recruits", check::<Option<u32>>),
        typed("lead_timeout", check::<crate::time::Secs>),
        typed("hitl", check::<Option<crate::approval::PlanHitl>>),
        typed("client_tools", check::<Vec<crate::plan::ClientTool>>),
    ],
};

static PLAN: Shape = Shape {
    closed: true,
    fields: &[
        typed("name", check::<Option<String>>),
        typed("query", check::<Option<String>>),
        Field {
            name: "subtasks",
            kind: Kind::Objects(&SUBTASK),
            required: Some(no_subtasks),
            restarts_paths: false,
        },
        Field {
            name: "config",
            kind: Kind::Object(&CONFIG),
            required: None,
            restarts_paths: false,
        },
        typed("fork", check::<Option<crate::fork::ForkOrigin>>),
    ],
};

static HANDLE: Shape = Shape {
    closed: false,
    fields: &[
        Field {
            required: Some(nil_run),
            ..typed("run_id", check::<RunId>)
        },
        typed("agent_id", check::<Option<crate::ids::AgentId>>),
        typed("parent_run_id", check::<Option<RunId>>),
        typed("parent_tool_call_id", check::<Option<String>>),
        typed("parent_task_id", check::<Option<crate::ids::TaskId>>),
        typed("root_run_id", check::<Option<RunId>>),
    ],
};

/// A plan inside another message: its paths are relative to the plan.
const PLAN_FIELD: Field = Field {
    name: "plan",
    kind: Kind::Object(&PLAN),
    required: None,
    restarts_paths: true,
};

static SUBMISSION: Shape = Shape {
    closed: true,
    fields: &[
        typed("protocol", check::<u32>),
        typed("run_id", check::<Option<RunId>>),
        typed("idempotency_key", check::<Option<String>>),
        typed(
            "labels",
            check::<std::collections::BTreeMap<String, String>>,
        ),
        typed("session_id", check::<Option<crate::ids::SessionId>>),
        Field {
            name: "parent",
            kind: Kind::Object(&HANDLE),
            required: None,
            restarts_paths: false,
        },
        typed("reply_to", check::<Option<String>>),
        typed("wait", check::<bool>),
        PLAN_FIELD,
        typed("query", check::<Option<String>>),
    ],
};

static VALIDATE_REQUEST: Shape = Shape {
    closed: true,
    fields: &[
        typed("protocol", check::<u32>),
        // Named from the top (`plan.subtasks[0]`), to tell the request's own problems from
        // the plan's.
        Field {
            restarts_paths: false,
            required: Some(empty_plan),
            ..PLAN_FIELD
        },
    ],
};

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn malformed(path: &str, message: impl Into<String>) -> Problem {
    Problem::new(ProblemCode::Malformed, path, message)
}

/// What a value is, for "expected an object, found …".
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An object of `shape` holding only the stand-ins of its required fields.
fn stand_in(shape: &Shape, path: &str) -> Value {
    let mut map = Map::new();
    for f in shape.fields {
        if let Some(make) = f.required {
            map.insert(f.name.to_owned(), make(&join(path, f.name)));
        }
    }
    Value::Object(map)
}

/// Reads `map` as an object of `shape` named `path`: reports every field that does not
/// decode, every unknown field (closed shapes) and every missing required one, and repairs
/// the object so that it decodes.
fn walk(map: &mut Map<String, Value>, shape: &Shape, path: &str, out: &mut Vec<Problem>) {
    if shape.closed {
        let unknown: Vec<String> = map
            .keys()
            .filter(|k| !shape.fields.iter().any(|f| f.name == k.as_str()))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            let known: Vec<String> = shape
                .fields
                .iter()
                .map(|f| format!("`{}`", f.name))
                .collect();
            for k in unknown {
                out.push(malformed(
                    &join(path, &k),
                    format!("unknown field `{k}`, expected one of {}", known.join(", ")),
                ));
                map.remove(&k);
            }
        }
    }
    for f in shape.fields {
        let here = join(path, f.name);
        let Some(v) = map.get_mut(f.name) else {
            if let Some(make) = f.required {
                out.push(malformed(&here, format!("missing field `{}`", f.name)));
                map.insert(f.name.to_owned(), make(&here));
            }
            continue;
        };
        let inner = if f.restarts_paths { "" } else { here.as_str() };
        let usable = match (&f.kind, &mut *v) {
            (Kind::Typed(check), v) => match check(v) {
                Ok(()) => true,
                Err(e) => {
                    out.push(malformed(&here, e));
                    false
                }
            },
            (Kind::Object(_), Value::Null) if f.required.is_none() => true,
            (Kind::Object(s), Value::Object(inner_map)) => {
                walk(inner_map, s, inner, out);
                true
            }
            (Kind::Objects(s), Value::Array(items)) => {
                for (i, item) in items.iter_mut().enumerate() {
                    let at = format!("{here}[{i}]");
                    match item {
                        Value::Object(m) => walk(m, s, &at, out),
                        other => {
                            out.push(malformed(
                                &at,
                                format!("expected an object, found {}", kind_of(other)),
                            ));
                            *other = stand_in(s, &at);
                        }
                    }
                }
                true
            }
            (Kind::Object(_), other) => {
                out.push(malformed(
                    &here,
                    format!("expected an object, found {}", kind_of(other)),
                ));
                false
            }
            (Kind::Objects(_), other) => {
                out.push(malformed(
                    &here,
                    format!("expected an array of objects, found {}", kind_of(other)),
                ));
                false
            }
        };
        if !usable {
            match f.required {
                Some(make) => {
                    map.insert(f.name.to_owned(), make(&here));
                }
                None => {
                    map.remove(f.name);
                }
            }
        }
    }
}

/// A document read leniently.
struct Read<T> {
    /// The document with every offending field left out or replaced by a stand-in; `None`
    /// when not even that decodes (not an object, not JSON or MessagePack at all).
    value: Option<T>,
    /// Every problem found reading it.
    problems: Vec<Problem>,
}

/// Reads `bytes` leniently as an object of `shape`, decoded as `T`.
fn read<T: DeserializeOwned>(codec: Codec, bytes: &[u8], shape: &Shape) -> Read<T> {
    let mut value = match codec.decode::<Value>(bytes) {
        Ok(v) => v,
        Err(e) => {
            return Read {
                value: None,
                problems: vec![e.to_problem()],
            };
        }
    };
    let Value::Object(map) = &mut value else {
        return Read {
            value: None,
            problems: vec![malformed(
                "",
                format!("expected an object, found {}", kind_of(&value)),
            )],
        };
    };
    let mut problems = Vec::new();
    walk(map, shape, "", &mut problems);
    match T::deserialize(&value) {
        Ok(v) => Read {
            value: Some(v),
            problems,
        },
        Err(e) => {
            problems.push(malformed("", e.to_string()));
            Read {
                value: None,
                problems,
            }
        }
    }
}

/// Whether `path` is `reported` or lies under it (`subtasks[2].id` under `subtasks[2]`).
fn under(path: &str, reported: &str) -> bool {
    match path.strip_prefix(reported) {
        Some(rest) => rest.is_empty() || rest.starts_with('.') || rest.starts_with('['),
        None => false,
    }
}

/// Adds `found` to `problems`, except those at or under a path `problems` already names:
/// what validation says of a stand-in, or of a field left out, repeats what reading it said.
pub fn add_unreported(problems: &mut Vec<Problem>, found: impl IntoIterator<Item = Problem>) {
    let reported: Vec<String> = problems.iter().map(|p| p.path.clone()).collect();
    problems.extend(
        found
            .into_iter()
            .filter(|p| !reported.iter().any(|r| under(&p.path, r))),
    );
}

/// Every problem of a submission body that did not decode (for run `run`, validated against
/// `ctx`): each field of the wrong type or unknown, each required one missing, and then what
/// validation finds in the rest — an invalid `reply_to` or `parent`, a plan and a query or
/// neither, and the plan's own problems. At most [`MAX_REPORTED_PROBLEMS`] (the last one
/// counting the rest); never empty. Used wherever a submission is decoded: the intake, the
/// API and a run's own submission subject.
pub fn submission_problems(
    codec: Codec,
    bytes: &[u8],
    run: RunId,
    ctx: &ValidationContext,
) -> Vec<Problem> {
    let Read {
        value,
        mut problems,
    } = read::<SubmitRequest>(codec, bytes, &SUBMISSION);
    if let Some(r) = value {
        if let Err(e) = check_protocol(r.protocol) {
            // A version this build does not speak: its other rules are unknown here.
            add_unreported(&mut problems, [e.to_problem()]);
        } else {
            let mut found = Vec::new();
            if let Some(s) = &r.reply_to
                && let Err(e) = crate::token::check_subject(s)
            {
                found.push(Problem::new(
                    ProblemCode::InvalidReplyTo,
                    "reply_to",
                    format!("reply_to {s:?} {e}"),
                ));
            }
            if let Some(parent) = &r.parent {
                found.extend(check_parent(parent, run));
            }
            match r.form() {
                Err(p) => found.push(p),
                Ok(SubmitForm::Plan(plan)) => found.extend(validate_plan(plan, ctx).errors),
                Ok(SubmitForm::Query(_)) => {}
            }
            add_unreported(&mut problems, found);
        }
    }
    finish(problems, codec, bytes)
}

/// A plan document that did not decode, read leniently ([`read_plan`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LenientPlan {
    /// The plan without the fields that could not be read (their defaults apply; a required
    /// one has a stand-in), so the rest can still be validated — against a deployment too;
    /// `None` when not even that decodes (not an object, not JSON or MessagePack at all).
    pub plan: Option<Plan>,
    /// Each field of the wrong type, unknown or missing; never empty.
    pub problems: Vec<Problem>,
}

/// Reads a plan document that did not decode field by field: what could not be read, and
/// the rest as a plan. Validate the rest wherever the deployment is known and add its
/// problems with [`add_unreported`] (those at a path already reported repeat it).
pub fn read_plan(codec: Codec, bytes: &[u8]) -> LenientPlan {
    let Read {
        value,
        mut problems,
    } = read::<Plan>(codec, bytes, &PLAN);
    if problems.is_empty() {
        // Not reachable for a document that failed to decode; never answer "valid" for one.
        problems = check_plan_decodes(codec, bytes);
    }
    LenientPlan {
        plan: value,
        problems,
    }
}

/// Every problem of a plan document that did not decode: the fields of the wrong type,
/// unknown or missing, then the validation problems of the rest (against `ctx`). At most
/// [`MAX_REPORTED_PROBLEMS`]; never empty. Submissions from a file (`flotilla submit`) are
/// read with it.
pub fn plan_problems(codec: Codec, bytes: &[u8], ctx: &ValidationContext) -> Vec<Problem> {
    let LenientPlan { plan, mut problems } = read_plan(codec, bytes);
    if let Some(plan) = plan {
        add_unreported(&mut problems, validate_plan(&plan, ctx).errors);
    }
    truncate_problems(problems, MAX_REPORTED_PROBLEMS)
}

/// A `plan.validate` request that did not decode. `Err` with the request's own problems
/// (not an object, unknown fields, a `protocol` of the wrong type, no `plan`, not JSON) —
/// a malformed request; else `Ok` with every problem of its plan, as [`plan_problems`]
/// reports them.
pub fn validate_request_problems(
    codec: Codec,
    bytes: &[u8],
    ctx: &ValidationContext,
) -> Result<Vec<Problem>, Vec<Problem>> {
    #[derive(serde::Deserialize)]
    struct Request {
        plan: Plan,
    }
    let Read { value, problems } = read::<Request>(codec, bytes, &VALIDATE_REQUEST);
    // The plan's problems, named relative to the plan as validation names them; the rest
    // are the request's own.
    let (mut in_plan, mut own) = (Vec::new(), Vec::new());
    for mut p in problems {
        match p.path.strip_prefix("plan.") {
            Some(rest) => {
                p.path = rest.to_owned();
                in_plan.push(p);
            }
            None => own.push(p),
        }
    }
    match value {
        Some(Request { plan }) if own.is_empty() => {
            add_unreported(&mut in_plan, validate_plan(&plan, ctx).errors);
            Ok(truncate_problems(in_plan, MAX_REPORTED_PROBLEMS))
        }
        _ => {
            own.extend(in_plan);
            Err(truncate_problems(own, MAX_REPORTED_PROBLEMS))
        }
    }
}

/// The strict decoder's own error, for a document the lenient pass found nothing wrong
/// with (a gap in this module's shapes): a decode failure is never answered with no
/// problem.
fn check_plan_decodes(codec: Codec, bytes: &[u8]) -> Vec<Problem> {
    match codec.decode::<Plan>(bytes) {
        Ok(_) => Vec::new(),
        Err(e) => vec![e.to_problem()],
    }
}

fn finish(problems: Vec<Problem>, codec: Codec, bytes: &[u8]) -> Vec<Problem> {
    let problems = if problems.is_empty() {
        match codec.decode::<SubmitRequest>(bytes) {
            Ok(_) => Vec::new(),
            Err(e) => vec![e.to_problem()],
        }
    } else {
        problems
    };
    truncate_problems(problems, MAX_REPORTED_PROBLEMS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{PlanConfig, Subtask};
    use crate::run::RunHandle;
    use serde_json::json;

    /// The fields a type's JSON Schema names, and those it requires.
    fn schema_fields(schema: schemars::Schema) -> (Vec<String>, Vec<String>) {
        let v = schema.as_value();
        let mut names: Vec<String> = v["properties"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        let mut required: Vec<String> = v["required"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        required.sort();
        (names, required)
    }

    fn shape_fields(shape: &Shape) -> (Vec<String>, Vec<String>) {
        let mut names: Vec<String> = shape.fields.iter().map(|f| f.name.to_owned()).collect();
        let mut required: Vec<String> = shape
            .fields
            .iter()
            .filter(|f| f.required.is_some())
            .map(|f| f.name.to_owned())
            .collect();
        names.sort();
        required.sort();
        (names, required)
    }

    #[test]
    fn shapes_name_every_field_of_their_types() {
        use schemars::schema_for;
        for (name, shape, schema) in [
            ("Subtask", &SUBTASK, schema_for!(Subtask)),
            ("PlanConfig", &CONFIG, schema_for!(PlanConfig)),
            ("Plan", &PLAN, schema_for!(Plan)),
            ("RunHandle", &HANDLE, schema_for!(RunHandle)),
            ("SubmitRequest", &SUBMISSION, schema_for!(SubmitRequest)),
            (
                "ValidatePlanRequest",
                &VALIDATE_REQUEST,
                schema_for!(crate::api::ValidatePlanRequest),
            ),
        ] {
            assert_eq!(shape_fields(shape), schema_fields(schema), "{name}");
        }
    }

    fn codes(problems: &[Problem]) -> Vec<(String, ProblemCode)> {
        problems.iter().map(|p| (p.path.clone(), p.code)).collect()
    }

    #[test]
    fn a_submission_with_type_errors_gets_every_problem() {
        let body = json!({
            "reply_to": "bad subject",
            "wait": "yes",
            "colour": "blue",
            "plan": {
                "subtasks": [
                    {"id": "a", "timeout": "banana", "dependencies": ["b"]},
                    {"id": "b", "dependencies": ["a"], "required": "no"},
                    {"id": 7, "description": 5},
                    "c",
                    {"id": "d", "depends": ["a"]}
                ],
                "config": {"max_retries": -1, "strategy": "fastest"}
            }
        });
        let bytes = serde_json::to_vec(&body).expect("json");
        assert!(Codec::Json.decode::<SubmitRequest>(&bytes).is_err());
        let problems = submission_problems(
            Codec::Json,
            &bytes,
            RunId::new(),
            &ValidationContext::default(),
        );
        let found = codes(&problems);
        let m = |path: &str| (path.to_owned(), ProblemCode::Malformed);
        for expected in [
            m("wait"),
            m("colour"),
            m("subtasks[0].timeout"),
            m("subtasks[1].required"),
            m("subtasks[2].id"),
            m("subtasks[2].description"),
            m("subtasks[3]"),
            m("subtasks[4].depends"),
            m("config.max_retries"),
            m("config.strategy"),
            ("reply_to".into(), ProblemCode::InvalidReplyTo),
        ] {
            assert!(found.contains(&expected), "{expected:?} not in {found:#?}");
        }
        // The plan's own problems are found too: the cycle between a and b.
        assert!(
            problems.iter().any(|p| p.code == ProblemCode::Cycle),
            "{found:#?}"
        );
        // The stand-ins of bad entries cause no problem of their own.
        assert!(
            !found
                .iter()
                .any(|(p, c)| p.starts_with("subtasks[2].id") && *c != ProblemCode::Malformed),
            "{found:#?}"
        );
        let timeout = problems
            .iter()
            .find(|p| p.path == "subtasks[0].timeout")
            .expect("timeout");
        assert!(timeout.message.contains("banana"), "{}", timeout.message);
    }

    #[test]
    fn message_pack_and_syntax_errors() {
        let body = json!({"plan": {"subtasks": [{"id": "a", "timeout": "banana"}, {"id": "a"}]}});
        let bytes = rmp_serde::to_vec_named(&body).expect("msgpack");
        let problems = submission_problems(
            Codec::MsgPack,
            &bytes,
            RunId::new(),
            &ValidationContext::default(),
        );
        let found = codes(&problems);
        assert!(found.contains(&("subtasks[0].timeout".into(), ProblemCode::Malformed)));
        assert!(
            problems.iter().any(|p| p.code == ProblemCode::DuplicateId),
            "{found:?}"
        );
        // Not a document at all: one problem saying so.
        let problems = submission_problems(
            Codec::Json,
            b"{\"plan\": ",
            RunId::new(),
            &ValidationContext::default(),
        );
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].code, ProblemCode::Malformed);
        let problems = submission_problems(
            Codec::Json,
            b"[1, 2]",
            RunId::new(),
            &ValidationContext::default(),
        );
        assert_eq!(
            codes(&problems),
            vec![(String::new(), ProblemCode::Malformed)]
        );
    }

    #[test]
    fn a_plan_that_is_not_an_object_or_lacks_subtasks() {
        let problems = submission_problems(
            Codec::Json,
            br#"{"plan": 5}"#,
            RunId::new(),
            &ValidationContext::default(),
        );
        // Reported once: no "missing plan" for the plan left out.
        assert_eq!(
            codes(&problems),
            vec![("plan".into(), ProblemCode::Malformed)]
        );
        let problems = plan_problems(
            Codec::Json,
            br#"{"subtasks": {"id": "a"}, "config": {"max_concurrency": "many"}}"#,
            &ValidationContext::default(),
        );
        assert_eq!(
            codes(&problems),
            vec![
                ("subtasks".into(), ProblemCode::Malformed),
                ("config.max_concurrency".into(), ProblemCode::Malformed)
            ]
        );
    }

    #[test]
    fn a_validate_request_separates_its_own_problems_from_its_plan_s() {
        let ctx = ValidationContext::default();
        let plan_only =
            br#"{"plan": {"subtasks": [{"id": "a", "timeout": "x", "dependencies": ["zz"]}]}}"#;
        let problems =
            validate_request_problems(Codec::Json, plan_only, &ctx).expect("plan problems");
        assert_eq!(
            codes(&problems),
            vec![
                ("subtasks[0].timeout".into(), ProblemCode::Malformed),
                (
                    "subtasks[0].dependencies[0]".into(),
                    ProblemCode::UnknownDependency
                )
            ]
        );
        for bad in [
            &br#"{"plans": {}}"#[..],
            br#"{"protocol": "one", "plan": {"subtasks": []}}"#,
            br#"{}"#,
            br#"{"plan": 3}"#,
            b"nope",
        ] {
            let own =
                validate_request_problems(Codec::Json, bad, &ctx).expect_err("a malformed request");
            assert!(!own.is_empty());
        }
    }
}
