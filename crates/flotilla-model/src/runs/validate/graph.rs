//! The dependency graph: cycles (Kahn's algorithm, each cycle named by its tasks) and
//! reachability between tasks of an acyclic plan, both linear in tasks plus edges for the
//! common case.

use std::collections::HashMap;

/// Reachability over an acyclic dependency graph, answered cheaply for the common case: a
/// topological position per task (a task's descendants always come after it), and a
/// bounded number of graph walks for the rest, so validating a 10,000-task plan stays fast.
pub(super) struct Reach<'a> {
    deps: &'a [Vec<usize>],
    dependents: Vec<Vec<usize>>,
    position: Vec<usize>,
    walks_left: std::cell::Cell<usize>,
}

/// Graph walks one validation may spend on reachability questions; past it the questions
/// are not asked (the run-time deadline still bounds what they would have caught).
const MAX_REACH_WALKS: usize = 256;

impl<'a> Reach<'a> {
    pub(super) fn new(deps: &'a [Vec<usize>]) -> Self {
        let n = deps.len();
        let mut dependents = vec![Vec::new(); n];
        let mut left: Vec<usize> = deps.iter().map(Vec::len).collect();
        for (i, ds) in deps.iter().enumerate() {
            for &d in ds {
                dependents[d].push(i);
            }
        }
        let mut queue: Vec<usize> = (0..n).filter(|&i| left[i] == 0).collect();
        let mut position = vec![usize::MAX; n];
        let mut next = 0;
        while let Some(i) = queue.pop() {
            position[i] = next;
            next += 1;
            for &t in &dependents[i] {
                left[t] -= 1;
                if left[t] == 0 {
                    queue.push(t);
                }
            }
        }
        Self {
            deps,
            dependents,
            position,
            walks_left: std::cell::Cell::new(MAX_REACH_WALKS),
        }
    }

    /// Whether `later` (transitively) depends on `earlier`. `None`: not answered (the walk
    /// budget is spent).
    pub(super) fn depends_on(&self, later: usize, earlier: usize) -> Option<bool> {
        if later == earlier || self.position[later] <= self.position[earlier] {
            return Some(false);
        }
        if self.deps[later].contains(&earlier) {
            return Some(true);
        }
        let left = self.walks_left.get();
        if left == 0 {
            return None;
        }
        self.walks_left.set(left - 1);
        // Walk down from `earlier`, never past `later`'s position.
        let limit = self.position[later];
        let mut seen = vec![false; self.deps.len()];
        let mut stack = vec![earlier];
        while let Some(i) = stack.pop() {
            for &d in &self.dependents[i] {
                if d == later {
                    return Some(true);
                }
                if !seen[d] && self.position[d] < limit {
                    seen[d] = true;
                    stack.push(d);
                }
            }
        }
        Some(false)
    }
}

