//! Data-flow checks: consumed topics without a producer (errors under strict data flow,
//! warnings under lenient), consumers that could only wait for their own output, and tasks
//! that may run at the same time writing one `output_key`.

use std::collections::{BTreeMap, HashMap};

use super::Validator;
use super::graph::Reach;
use crate::plan::{DataflowValidation, Plan};
use crate::problem::{Problem, ProblemCode};
use crate::token::check_token;

impl Validator {
    pub(super) fn check_dataflow(&mut self, plan: &Plan, topics: &[(Vec<String>, Vec<String>)]) {
        let producers: std::collections::HashSet<&str> = topics
            .iter()
            .flat_map(|(p, _)| p.iter().map(String::as_str))
            .collect();
        // topic -> (first path, consumers)
        let mut missing: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
        for (i, task) in plan.subtasks.iter().enumerate() {
            for (j, normal) in topics[i].1.iter().enumerate() {
                if normal.is_empty()
                    || producers.contains(normal.as_str())
                    || check_token(normal).is_err()
                {
                    continue;
                }
                let entry = missing
                    .entry(normal.clone())
                    .or_insert_with(|| (format!("subtasks[{i}].consumes[{j}]"), Vec::new()));
                if !entry.1.iter().any(|c| c == task.id.as_str()) {
                    entry.1.push(task.id.to_string());
                }
            }
        }
        let strict = plan.config.dataflow_validation == DataflowValidation::Strict;
        for (topic, (path, consumers)) in missing {
            let message = format!(
                "topic {topic:?} is consumed by {} but no subtask produces it{}",
                consumers.join(", "),
                if strict {
                    ""
                } else {
                    " (lenient: the consumers wait for an entry from another writer, at most dependency_timeout)"
                }
            );
            let mut p = Problem::new(ProblemCode::MissingProducer, path, message);
            p.topic = Some(topic);
            p.tasks = consumers;
            if strict {
                self.report.errors.push(p);
            } else {
                self.report.warnings.push(p);
            }
        }
    }

