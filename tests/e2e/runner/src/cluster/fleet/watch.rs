//! The fleet sampled about once a second while a case disturbs it (one API call, then half a
//! second's sleep): for each node, whether a plugin pod serves it and what it offers. The
//! samples show what a user polling the API would have seen, between the case's own checks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};

use crate::cluster::Kube;
use crate::cluster::kube::Object;
use crate::node::RESOURCE;
use crate::stats::median;

const PAUSE: Duration = Duration::from_millis(500);

/// A node in one sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeState {
    /// A plugin pod on the node is Ready and not terminating.
    pub serving: bool,
    /// The node's allocatable EFAs as the API writes them; `None` when it lists none.
    pub allocatable: Option<String>,
}

/// The fleet at one moment, `at` from the start of the watch.
#[derive(Clone, Debug)]
pub struct Sample {
    pub at: Duration,
    pub nodes: BTreeMap<String, NodeState>,
}

/// A node missing from a sample: neither served nor offering anything.
const ABSENT: NodeState = NodeState {
    serving: false,
    allocatable: None,
};

impl Sample {
    fn of(&self, node: &str) -> &NodeState {
        self.nodes.get(node).unwrap_or(&ABSENT)
    }
}

/// Runs `body` while the fleet is sampled; the samples are taken until `body` returns. A
/// sample the API did not answer is left out.
pub fn watching<T>(kube: &Kube, body: impl FnOnce() -> T) -> (T, Vec<Sample>) {
    watching_every(kube, PAUSE, body)
}

/// [`watching`], with `pause` between one sample's answer and the next sample.
pub fn watching_every<T>(
    kube: &Kube,
    pause: Duration,
    body: impl FnOnce() -> T,
) -> (T, Vec<Sample>) {
    let done = AtomicBool::new(false);
    thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let start = Instant::now();
            let mut samples = Vec::new();
            while !done.load(Ordering::Relaxed) {
                if let Ok(objects) = kube.nodes_and_plugin_pods() {
                    samples.push(sample(start.elapsed(), objects));
                }
                thread::sleep(pause);
            }
            samples
        });
        let outcome = body();
        done.store(true, Ordering::Relaxed);
        // A sampler that panicked leaves no samples, which every check below refuses.
        (outcome, sampler.join().unwrap_or_default())
    })
}

fn sample(at: Duration, objects: Vec<Object>) -> Sample {
    let mut served = Vec::new();
    let mut nodes = Vec::new();
    for object in objects {
        match object {
            Object::Pod(pod) if pod.serves() => served.push(pod.spec.node_name),
            Object::Pod(_) => {}
            Object::Node(node) => nodes.push(node),
        }
    }
    let nodes = nodes
        .into_iter()
        .map(|mut node| {
            let state = NodeState {
                serving: served.contains(&node.metadata.name),
                allocatable: node.status.allocatable.remove(RESOURCE),
            };
            (node.metadata.name, state)
        })
        .collect();
    Sample { at, nodes }
}

/// Whether `allocatable` is what a node with `count` EFAs offers: none or 0 without EFA.
fn offers(allocatable: Option<&str>, count: u64) -> bool {
    match allocatable {
        None => count == 0,
        Some(value) => value == count.to_string(),
    }
}

fn want_text(count: u64) -> String {
    if count == 0 {
        "none".to_owned()
    } else {
        count.to_string()
    }
}

/// A rollout across `want` (each node and its count): no sample has two of the nodes without a
/// serving plugin, and each node, having been without one, offers its count within `bound` of
/// being served again and at the end. Gives each node's time without a plugin (from its first
/// sample without one to its first with one again), their median and maximum.
pub fn rollout(samples: &[Sample], want: &[(&str, u64)], bound: Duration) -> Result<String> {
    let Some(first) = samples.first() else {
        bail!("no samples");
    };
    for sample in samples {
        let down: Vec<&str> = want
            .iter()
            .map(|(node, _)| *node)
            .filter(|node| !sample.of(node).serving)
            .collect();
        if down.len() > 1 {
            bail!(
                "at {:.0}s {} nodes had no Ready plugin: {}",
                (sample.at - first.at).as_secs_f64(),
                down.len(),
                down.join(" ")
            );
        }
    }
    let mut downtimes = Vec::new();
    for &(node, count) in want {
        let (mut went, mut back) = (None, None);
        for sample in samples {
            let state = sample.of(node);
            if !state.serving && went.is_none() {
                went = Some(sample.at);
            } else if state.serving && went.is_some() && back.is_none() {
                back = Some(sample.at);
            }
            if let Some(back) = back {
                let since = sample.at - back;
                if !offers(state.allocatable.as_deref(), count) && since > bound {
                    bail!(
                        "{node}: allocatable {} {:.0}s after its plugin was Ready again, want {} within {:.0}s",
                        state.allocatable.as_deref().unwrap_or("-"),
                        since.as_secs_f64(),
                        want_text(count),
                        bound.as_secs_f64()
                    );
                }
            }
        }
        let (Some(went), Some(back)) = (went, back) else {
            let never = if went.is_none() {
                "never left"
            } else {
                "never came back"
            };
            bail!("{node}: its plugin {never}");
        };
        let last = samples.last().unwrap_or(first).of(node);
        if !offers(last.allocatable.as_deref(), count) {
            bail!(
                "{node}: allocatable {} at the end, want {}",
                last.allocatable.as_deref().unwrap_or("-"),
                want_text(count)
            );
        }
        downtimes.push((node, (back - went).as_secs_f64()));
    }
    let each: Vec<String> = downtimes
        .iter()
        .map(|(node, seconds)| format!("{node} {seconds:.0}s"))
        .collect();
    let mut times: Vec<f64> = downtimes.iter().map(|(_, seconds)| *seconds).collect();
    times.sort_by(f64::total_cmp);
    Ok(format!(
        "without a plugin: {} (median {:.0}s, max {:.0}s); never 2 nodes at once; {} samples",
        each.join(", "),
        median(&times),
        times.last().copied().unwrap_or_default(),
        samples.len()
    ))
}

