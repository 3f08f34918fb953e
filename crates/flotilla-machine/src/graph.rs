//! A plan's dependency structure with task ids resolved to indices: dependencies,
//! dependents, topics and their producers and consumers, a stable topological order. Built
//! once per plan and shared by every machine of the run.

use std::collections::{BTreeSet, HashMap};

use flotilla_model::ids::TaskId;
use flotilla_model::plan::{Plan, Strategy};

/// The dependency structure of a plan, with task ids resolved to indices.
#[derive(Debug)]
pub struct RunGraph {
    pub(crate) deps: Vec<Vec<u32>>,
    pub(crate) dependents: Vec<Vec<u32>>,
    pub(crate) index: HashMap<TaskId, u32>,
    pub(crate) finals: Vec<u32>,
    pub(crate) synthesis: Vec<u32>,
    /// Workspace topics the plan names (normalised), by index.
    pub(crate) topics: Vec<String>,
    pub(crate) topic_index: HashMap<String, u32>,
    /// Per task: topics it consumes, topics it produces.
    pub(crate) consumes: Vec<Vec<u32>>,
    pub(crate) produces: Vec<Vec<u32>>,
    /// Per topic: tasks consuming it, tasks producing it.
    pub(crate) consumers: Vec<Vec<u32>>,
    pub(crate) producers: Vec<Vec<u32>>,
}

impl RunGraph {
    /// Builds the graph of a validated plan. Under the `simple` strategy every task also
    /// depends on the one before it in a stable topological order, so tasks run one by one.
    pub fn new(plan: &Plan) -> Self {
        let n = plan.subtasks.len();
        let index: HashMap<TaskId, u32> = plan
            .subtasks
            .iter()
            .enumerate()
            .map(|(i, t)| (t.id.clone(), i as u32))
            .collect();
        let mut deps: Vec<Vec<u32>> = plan
            .subtasks
            .iter()
            .map(|t| {
                let mut d: Vec<u32> = t
                    .dependencies
                    .iter()
                    .filter_map(|id| index.get(id).copied())
                    .collect();
                d.sort_unstable();
                d.dedup();
                d
            })
            .collect();
        let mut declared_dependents = vec![0u32; n];
        for d in deps.iter().flatten() {
            declared_dependents[*d as usize] += 1;
        }
        if plan.config.strategy == Strategy::Simple {
            let order = stable_topological_order(&deps);
            for w in order.windows(2) {
                let (before, after) = (w[0], w[1]);
                if !deps[after as usize].contains(&before) {
                    deps[after as usize].push(before);
                }
            }
        }
        let mut dependents = vec![Vec::new(); n];
        for (i, ds) in deps.iter().enumerate() {
            for &d in ds {
                dependents[d as usize].push(i as u32);
            }
        }
        let synthesis: Vec<u32> = plan
            .subtasks
            .iter()
            .enumerate()
            .filter(|(_, t)| t.role.as_deref() == Some("synthesis"))
            .map(|(i, _)| i as u32)
            .collect();
        let finals = if synthesis.is_empty() {
            (0..n as u32)
                .filter(|&i| declared_dependents[i as usize] == 0)
                .collect()
        } else {
            synthesis.clone()
        };
        let mut topics: Vec<String> = Vec::new();
        let mut topic_index: HashMap<String, u32> = HashMap::new();
        let mut intern = |t: &str| -> u32 {
            if let Some(&i) = topic_index.get(t) {
                return i;
            }
            let i = topics.len() as u32;
            topics.push(t.to_owned());
            topic_index.insert(t.to_owned(), i);
            i
        };
        let mut consumes = Vec::with_capacity(n);
        let mut produces = Vec::with_capacity(n);
        for t in &plan.subtasks {
            let mut c: Vec<u32> = t.consumes.iter().map(|x| intern(x)).collect();
            let mut p: Vec<u32> = t.produces.iter().map(|x| intern(x)).collect();
            c.sort_unstable();
            c.dedup();
            p.sort_unstable();
            p.dedup();
            consumes.push(c);
            produces.push(p);
        }
        let mut consumers = vec![Vec::new(); topics.len()];
        let mut producers = vec![Vec::new(); topics.len()];
        for i in 0..n {
            for &t in &consumes[i] {
                consumers[t as usize].push(i as u32);
            }
            for &t in &produces[i] {
                producers[t as usize].push(i as u32);
            }
        }
        Self {
            deps,
            dependents,
            index,
            finals,
            synthesis,
            topics,
            topic_index,
            consumes,
            produces,
            consumers,
            producers,
        }
    }

    /// Index of a (normalised) topic the plan names.
    pub fn topic_of(&self, topic: &str) -> Option<u32> {
        self.topic_index.get(topic).copied()
    }

    /// A topic's name.
    pub fn topic_name(&self, topic: u32) -> &str {
        &self.topics[topic as usize]
    }

    /// Topics a task consumes.
    pub fn consumes(&self, task: u32) -> &[u32] {
        &self.consumes[task as usize]
    }

    /// Topics a task produces.
    pub fn produces(&self, task: u32) -> &[u32] {
        &self.produces[task as usize]
    }

    /// Number of tasks.
    pub fn len(&self) -> usize {
        self.deps.len()
    }

    /// Whether the plan has no tasks.
    pub fn is_empty(&self) -> bool {
        self.deps.is_empty()
    }

    /// Index of a task id.
    pub fn index_of(&self, id: &TaskId) -> Option<u32> {
        self.index.get(id).copied()
    }

    /// Direct dependencies of a task.
    pub fn deps(&self, task: u32) -> &[u32] {
        &self.deps[task as usize]
    }

    /// Every task `task` transitively depends on, nearest first.
    pub fn ancestors(&self, task: u32) -> Vec<u32> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        let mut frontier: Vec<u32> = self.deps[task as usize].clone();
        while !frontier.is_empty() {
            let mut next = Vec::new();
            for d in frontier {
                if seen.insert(d) {
                    out.push(d);
                    next.extend(self.deps[d as usize].iter().copied());
                }
            }
            frontier = next;
        }
        out
    }

    /// Tasks whose results form the final result: the `synthesis` tasks, else the sinks.
    pub fn finals(&self) -> &[u32] {
        &self.finals
    }

    /// Whether the plan designates a synthesis task.
    pub fn has_synthesis(&self) -> bool {
        !self.synthesis.is_empty()
    }
}

/// Kahn's algorithm, always taking the lowest ready index: plan order where the DAG allows.
fn stable_topological_order(deps: &[Vec<u32>]) -> Vec<u32> {
    let n = deps.len();
    let mut remaining: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut dependents = vec![Vec::new(); n];
    for (i, ds) in deps.iter().enumerate() {
        for &d in ds {
            dependents[d as usize].push(i as u32);
        }
    }
    let mut ready: BTreeSet<u32> = (0..n as u32)
        .filter(|&i| remaining[i as usize] == 0)
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop_first() {
        order.push(i);
        for &t in &dependents[i as usize] {
            remaining[t as usize] -= 1;
            if remaining[t as usize] == 0 {
                ready.insert(t);
            }
        }
    }
    order
}