    /// A consumer waits for its topic's first entry; if every producer of the topic is the
    /// consumer itself or waits for it, the entry can never come from the plan.
    pub(super) fn check_consumptions(
        &mut self,
        plan: &Plan,
        topics: &[(Vec<String>, Vec<String>)],
        index: &HashMap<&str, usize>,
        reach: &Reach<'_>,
    ) {
        let mut producers: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, (produced, _)) in topics.iter().enumerate() {
            if index.get(plan.subtasks[i].id.as_str()) != Some(&i) {
                continue;
            }
            for t in produced {
                producers.entry(t.as_str()).or_default().push(i);
            }
        }
        let strict = plan.config.dataflow_validation == DataflowValidation::Strict;
        for (c, (_, consumed)) in topics.iter().enumerate() {
            if index.get(plan.subtasks[c].id.as_str()) != Some(&c) {
                continue;
            }
            for (j, t) in consumed.iter().enumerate() {
                let Some(ps) = producers.get(t.as_str()) else {
                    continue;
                };
                // Satisfiable as soon as one producer is neither the consumer nor waits
                // for it.
                let mut stuck = true;
                for &p in ps {
                    match (p == c, reach.depends_on(p, c)) {
                        (true, _) | (false, Some(true)) => {}
                        (false, Some(false)) | (false, None) => {
                            stuck = false;
                            break;
                        }
                    }
                }
                if !stuck {
                    continue;
                }
                let names: Vec<String> = ps
                    .iter()
                    .map(|&p| plan.subtasks[p].id.to_string())
                    .collect();
                let consumer = plan.subtasks[c].id.as_str();
                let mut p = Problem::new(
                    ProblemCode::UnsatisfiableConsumption,
                    format!("subtasks[{c}].consumes[{j}]"),
                    format!(
                        "task {consumer:?} consumes {t:?}, but it is produced only by {} — {} — so the task would wait for its own output{}",
                        names.join(", "),
                        if ps.len() == 1 && ps[0] == c {
                            "the task itself"
                        } else {
                            "the task or tasks that depend on it"
                        },
                        if strict {
                            ""
                        } else {
                            " (lenient: it waits for another writer, at most dependency_timeout)"
                        }
                    ),
                );
                p.topic = Some(t.clone());
                p.tasks = std::iter::once(consumer.to_owned()).chain(names).collect();
                if strict {
                    self.report.errors.push(p);
                } else {
                    self.report.warnings.push(p);
                }
            }
        }
    }

    /// Two tasks writing one `output_key` are fine when one runs after the other (the later
    /// write wins, by design); when they may run at the same time, which wins is a race.
    pub(super) fn check_output_keys(
        &mut self,
        plan: &Plan,
        index: &HashMap<&str, usize>,
        reach: &Reach<'_>,
    ) {
        let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, t) in plan.subtasks.iter().enumerate() {
            if let Some(k) = &t.output_key
                && index.get(t.id.as_str()) == Some(&i)
            {
                by_key.entry(k.as_str()).or_default().push(i);
            }
        }
        for (key, tasks) in by_key {
            'pairs: for (x, &a) in tasks.iter().enumerate() {
                for &b in &tasks[x + 1..] {
                    let ordered = reach.depends_on(a, b).unwrap_or(true)
                        || reach.depends_on(b, a).unwrap_or(true);
                    if !ordered {
                        let (na, nb) = (plan.subtasks[a].id.as_str(), plan.subtasks[b].id.as_str());
                        let mut p = Problem::new(
                            ProblemCode::SharedOutputKey,
                            format!("subtasks[{b}].output_key"),
                            format!(
                                "tasks {na:?} and {nb:?} may run at the same time and both write output_key {key:?}; give parallel branches distinct keys"
                            ),
                        );
                        p.tasks = vec![na.to_owned(), nb.to_owned()];
                        self.report.warnings.push(p);
                        break 'pairs;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Subtask;
    use crate::validate::tests::{codes, plan};
    use crate::validate::{ValidationContext, prepare_plan, validate_plan};

    #[test]
    fn lenient_dataflow_warns_and_keeps_the_gate() {
        let mut t = Subtask::new("t", "");
        t.consumes = vec!["Ghost Topic".into(), "ghost topic".into()];
        let mut p = plan(vec![t]);
        p.config.dataflow_validation = DataflowValidation::Lenient;
        let (ready, warnings) =
            prepare_plan(&p, &ValidationContext::default()).expect("lenient ok");
        assert_eq!(warnings[0].code, ProblemCode::MissingProducer);
        // Another writer (an agent, the CLI) may still provide the entry.
        assert_eq!(ready.subtasks[0].consumes, vec!["ghost_topic".to_string()]);
    }

    #[test]
    fn parallel_tasks_sharing_an_output_key_are_warned_about() {
        let with_key = |id: &str, deps: &[&str]| {
            let mut t = Subtask::new(id, "").after(deps);
            t.output_key = Some("summary".into());
            t
        };
        // a → b in sequence: the later write wins by design. c runs beside both.
        let p = plan(vec![
            with_key("a", &[]),
            with_key("b", &["a"]),
            Subtask::new("x", ""),
            with_key("c", &["x"]),
        ]);
        let r = validate_plan(&p, &ValidationContext::default());
        assert!(r.is_valid(), "{r:#?}");
        let shared: Vec<_> = r
            .warnings
            .iter()
            .filter(|w| w.code == ProblemCode::SharedOutputKey)
            .collect();
        assert_eq!(shared.len(), 1, "{r:#?}");
        assert_eq!(shared[0].tasks, vec!["a".to_string(), "c".to_string()]);
        let sequential = plan(vec![with_key("a", &[]), with_key("b", &["a"])]);
        let r = validate_plan(&sequential, &ValidationContext::default());
        assert!(r.warnings.is_empty(), "{r:#?}");
    }

    #[test]
    fn a_task_cannot_wait_for_its_own_output() {
        let mut own = Subtask::new("own", "");
        own.produces = vec!["draft".into()];
        own.consumes = vec!["draft".into()];
        // `first` consumes a topic only its dependent produces.
        let mut first = Subtask::new("first", "");
        first.consumes = vec!["later".into()];
        let mut second = Subtask::new("second", "").after(&["first"]);
        second.produces = vec!["later".into()];
        // Fine: the producer does not wait for the consumer.
        let mut fetch = Subtask::new("fetch", "");
        fetch.produces = vec!["figures".into()];
        let mut growth = Subtask::new("growth", "");
        growth.consumes = vec!["figures".into()];
        let p = plan(vec![own, first, second, fetch, growth]);
        let r = validate_plan(&p, &ValidationContext::default());
        assert_eq!(
            codes(&r),
            vec![
                ProblemCode::UnsatisfiableConsumption,
                ProblemCode::UnsatisfiableConsumption
            ],
            "{r:#?}"
        );
        assert_eq!(
            r.errors[0].tasks,
            vec!["own".to_string(), "own".to_string()]
        );
        assert_eq!(
            r.errors[1].tasks,
            vec!["first".to_string(), "second".to_string()]
        );
        let mut lenient = p.clone();
        lenient.config.dataflow_validation = DataflowValidation::Lenient;
        let r = validate_plan(&lenient, &ValidationContext::default());
        assert!(r.is_valid(), "{r:#?}");
        assert_eq!(r.warnings.len(), 2);
    }
}