/// Finds dependency cycles. `deps[i]` lists the tasks `i` depends on. Returns one cycle per
/// group of tasks that cannot be ordered, each as the task indices in dependency order.
pub(super) fn find_cycles(deps: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = deps.len();
    // Kahn: a task is resolved when all its dependencies are.
    let mut unresolved: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, ds) in deps.iter().enumerate() {
        for &d in ds {
            dependents[d].push(i);
        }
    }
    let mut queue: Vec<usize> = (0..n).filter(|&i| unresolved[i] == 0).collect();
    while let Some(d) = queue.pop() {
        for &t in &dependents[d] {
            unresolved[t] -= 1;
            if unresolved[t] == 0 {
                queue.push(t);
            }
        }
    }
    // Every task left over has an unresolved dependency that is also left over, so following
    // such dependencies must revisit a task: that revisit closes a cycle.
    let mut cycles = Vec::new();
    let mut walked = vec![false; n];
    for start in 0..n {
        if unresolved[start] == 0 || walked[start] {
            continue;
        }
        let mut path: Vec<usize> = Vec::new();
        let mut pos_in_path: HashMap<usize, usize> = HashMap::new();
        let mut at = start;
        loop {
            if let Some(&p) = pos_in_path.get(&at) {
                cycles.push(path[p..].to_vec());
                break;
            }
            if walked[at] {
                break;
            }
            walked[at] = true;
            pos_in_path.insert(at, path.len());
            path.push(at);
            match deps[at].iter().find(|&&d| unresolved[d] > 0) {
                Some(&next) => at = next,
                None => break,
            }
        }
    }
    cycles
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use crate::plan::{Plan, Subtask};
    use crate::problem::ProblemCode;
    use crate::validate::tests::{codes, plan};
    use crate::validate::{ValidationContext, validate_plan};

    #[test]
    fn cycle_names_its_tasks() {
        let p = plan(vec![
            Subtask::new("a", "").after(&["b"]),
            Subtask::new("b", "").after(&["a"]),
            Subtask::new("c", "").after(&["a"]),
        ]);
        let r = validate_plan(&p, &ValidationContext::default());
        assert_eq!(codes(&r), vec![ProblemCode::Cycle]);
        assert_eq!(r.errors[0].tasks, vec!["a".to_string(), "b".to_string()]);
        assert!(
            r.errors[0].message.contains("a → b → a"),
            "{}",
            r.errors[0].message
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::{any, prop_assert, prop_assume, proptest};
        use proptest::strategy::Strategy as _;

        /// A random DAG: task i may depend only on tasks with a smaller index.
        fn dag() -> impl proptest::strategy::Strategy<Value = Vec<Vec<usize>>> {
            (1usize..40).prop_flat_map(|n| {
                (0..n)
                    .map(|i| proptest::collection::btree_set(0..i.max(1), 0..=i.min(4)))
                    .collect::<Vec<_>>()
                    .prop_map(move |sets| {
                        sets.into_iter()
                            .enumerate()
                            .map(|(i, s)| s.into_iter().filter(|&d| d < i).collect())
                            .collect()
                    })
            })
        }

        fn to_plan(deps: &[Vec<usize>]) -> Plan {
            let names: Vec<String> = (0..deps.len()).map(|i| format!("t{i}")).collect();
            plan(
                deps.iter()
                    .enumerate()
                    .map(|(i, ds)| {
                        let refs: Vec<&str> = ds.iter().map(|&d| names[d].as_str()).collect();
                        Subtask::new(&names[i], "").after(&refs)
                    })
                    .collect(),
            )
        }

        fn reachable(deps: &[Vec<usize>], from: usize) -> BTreeSet<usize> {
            let mut seen = BTreeSet::new();
            let mut stack = vec![from];
            while let Some(x) = stack.pop() {
                for &d in &deps[x] {
                    if seen.insert(d) {
                        stack.push(d);
                    }
                }
            }
            seen
        }

        proptest! {
            #[test]
            fn random_dags_validate(deps in dag()) {
                let r = validate_plan(&to_plan(&deps), &ValidationContext::default());
                prop_assert!(r.is_valid(), "{:?}", r);
            }

            #[test]
            fn a_back_edge_is_always_caught(deps in dag(), pick in any::<proptest::sample::Index>()) {
                // Choose a task with at least one ancestor and make an ancestor depend on it.
                let candidates: Vec<(usize, usize)> = (0..deps.len())
                    .flat_map(|i| reachable(&deps, i).into_iter().map(move |a| (i, a)))
                    .collect();
                prop_assume!(!candidates.is_empty());
                let (task, ancestor) = candidates[pick.index(candidates.len())];
                let mut with_back = deps.clone();
                with_back[ancestor].push(task);
                let r = validate_plan(&to_plan(&with_back), &ValidationContext::default());
                prop_assert!(r.has(ProblemCode::Cycle), "{:?}", r);
                // The reported cycle really is one: each task depends on the next.
                for p in r.errors.iter().filter(|p| p.code == ProblemCode::Cycle) {
                    let idx: Vec<usize> = p.tasks.iter().map(|t| t[1..].parse().unwrap()).collect();
                    for w in 0..idx.len() {
                        let next = idx[(w + 1) % idx.len()];
                        prop_assert!(with_back[idx[w]].contains(&next));
                    }
                }
            }
        }
    }
}
