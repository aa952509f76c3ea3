//! (S2) The admission burst. Kubernetes PR #137534 (fixed in 1.38): a PodResources `List` that
//! runs while an `Allocate` is in flight, and finds a pod that has just ended, rebuilds the
//! kubelet's allocated set without the EFAs being given out; the next admission may then get
//! the same EFAs. The burst makes that as likely as the fleet can: pods of 1 EFA each,
//! short-lived, admitted many at once as others end, and each kubelet's `List` called
//! [`RATE`] times a second beside the plugin's own poll. It samples the ground truth throughout
//! and holds the detector to it: every double booking the ground truth sees for at least two
//! of the plugin's polls must be one the plugin warned of. A double booking itself is the
//! kubelet's: reported, not failed.
//!
//! `EFA_DP_BURST_PODS` sets the pods in all (default 60); `EFA_DP_SOAK_SEED` the seed of their
//! lifetimes (default 27).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;
use serde_json::{Value, json};

use super::report::{Report, commit, setting};
use super::seeded::Seeded;
use super::soak::{CHART, NODES};
use super::truth::{self, Finding};
use super::{fleet_chart, fleet_node};
use crate::cases::Detail;
use crate::cluster::pod_resources::list_repeatedly;
use crate::cluster::workload::{labelled, pod_sleeping};
use crate::cluster::{Cluster, Kube};
use crate::node::RESOURCE;

const LABEL: (&str, &str) = ("burst", "1");
/// Pods asked for beyond the fleet's EFAs, so that admissions queue as pods end.
const QUEUE: u64 = 10;
const LIFE_MIN: u32 = 3;
const LIFE_MAX: u32 = 20;
/// The kubelet serves 100 `List`s a second in all; the rest is the plugin's poll's.
const RATE: u32 = 80;
/// The plugin's poll, `values-e2e.yaml`'s rescan interval: it warns of a double booking that
/// two answers in a row show.
const POLL: Duration = Duration::from_secs(5);
/// Each `GetPreferredAllocation` offer and answer logged, to see the kubelet offer an ID again.
const LOG_LEVEL: &str = r"config.log-level=info\,efa_device_plugin::allocation=debug";
/// An ID offered again this soon after an answer chose it was lost by the kubelet.
const REOFFER_WITHIN: f64 = 1.0;
const ALLOC_DURATION: &str = "kubelet_device_plugin_alloc_duration_seconds";

