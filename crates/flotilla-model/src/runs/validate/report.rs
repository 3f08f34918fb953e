//! The outcome of validation: a report of errors and warnings, and problem lists kept short
//! enough that a rejection always fits in a message.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::problem::{Problem, ProblemCode};

/// The outcome of validation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ValidationReport {
    /// Problems that make the plan unrunnable.
    pub errors: Vec<Problem>,
    /// Problems that were tolerated.
    pub warnings: Vec<Problem>,
}

impl ValidationReport {
    /// True when there are no errors.
    pub fn is_valid(&self) -> bool {
        self.errors.is_empty()
    }

    /// A report holding a single error.
    pub fn single(problem: Problem) -> Self {
        Self {
            errors: vec![problem],
            warnings: Vec::new(),
        }
    }

    /// Whether any error carries `code`.
    pub fn has(&self, code: ProblemCode) -> bool {
        self.errors.iter().any(|p| p.code == code)
    }
}

/// Most problems carried in a rejection; the rest are counted in one `too_many_problems`
/// entry, so a rejection always fits in a message.
pub const MAX_REPORTED_PROBLEMS: usize = 100;

/// Keeps at most `max` problems; when more were found, the last kept entry is a
/// `too_many_problems` problem counting the rest. Rejections stay bounded however broken the
/// plan is.
pub fn truncate_problems(mut problems: Vec<Problem>, max: usize) -> Vec<Problem> {
    if problems.len() <= max {
        return problems;
    }
    let keep = max.saturating_sub(1);
    let omitted = problems.len() - keep;
    problems.truncate(keep);
    problems.push(Problem::new(
        ProblemCode::TooManyProblems,
        "",
        format!("{omitted} more problems are not listed; fix the ones above and validate again"),
    ));
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_lists_are_truncated_with_a_count() {
        let problems: Vec<Problem> = (0..250)
            .map(|i| Problem::new(ProblemCode::DuplicateId, format!("subtasks[{i}]"), "dup"))
            .collect();
        let kept = truncate_problems(problems, MAX_REPORTED_PROBLEMS);
        assert_eq!(kept.len(), MAX_REPORTED_PROBLEMS);
        let last = kept.last().expect("a summary");
        assert_eq!(last.code, ProblemCode::TooManyProblems);
        assert!(last.message.starts_with("151 more"), "{}", last.message);
        let few = truncate_problems(vec![Problem::new(ProblemCode::Cycle, "", "c")], 5);
        assert_eq!(few.len(), 1);
    }
}