/// Whether `node` offered `count` in every sample: how many there were, or the values it had
/// (`absent` for a sample without the node).
pub fn steady(samples: &[Sample], node: &str, count: u64) -> Result<usize> {
    if samples.is_empty() {
        bail!("no samples");
    }
    let want = count.to_string();
    let mut seen: Vec<&str> = samples
        .iter()
        .map(|sample| match sample.nodes.get(node) {
            None => "absent",
            Some(state) => state.allocatable.as_deref().unwrap_or("-"),
        })
        .collect();
    seen.sort_unstable();
    seen.dedup();
    if seen != [want.as_str()] {
        bail!("{}", seen.join(" "));
    }
    Ok(samples.len())
}

/// Whether `node` offers `count` in every sample taken over `span`: how many there were, or the
/// values it had.
pub fn allocatable_stays(kube: &Kube, node: &str, count: u64, span: Duration) -> Result<usize> {
    let ((), samples) = watching(kube, || thread::sleep(span));
    steady(&samples, node, count).map_err(|seen| {
        anyhow!(
            "{node} offered {seen} over {}s, want {count} throughout",
            span.as_secs()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample at `at` seconds: each node's `(serving, allocatable)`, `""` for none.
    fn at(at: u64, nodes: &[(&str, bool, &str)]) -> Sample {
        Sample {
            at: Duration::from_secs(at),
            nodes: nodes
                .iter()
                .map(|(node, serving, allocatable)| {
                    let state = NodeState {
                        serving: *serving,
                        allocatable: (!allocatable.is_empty()).then(|| allocatable.to_string()),
                    };
                    (node.to_string(), state)
                })
                .collect(),
        }
    }

    const WANT: [(&str, u64); 2] = [("a", 4), ("p", 0)];
    const BOUND: Duration = Duration::from_secs(40);

    #[test]
    fn a_rollout_one_node_at_a_time_gives_each_nodes_time_without_a_plugin() {
        let samples = [
            at(0, &[("a", true, "4"), ("p", true, "")]),
            at(1, &[("a", false, "4"), ("p", true, "")]),
            at(3, &[("a", true, "4"), ("p", true, "")]),
            at(4, &[("a", true, "4"), ("p", false, "0")]),
            at(5, &[("a", true, "4"), ("p", true, "0")]),
        ];
        assert_eq!(
            rollout(&samples, &WANT, BOUND).unwrap(),
            "without a plugin: a 2s, p 1s (median 2s, max 2s); never 2 nodes at once; 5 samples"
        );
    }

    #[test]
    fn a_rollout_fails_on_two_nodes_down_a_node_never_left_or_allocatable_late() {
        let cases = [
            (
                vec![
                    at(0, &[("a", true, "4"), ("p", true, "")]),
                    at(2, &[("a", false, "4")]),
                ],
                "at 2s 2 nodes had no Ready plugin: a p",
            ),
            (
                vec![
                    at(0, &[("a", true, "4"), ("p", false, "")]),
                    at(1, &[("a", true, "4"), ("p", true, "")]),
                ],
                "a: its plugin never left",
            ),
            (
                vec![
                    at(0, &[("a", false, ""), ("p", true, "")]),
                    at(1, &[("a", true, "3"), ("p", true, "")]),
                    at(50, &[("a", true, "3"), ("p", true, "")]),
                ],
                "a: allocatable 3 49s after its plugin was Ready again, want 4 within 40s",
            ),
        ];
        for (samples, want) in cases {
            let err = rollout(&samples, &WANT, BOUND).unwrap_err();
            assert_eq!(err.to_string(), want);
        }
    }

    #[test]
    fn steady_counts_the_samples_or_names_every_value_seen() {
        let kept = [at(0, &[("b", true, "16")]), at(1, &[("b", false, "16")])];
        assert_eq!(steady(&kept, "b", 16).unwrap(), 2);
        let moved = [
            at(0, &[("b", true, "16")]),
            at(1, &[("b", true, "")]),
            at(2, &[]),
        ];
        assert_eq!(
            steady(&moved, "b", 16).unwrap_err().to_string(),
            "- 16 absent"
        );
        assert_eq!(steady(&[], "b", 16).unwrap_err().to_string(), "no samples");
    }
}