/// (S2) The admission burst.
pub fn burst(cluster: &mut Cluster) -> Result<Detail> {
    let pods = setting("EFA_DP_BURST_PODS", 60)?;
    let seed = setting("EFA_DP_SOAK_SEED", 27)?;
    let mut args = CHART.to_vec();
    args.extend(["--set-string", LOG_LEVEL]);
    fleet_chart(cluster, &args)?;
    let views = truth::views(cluster, &NODES)?;
    let fleet_efas = NODES
        .iter()
        .map(|node| fleet_node(node).map(|node| node.efas))
        .sum::<Result<u64>>()?;
    let mut report = Report::create(cluster, "burst-report.txt")?;
    let before = allocate_calls(&cluster.kube);
    let since = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let mut draws = Seeded::new(seed);
    let (mut made, mut failed, mut samples, mut live) = (0, 0, 0, 0);
    let mut seen: Vec<(f64, Finding)> = Vec::new();
    let lists: Vec<String> = thread::scope(|scope| {
        let hammers: Vec<_> = views
            .iter()
            .map(|view| {
                let stop = &stop;
                scope.spawn(move || list_repeatedly(&view.pod_resources, RATE, stop))
            })
            .collect();
        let kube = &cluster.kube;
        let deadline = Duration::from_secs(u64::from(pods) * 3 + 60);
        while start.elapsed() < deadline {
            // A round the API did not answer is skipped: no pods seen is not no pods alive.
            let Ok(burst_pods) = kube.pods_labelled(&selector()) else {
                thread::sleep(Duration::from_millis(500));
                continue;
            };
            live = 0;
            let mut ended = Vec::new();
            for pod in burst_pods {
                match pod.status.phase.as_str() {
                    "Pending" | "Running" => live += 1,
                    "Succeeded" => ended.push(pod.metadata.name),
                    "Failed" => {
                        failed += 1;
                        report.violation(
                            "burst",
                            &format!(
                                "burst pod {} failed on {}: {}: {}",
                                pod.metadata.name,
                                pod.spec.node_name,
                                pod.status.reason,
                                pod.status.message
                            ),
                        );
                        ended.push(pod.metadata.name);
                    }
                    _ => {}
                }
            }
            if !ended.is_empty() {
                let mut delete = vec!["delete", "pods", "-n", "default", "--wait=false"];
                delete.extend(ended.iter().map(String::as_str));
                let _ = kube.run(&delete);
            }
            if live == 0 && made == pods {
                break;
            }
            let want = (fleet_efas + QUEUE).saturating_sub(live);
            let mut batch = Vec::new();
            while (batch.len() as u64) < want && made < pods {
                made += 1;
                let life = LIFE_MIN + draws.below(LIFE_MAX - LIFE_MIN + 1);
                let pod = pod_sleeping(&format!("burst-{made}"), 1, "Never", u64::from(life));
                batch.push(labelled(pod, LABEL.0, LABEL.1));
            }
            if !batch.is_empty()
                && let Err(err) =
                    kube.apply(&json!({"apiVersion": "v1", "kind": "List", "items": batch}))
            {
                report.violation(
                    "burst",
                    &format!("burst pods up to burst-{made} not accepted: {err:#}"),
                );
            }
            let at = start.elapsed().as_secs_f64();
            let pods_now = kube.pods().unwrap_or_default();
            seen.extend(
                truth::read(&views, &pods_now)
                    .findings
                    .into_iter()
                    .filter(|finding| matches!(finding, Finding::Double { .. }))
                    .map(|finding| (at, finding)),
            );
            samples += 1;
        }
        stop.store(true, Ordering::Relaxed);
        hammers
            .into_iter()
            .map(|hammer| match hammer.join() {
                Ok(Ok((lists, failed))) => format!("lists {lists} failed {failed}"),
                Ok(Err(err)) => format!("lists none: {err:#}"),
                Err(_) => "lists unknown: the caller panicked".to_owned(),
            })
            .collect()
    });
    let took = start.elapsed().as_secs();
    if live != 0 {
        report.violation(
            "burst",
            &format!("{live} burst pods still alive after {took}s"),
        );
    }
    let kube = &cluster.kube;
    let _ = kube.run(&[
        "delete",
        "pods",
        "-n",
        "default",
        "-l",
        &selector(),
        "--wait=false",
    ]);
    let after = allocate_calls(kube);
    let mut log = String::new();
    for node in NODES {
        match plugin_log(kube, node, &since) {
            Ok(text) => text
                .lines()
                .for_each(|line| log.push_str(&format!("{node} {line}\n"))),
            Err(err) => report.violation(
                "burst",
                &format!("the plugin's log on {node} could not be read: {err:#}"),
            ),
        }
    }
    let _ = fs::write(cluster.run.join("logs/burst-plugin.log"), &log);
    report.note(&format!(
        "burst: seed {seed}, {pods} pods in {took}s, {failed} failed, ground truth sampled {samples} times, Kubernetes {}, commit {}",
        cluster.kube_version,
        commit(cluster)
    ));
    report.note(&format!(
        "List calls beside the plugin's poll, {RATE}/s a kubelet: {}",
        lists.join(";")
    ));
    let verdict = Verdict::of(&seen, &log, 2.0 * POLL.as_secs_f64());
    report.note(&allocate_line(&before, &after));
    report.note(&reoffers(&log));
    for pair in &verdict.pairs {
        if pair.missed {
            report.violation("burst", &format!("the detector did not warn of {pair}"));
        }
        report.note(&pair.to_string());
    }
    for (node, a, b) in &verdict.detector_only {
        report.note(&format!("detector-only {node} {a} {b}"));
    }
    let summary = format!(
        "ground truth {} pairs, detector {} pairs",
        verdict.pairs.len(),
        verdict.warned
    );
    report.note(&summary);
    let last = format!(
        "burst: {pods} pods, {summary}, {} violations",
        report.violations()
    );
    report.verdict(&last)
}

fn selector() -> String {
    format!("{}={}", LABEL.0, LABEL.1)
}

/// The plugin's log on `node` since `since` (RFC 3339).
fn plugin_log(kube: &Kube, node: &str, since: &str) -> Result<String> {
    let pod = kube.serving_plugin(node)?;
    kube.run(&[
        "logs",
        "-n",
        "kube-system",
        &pod.metadata.name,
        &format!("--since-time={since}"),
    ])
}

/// Per node, `(count, sum)` of the kubelet's `Allocate` calls to device plugins for EFAs, from
/// its metrics; a node that did not answer is left out.
fn allocate_calls(kube: &Kube) -> BTreeMap<&'static str, (f64, f64)> {
    NODES
        .iter()
        .filter_map(|node| {
            let metrics = kube
                .run(&[
                    "get",
                    "--raw",
                    &format!("/api/v1/nodes/{node}/proxy/metrics"),
                ])
                .ok()?;
            Some((*node, alloc_histogram(&metrics)))
        })
        .collect()
}

/// `(count, sum)` of the `Allocate` duration histogram's EFA series in a metrics text.
fn alloc_histogram(metrics: &str) -> (f64, f64) {
    let label = format!("resource_name=\"{RESOURCE}\"");
    let value = |suffix: &str| {
        let name = format!("{ALLOC_DURATION}_{suffix}");
        metrics
            .lines()
            .filter(|line| line.starts_with(&name) && line.contains(&label))
            .filter_map(|line| line.split_whitespace().last()?.parse::<f64>().ok())
            .sum()
    };
    (value("count"), value("sum"))
}

fn allocate_line(
    before: &BTreeMap<&'static str, (f64, f64)>,
    after: &BTreeMap<&'static str, (f64, f64)>,
) -> String {
    let (mut count, mut seconds) = (0.0, 0.0);
    for (node, (c, s)) in after {
        let (c0, s0) = before.get(node).copied().unwrap_or_default();
        count += c - c0;
        seconds += s - s0;
    }
    if count > 0.0 {
        format!(
            "{count:.0} Allocate calls, mean {:.2} ms",
            1000.0 * seconds / count
        )
    } else {
        "Allocate calls unknown".to_owned()
    }
}

/// The JSON records of the plugins' logs, each line led by its node.
fn records(log: &str) -> impl Iterator<Item = (&str, Value)> {
    log.lines().filter_map(|line| {
        let (node, text) = line.split_once(' ')?;
        Some((node, serde_json::from_str(text).ok()?))
    })
}

fn field<'a>(record: &'a Value, key: &str) -> BTreeSet<&'a str> {
    record[key]
        .as_str()
        .unwrap_or_default()
        .split(',')
        .filter(|item| !item.is_empty())
        .collect()
}

/// One `GetPreferredAllocation` answer as the plugin logged it: when, the IDs the kubelet
/// offered, the IDs the plugin chose.
struct Answer<'a> {
    at: f64,
    stamp: &'a str,
    offered: BTreeSet<&'a str>,
    chosen: BTreeSet<&'a str>,
}

/// From the plugins' `GetPreferredAllocation` debug lines: how often the kubelet offered an ID
/// again within [`REOFFER_WITHIN`] of an answer choosing it (it takes the answer, so it had just
/// allocated that ID: it lost track of it), and how often the new answer left such IDs out; then
/// each such offer: node, when, the IDs, how long after their choice.
fn reoffers(log: &str) -> String {
    let mut answers: BTreeMap<&str, Vec<Answer>> = BTreeMap::new();
    let records: Vec<(&str, Value)> = records(log).collect();
    for (node, record) in &records {
        if record["message"] != "answered GetPreferredAllocation" {
            continue;
        }
        let stamp = record["timestamp"].as_str().unwrap_or_default();
        let Some(at) = humantime::parse_rfc3339(stamp)
            .ok()
            .and_then(|at| at.duration_since(SystemTime::UNIX_EPOCH).ok())
        else {
            continue;
        };
        answers.entry(node).or_default().push(Answer {
            at: at.as_secs_f64(),
            stamp,
            offered: field(record, "offered"),
            chosen: field(record, "answer"),
        });
    }
    let (mut count, mut steered) = (0, 0);
    let mut again = Vec::new();
    for (node, seq) in &mut answers {
        seq.sort_by(|a, b| a.at.total_cmp(&b.at));
        for (i, answer) in seq.iter().enumerate() {
            count += 1;
            let mut lost = BTreeSet::new();
            // Since the latest answer that chose one of them.
            let mut after = None;
            for before in seq[..i].iter().rev() {
                if answer.at - before.at > REOFFER_WITHIN {
                    break;
                }
                let chosen_again: Vec<&str> = before
                    .chosen
                    .intersection(&answer.offered)
                    .copied()
                    .collect();
                if !chosen_again.is_empty() {
                    after.get_or_insert(answer.at - before.at);
                }
                lost.extend(chosen_again);
            }
            if !lost.is_empty() {
                if lost.is_disjoint(&answer.chosen) {
                    steered += 1;
                }
                again.push(format!(
                    "{node} {} {} {:.0} ms after",
                    answer.stamp,
                    lost.iter().copied().collect::<Vec<_>>().join(","),
                    after.unwrap_or_default() * 1000.0
                ));
            }
        }
    }
    format!(
        "{count} GetPreferredAllocation answers; an ID offered again within {REOFFER_WITHIN} s of being chosen: {}, left out by the answer: {steered}{}",
        again.len(),
        again
            .iter()
            .map(|offer| format!("\n  {offer}"))
            .collect::<String>()
    )
}

/// Two pods on one node that the ground truth saw share an EFA.
struct Pair {
    node: String,
    pods: (String, String),
    lasted: f64,
    warned: bool,
    /// Lasted long enough for the detector to see it, and it did not warn.
    missed: bool,
}

impl std::fmt::Display for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} {}: seen for {:.0}s, warned {}",
            if self.missed { "missed" } else { "pair" },
            self.node,
            self.pods.0,
            self.pods.1,
            self.lasted,
            if self.warned { "yes" } else { "no" }
        )
    }
}

struct Verdict {
    pairs: Vec<Pair>,
    /// Pairs the plugin warned of that the ground truth never saw.
    detector_only: Vec<(String, String, String)>,
    warned: usize,
}

impl Verdict {
    /// The pairs of the ground truth's samples `seen` against the warnings in `log`: a pair
    /// seen for `confirm` seconds or more must have been warned of.
    fn of(seen: &[(f64, Finding)], log: &str, confirm: f64) -> Verdict {
        let mut spans: BTreeMap<(String, String, String), (f64, f64)> = BTreeMap::new();
        for (at, finding) in seen {
            let Finding::Double { node, pods, .. } = finding else {
                continue;
            };
            for (i, a) in pods.iter().enumerate() {
                for b in &pods[i + 1..] {
                    let span = spans
                        .entry((node.clone(), a.clone(), b.clone()))
                        .or_insert((*at, *at));
                    span.0 = span.0.min(*at);
                    span.1 = span.1.max(*at);
                }
            }
        }
        let warned = warned_pairs(log);
        let pairs = spans
            .iter()
            .map(|((node, a, b), (first, last))| {
                let lasted = last - first;
                let was_warned = warned.contains(&(node.clone(), a.clone(), b.clone()));
                Pair {
                    node: node.clone(),
                    pods: (a.clone(), b.clone()),
                    lasted,
                    warned: was_warned,
                    missed: !was_warned && lasted >= confirm,
                }
            })
            .collect();
        let detector_only = warned
            .iter()
            .filter(|pair| !spans.contains_key(*pair))
            .cloned()
            .collect();
        Verdict {
            pairs,
            detector_only,
            warned: warned.len(),
        }
    }
}

/// Every pair of pods (node, pod, pod) a double-booking warning in the plugins' logs names.
fn warned_pairs(log: &str) -> BTreeSet<(String, String, String)> {
    let mut pairs = BTreeSet::new();
    for (node, record) in records(log) {
        if !record["message"]
            .as_str()
            .is_some_and(|message| message.contains("double-booked"))
        {
            continue;
        }
        let pods: Vec<&str> = field(&record, "pods").into_iter().collect();
        for (i, a) in pods.iter().enumerate() {
            for b in &pods[i + 1..] {
                pairs.insert((node.to_owned(), (*a).to_owned(), (*b).to_owned()));
            }
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use efa_device_plugin::discovery::DevNum;

    use super::*;

    fn double(node: &str, pods: &[&str]) -> Finding {
        Finding::Double {
            node: node.to_owned(),
            dev: DevNum {
                major: 231,
                minor: 192,
            },
            pods: pods.iter().map(|pod| (*pod).to_owned()).collect(),
        }
    }

    const LOG: &str = r#"efa-a {"timestamp":"2026-12-07T01:00:00.100Z","message":"answered GetPreferredAllocation","offered":"rdmap16s27,rdmap32s27","answer":"rdmap16s27"}
efa-a {"timestamp":"2026-12-07T01:00:00.600Z","message":"answered GetPreferredAllocation","offered":"rdmap16s27,rdmap32s27","answer":"rdmap32s27"}
efa-a {"timestamp":"2026-12-07T01:00:03.000Z","message":"answered GetPreferredAllocation","offered":"rdmap32s27,rdmap16s27","answer":"rdmap16s27"}
efa-b {"timestamp":"2026-12-07T01:00:04.000Z","level":"WARN","message":"an EFA is double-booked: the kubelet lists it","pods":"default/burst-3,default/burst-1"}
efa-b not json"#;

    #[test]
    fn an_id_offered_again_within_a_second_of_its_choice_was_lost() {
        assert_eq!(
            reoffers(LOG),
            "3 GetPreferredAllocation answers; an ID offered again within 1 s of being chosen: 1, left out by the answer: 1\n  efa-a 2026-12-07T01:00:00.600Z rdmap16s27 500 ms after"
        );
    }

    #[test]
    fn a_pair_seen_two_polls_long_without_a_warning_is_missed() {
        let seen = [
            (
                10.0,
                double("efa-b", &["default/burst-1", "default/burst-3"]),
            ),
            (
                12.0,
                double("efa-b", &["default/burst-1", "default/burst-3"]),
            ),
            (
                20.0,
                double("efa-a", &["default/burst-7", "default/burst-8"]),
            ),
            (
                31.0,
                double("efa-a", &["default/burst-7", "default/burst-8"]),
            ),
            (
                40.0,
                double("efa-a", &["default/burst-10", "default/burst-9"]),
            ),
        ];
        let verdict = Verdict::of(&seen, LOG, 10.0);
        let lines: Vec<String> = verdict.pairs.iter().map(ToString::to_string).collect();
        assert_eq!(
            lines,
            [
                "pair efa-a default/burst-10 default/burst-9: seen for 0s, warned no",
                "missed efa-a default/burst-7 default/burst-8: seen for 11s, warned no",
                "pair efa-b default/burst-1 default/burst-3: seen for 2s, warned yes",
            ]
        );
        assert!(verdict.detector_only.is_empty());
        assert_eq!(verdict.warned, 1);
    }

    #[test]
    fn the_allocate_histogram_is_read_for_the_efa_resource_only() {
        let metrics = "kubelet_device_plugin_alloc_duration_seconds_count{resource_name=\"vpc.amazonaws.com/efa\"} 12\n\
            kubelet_device_plugin_alloc_duration_seconds_sum{resource_name=\"vpc.amazonaws.com/efa\"} 0.024\n\
            kubelet_device_plugin_alloc_duration_seconds_count{resource_name=\"nvidia.com/gpu\"} 5\n";
        assert_eq!(alloc_histogram(metrics), (12.0, 0.024));
        let before = BTreeMap::from([("efa-a", (2.0, 0.004))]);
        let after = BTreeMap::from([("efa-a", (12.0, 0.024))]);
        assert_eq!(
            allocate_line(&before, &after),
            "10 Allocate calls, mean 2.00 ms"
        );
    }
}
