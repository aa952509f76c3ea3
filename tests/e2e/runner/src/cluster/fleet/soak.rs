//! (S1) The soak: the fleet with the chart in cdi mode, a workload that never stops changing,
//! and a seeded random sequence of day-two events: the plugin rolled out, its container killed,
//! a kubelet restarted, an EFA's uverbs node removed and restored, a node rebooted. After each
//! event it waits for the fleet to recover and times it, then checks the invariants from the
//! ground truth ([`truth`](super::truth)), not from the plugin's view:
//! - no uverbs node is inside running containers of two pods;
//! - what the kubelet's PodResources says each container holds is what is inside it;
//! - allocatable is back to each node's count within [`RECOVERY`];
//! - every failed pod is a known kubelet behaviour ([`KNOWN_ADMISSION`], [`KNOWN_STALE_CHECKPOINT`],
//!   [`KNOWN_KILL`]);
//! - each node has one registered endpoint, and the CDI spec is there;
//! - the plugin's RSS and open fds: their slopes are reported.
//!
//! The detector (`efa_device_plugin_double_booked_devices`) is read beside the ground truth. The
//! report goes to `logs/soak-report.txt`, its last line to the case's line: `soak: N cycles, E
//! events, P pods, V violations`.
//!
//! `EFA_DP_SOAK_CYCLES` sets the cycles (default 6, CI's short soak; one event each) and
//! `EFA_DP_SOAK_SEED` the seed of the workload and the events (default 27, whose first six
//! events are every kind, on both nodes).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use regex::Regex;

use super::report::{Report, commit, setting};
use super::seeded::Seeded;
use super::truth::{self, NodeView};
use super::{EFA_A, EFA_B, fleet_chart, fleet_node};
use crate::cases::Detail;
use crate::cluster::cdi::CDI_SPEC;
use crate::cluster::kube::Pod;
use crate::cluster::reboots::log_since;
use crate::cluster::workload::{job_sleeping, labelled, pod_sleeping};
use crate::cluster::{Cluster, NODE_STATUS_PERIOD};
use crate::node::RESOURCE;
use crate::plugin::{DOUBLE_BOOKED, sample};
use crate::reboot::start_to_register_in;
use crate::stats::{median, p99, slope};
use crate::wait::{secs, wait_for, wait_until};

/// The chart as the soak and the burst run it.
pub(super) const CHART: [&str; 2] = ["--set", "cdi.enabled=true"];
/// The nodes with EFAs, where the events happen.
pub(super) const NODES: [&str; 2] = [EFA_A, EFA_B];
const LABEL: (&str, &str) = ("soak", "1");
/// Workload pods alive at once, and their lifetimes in seconds.
const PODS: u32 = 6;
const LIFE_MIN: u32 = 5;
const LIFE_MAX: u32 = 40;
const RECOVERY: Duration = Duration::from_secs(90);
/// A restarted kubelet's PodResources lists the containers it runs only once it has synced its
/// pods again: a difference must outlast this.
const PODRESOURCES_SETTLE: Duration = Duration::from_secs(20);
/// What the kubelet is known to do to pods on a node whose kubelet just started (a restart or
/// a reboot): refuse them before the plugin registered again (kubernetes #125579, #128043 after
/// a reboot, #138446 after a restart) ...
const KNOWN_ADMISSION: &str = "Allocate failed due to (no healthy devices present; cannot allocate unhealthy devices|cannot allocate unregistered device)";
/// ... and refuse a pod it admits in its first sync after starting, counting the devices its
/// checkpoint still gives to pods that ended before it stopped: the device manager frees an ended
/// pod's devices only at its next allocation (`UpdateAllocatedDevices`), which does nothing until
/// every pod source has been seen (1.38 `devicemanager/manager.go:629`, 1.34 `:547`), and the
/// kubelet marks the API source seen only after admitting the first pods it sent
/// (1.38 `kubelet.go:2813`, 1.34 `:2541`). The scheduler saw the pods end and counts their EFAs
/// free ...
const KNOWN_STALE_CHECKPOINT: &str =
    "Allocate failed due to requested number of devices unavailable for ";
/// ... and lose a container the reboot killed, which a pod that never restarts does not get
/// back (exit 137, or ContainerStatusUnknown when the kubelet found it gone).
const KNOWN_KILL: &str = "^(ContainerStatusUnknown|Error/137)$";
const DEVICE_PLUGINS: &str = "/var/lib/kubelet/device-plugins";

/// The day-two events, in the order the seed draws them from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Rollout,
    Kill,
    Kubelet,
    Flap,
    Reboot,
}

const EVENTS: [Event; 5] = [
    Event::Rollout,
    Event::Kill,
    Event::Kubelet,
    Event::Flap,
    Event::Reboot,
];

impl Event {
    fn name(self) -> &'static str {
        match self {
            Event::Rollout => "rollout",
            Event::Kill => "kill",
            Event::Kubelet => "kubelet",
            Event::Flap => "flap",
            Event::Reboot => "reboot",
        }
    }
}

/// One cycle of the plan: a pause, then an event on a node.
struct Step {
    pause: Duration,
    event: Event,
    node: &'static str,
}

/// Each cycle's pause, event and node, drawn first from the seed, so that the events are the
/// seed's whatever the timing; the workload's draws follow (how many it makes depends on what
/// finished when).
fn plan(draws: &mut Seeded, cycles: u32) -> Vec<Step> {
    (0..cycles)
        .map(|_| {
            let pause = Duration::from_secs(u64::from(2 + draws.below(5)));
            let event = EVENTS[draws.below(EVENTS.len() as u32) as usize];
            let node = NODES[draws.below(2) as usize];
            Step { pause, event, node }
        })
        .collect()
}

/// (S1) The soak.
pub fn soak(cluster: &mut Cluster) -> Result<Detail> {
    let cycles = setting("EFA_DP_SOAK_CYCLES", 6)?;
    let seed = setting("EFA_DP_SOAK_SEED", 27)?;
    fleet_chart(cluster, &CHART)?;
    let views = truth::views(cluster, &NODES)?;
    let mut soak = Soak {
        report: Report::create(cluster, "soak-report.txt")?,
        cluster,
        views,
        draws: Seeded::new(seed),
        cycle: 0,
        expiry: BTreeMap::new(),
        pods_made: 0,
        kubelet_started: BTreeMap::new(),
        recovery: Vec::new(),
        failures: BTreeMap::new(),
        truth_doubles: 0,
        detector_doubles: 0,
        usage: BTreeMap::new(),
        known_admission: Regex::new(KNOWN_ADMISSION)?,
        known_stale_checkpoint: Regex::new(KNOWN_STALE_CHECKPOINT)?,
        known_kill: Regex::new(KNOWN_KILL)?,
    };
    let plan = plan(&mut soak.draws, cycles);
    let head = format!(
        "soak: seed {seed}, {cycles} cycles, Kubernetes {}, commit {}",
        soak.cluster.kube_version,
        commit(soak.cluster)
    );
    soak.report.note(&head);
    for (cycle, step) in (1..).zip(&plan) {
        soak.cycle = cycle;
        soak.churn();
        sleep(step.pause);
        soak.cycle_of(step);
        soak.check();
    }
    let last = soak.summary(cycles);
    let kube = &soak.cluster.kube;
    let selector = format!("{}={}", LABEL.0, LABEL.1);
    if let Err(err) = kube.run(&[
        "delete",
        "pods,jobs",
        "-n",
        "default",
        "-l",
        &selector,
        "--wait=false",
    ]) {
        soak.report
            .note(&format!("the soak's pods were not deleted: {err:#}"));
    }
    soak.report.verdict(&last)
}

struct Soak<'c> {
    cluster: &'c mut Cluster,
    report: Report,
    views: Vec<NodeView>,
    draws: Seeded,
    cycle: u32,
    /// Each bare workload pod and when it is to be deleted.
    expiry: BTreeMap<String, Instant>,
    pods_made: u32,
    /// When each node's kubelet last started, for the failures it is known to cause.
    kubelet_started: BTreeMap<&'static str, Instant>,
    /// Each event, and how long the fleet took to recover from it (`None`: not within
    /// [`RECOVERY`]).
    recovery: Vec<(Event, Option<Duration>)>,
    failures: BTreeMap<&'static str, u32>,
    truth_doubles: usize,
    detector_doubles: u64,
    /// Each node's plugin: (cycle, pid, RSS in KiB, open fds) per check.
    usage: BTreeMap<&'static str, Vec<(u32, u32, u64, u64)>>,
    known_admission: Regex,
    known_stale_checkpoint: Regex,
    known_kill: Regex,
}

impl Soak<'_> {
    fn violation(&mut self, what: &str) {
        self.report
            .violation(&format!("cycle {}", self.cycle), what);
    }

    /// Expired pods deleted, finished Jobs deleted, and new pods and Jobs, each asking for 1
    /// to 4 EFAs, made until [`PODS`] are alive.
    fn churn(&mut self) {
        let kube = &self.cluster.kube;
        let now = Instant::now();
        let expired: Vec<String> = self
            .expiry
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(name, _)| name.clone())
            .collect();
        for name in expired {
            // A pod already gone (its node rebooted it away) is not the soak's concern here.
            let _ = kube.run(&["delete", "pod", "-n", "default", &name, "--wait=false"]);
            self.expiry.remove(&name);
        }
        let selector = format!("{}={}", LABEL.0, LABEL.1);
        let _ = kube.run(&[
            "delete",
            "jobs",
            "-n",
            "default",
            "-l",
            &selector,
            "--field-selector",
            "status.successful=1",
            "--wait=false",
        ]);
        let live = match kube.pods_labelled(&selector) {
            Ok(pods) => pods.iter().filter(|pod| alive(pod)).count() as u32,
            Err(err) => {
                self.violation(&format!("the workload's pods could not be listed: {err:#}"));
                return;
            }
        };
        for _ in live..PODS {
            self.pods_made += 1;
            let name = format!("soak-{}", self.pods_made);
            let life = LIFE_MIN + self.draws.below(LIFE_MAX - LIFE_MIN + 1);
            let job = self.draws.below(2) == 1;
            let count = 1 + self.draws.below(4);
            let object = if job {
                job_sleeping(&name, count, u64::from(life))
            } else {
                pod_sleeping(&name, count, "Never", 100_000)
            };
            let kind = if job { "job" } else { "pod" };
            if let Err(err) = self.cluster.kube.apply(&labelled(object, LABEL.0, LABEL.1)) {
                self.violation(&format!("{kind} {name} not accepted: {err:#}"));
            } else if !job {
                self.expiry
                    .insert(name, Instant::now() + secs(u64::from(life)));
            }
        }
    }

    /// One cycle's event, the fleet's recovery timed, and the cycle noted.
    fn cycle_of(&mut self, step: &Step) {
        let kind = step.event.name();
        let start = Instant::now();
        if let Err(err) = self.event(step) {
            self.violation(&format!(
                "{kind} on {} did not complete: {err:#}",
                step.node
            ));
        }
        let recovered = wait_until("the fleet recovered", RECOVERY, || self.recovered());
        let took = start.elapsed();
        self.recovery
            .push((step.event, recovered.is_ok().then_some(took)));
        let ms = match recovered {
            Ok(()) => took.as_millis().to_string(),
            Err(_) => {
                self.violation(&format!(
                    "{kind} on {}: not recovered within {}s",
                    step.node,
                    RECOVERY.as_secs()
                ));
                "?".to_owned()
            }
        };
        self.report.note(&format!(
            "cycle {}: {kind} on {}, recovered in {ms} ms",
            self.cycle, step.node
        ));
    }

    /// The event on its node (a rollout: on every node), done when what it set off has
    /// happened: the rollout complete, the plugin restarted, the kubelet's log showing the
    /// plugin registered again, the node offering one EFA fewer.
    fn event(&mut self, step: &Step) -> Result<()> {
        let node = step.node;
        let log = self.cluster.run.join(format!("logs/kubelet-{node}.log"));
        match step.event {
            Event::Rollout => {
                let annotation = format!("additionalPodAnnotations.soak={}", self.cycle);
                let mut args = CHART.to_vec();
                args.extend(["--set-string", &annotation]);
                self.cluster.host.request("upgrade", &args)?;
                self.cluster.kube.plugin_rolled_out(RECOVERY)
            }
            Event::Kill => {
                let pod = self.cluster.kube.serving_plugin(node)?;
                let container = pod
                    .container_id()
                    .with_context(|| format!("{} has no container", pod.metadata.name))?
                    .to_owned();
                let restarts = pod.restarts();
                self.cluster
                    .host
                    .request("kill_container", &[node, &container])?;
                let kube = &self.cluster.kube;
                wait_until(
                    &format!("{} restarted", pod.metadata.name),
                    RECOVERY,
                    || {
                        kube.plugin_pods(node).is_ok_and(|pods| {
                            pods.iter().any(|now| {
                                now.metadata.name == pod.metadata.name && now.restarts() > restarts
                            })
                        })
                    },
                )
            }
            Event::Kubelet => {
                let mark = log_length(&log);
                self.kubelet_started.insert(node, Instant::now());
                self.cluster.host.request("restart_kubelet", &[node])?;
                registered_since(&log, mark)
            }
            Event::Flap => self.flap(node),
            Event::Reboot => {
                let mark = log_length(&log);
                self.cluster.host.request("stop_node", &[node])?;
                self.kubelet_started.insert(node, Instant::now());
                self.cluster.host.request("start_containerd", &[node])?;
                self.cluster.host.request("start_kubelet", &[node])?;
                registered_since(&log, mark)
            }
        }
    }

    /// A seeded EFA's uverbs node removed until the node offers one EFA fewer, then restored
    /// (also when it did not).
    fn flap(&mut self, node: &str) -> Result<()> {
        let count = fleet_node(node)?.efas;
        let index = self.draws.below(count as u32);
        let dir = self.cluster.fake_node(node)?.dev.join("infiniband");
        let (present, aside) = (
            dir.join(format!("uverbs{index}")),
            dir.join(format!(".uverbs{index}")),
        );
        fs::rename(&present, &aside)
            .with_context(|| format!("move {} aside", present.display()))?;
        let kube = &self.cluster.kube;
        let dropped = wait_until(
            &format!("{node} offering {}", count - 1),
            NODE_STATUS_PERIOD + secs(10),
            || kube.allocatable(node, RESOURCE).ok().flatten() == Some(count - 1),
        );
        fs::rename(&aside, &present).with_context(|| format!("restore {}", present.display()))?;
        dropped
    }

    /// Each EFA node with a serving plugin pod, its count allocatable and the CDI spec.
    fn recovered(&mut self) -> bool {
        NODES.iter().all(|node| {
            let Ok(efas) = fleet_node(node).map(|node| node.efas) else {
                return false;
            };
            let kube = &self.cluster.kube;
            matches!(kube.serving_plugin_pod(node), Ok(Some(_)))
                && kube.allocatable(node, RESOURCE).ok().flatten() == Some(efas)
                && self
                    .cluster
                    .host_path(node, CDI_SPEC)
                    .is_ok_and(|spec| fs::metadata(spec).is_ok_and(|meta| meta.len() > 0))
        })
    }

    /// The ground truth against PodResources, double bookings against the detector, failed
    /// pods classified, endpoints counted, RSS and fds sampled.
    fn check(&mut self) {
        let truth = self.settled_truth();
        for finding in &truth.findings {
            self.violation(&finding.to_string());
        }
        self.truth_doubles += truth.doubles;
        for node in NODES {
            if let Err(err) = self.node_check(node) {
                self.violation(&format!("{node}: {err:#}"));
            }
        }
        self.classify_failures();
    }

    /// The ground truth once PodResources has caught up with the containers, or after
    /// [`PODRESOURCES_SETTLE`].
    fn settled_truth(&mut self) -> truth::Truth {
        let start = Instant::now();
        let mut reads = 0;
        loop {
            let pods = self.cluster.kube.pods().unwrap_or_default();
            let truth = truth::read(&self.views, &pods);
            reads += 1;
            let settled = !truth.findings.iter().any(truth::Finding::may_settle);
            if settled || start.elapsed() >= PODRESOURCES_SETTLE {
                // What has not settled by then is reported as the violations it is.
                if settled && reads > 1 {
                    self.report.note(&format!(
                        "cycle {}: PodResources caught up with the containers after {}s",
                        self.cycle,
                        start.elapsed().as_secs()
                    ));
                }
                return truth;
            }
            sleep(secs(2));
        }
    }

    /// `node`'s detector, its registered endpoints, and its plugin's RSS and fds.
    fn node_check(&mut self, node: &'static str) -> Result<()> {
        let pod = self.cluster.kube.serving_plugin(node)?;
        let metrics = pod.plugin_http("/metrics").unwrap_or_default();
        let doubles: u64 = sample(&metrics, DOUBLE_BOOKED)
            .and_then(|value| value.parse().ok())
            .unwrap_or(0);
        self.detector_doubles += doubles;
        let dir = self.cluster.host_path(node, DEVICE_PLUGINS)?;
        let endpoints = fs::read_dir(&dir)
            .with_context(|| format!("list {}", dir.display()))?
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".sock") && name != "kubelet.sock")
            .count();
        if endpoints != 1 {
            self.violation(&format!(
                "{node} has {endpoints} registered endpoint sockets"
            ));
        }
        let container = pod
            .container_id()
            .with_context(|| format!("{} has no container", pod.metadata.name))?;
        let pid = self.cluster.host.request("task_pid", &[node, container])?;
        if let Some((rss, fds)) = usage(&pid) {
            let pid = pid.parse().unwrap_or_default();
            self.usage
                .entry(node)
                .or_default()
                .push((self.cycle, pid, rss, fds));
        }
        Ok(())
    }

    /// Every failed workload pod, once: a refusal or a lost container the kubelet is known to
    /// cause right after it started, within [`RECOVERY`] and a minute of a kubelet start on the
    /// pod's node, is counted by kind; anything else is a violation. Failed pods are deleted
    /// once read.
    fn classify_failures(&mut self) {
        let selector = format!("{}={}", LABEL.0, LABEL.1);
        let pods = match self.cluster.kube.pods_labelled(&selector) {
            Ok(pods) => pods,
            Err(err) => {
                self.violation(&format!("the workload's pods could not be listed: {err:#}"));
                return;
            }
        };
        for pod in pods.iter().filter(|pod| pod.status.phase == "Failed") {
            let node = pod.spec.node_name.as_str();
            let status = &pod.status;
            let ended = ended(pod);
            let recent = NODES
                .iter()
                .find(|known| **known == node)
                .and_then(|known| self.kubelet_started.get(known))
                .is_some_and(|at| at.elapsed() <= RECOVERY + secs(60));
            let kind = if !recent {
                None
            } else if self.known_kill.is_match(&ended) {
                Some("reboot")
            } else if status.reason != "UnexpectedAdmissionError" {
                None
            } else if self.known_admission.is_match(&status.message) {
                Some("admission")
            } else if self.known_stale_checkpoint.is_match(&status.message) {
                Some("stale checkpoint")
            } else {
                None
            };
            match kind {
                Some(kind) => *self.failures.entry(kind).or_default() += 1,
                None => self.violation(&format!(
                    "unclassified failure: pod {} on {node}: {}: {}; container: {ended}",
                    pod.metadata.name,
                    or_dash(&status.reason),
                    or_dash(&status.message.replace(['\t', '\n'], " "))
                )),
            }
            let name = &pod.metadata.name;
            let gone = match pod.metadata.labels.get("job-name") {
                Some(job) => format!("job/{job}"),
                None => {
                    self.expiry.remove(name);
                    format!("pod/{name}")
                }
            };
            let _ = self
                .cluster
                .kube
                .run(&["delete", "-n", "default", &gone, "--wait=false"]);
        }
    }

    /// The report's closing lines; the last is the case's.
    fn summary(&mut self, cycles: u32) -> String {
        let mut counts: BTreeMap<Event, u32> = BTreeMap::new();
        let mut by_kind: BTreeMap<Event, Vec<f64>> = BTreeMap::new();
        for (event, took) in &self.recovery {
            *counts.entry(*event).or_default() += 1;
            if let Some(took) = took {
                by_kind
                    .entry(*event)
                    .or_default()
                    .push(took.as_millis() as f64);
            }
        }
        let counts: Vec<String> = counts
            .iter()
            .map(|(event, n)| format!("{} {n}", event.name()))
            .collect();
        self.report
            .note(&format!("events by kind: {}", counts.join(", ")));
        let quantiles: Vec<String> = by_kind
            .iter()
            .map(|(event, ms)| {
                format!(
                    "{} {} {:.0} {:.0}",
                    event.name(),
                    ms.len(),
                    median(ms).trunc(),
                    p99(ms)
                )
            })
            .collect();
        self.report.note(&format!(
            "recovery by kind (n, median ms, p99 ms): {}",
            quantiles.join(";")
        ));
        let failures: Vec<String> = self
            .failures
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        self.report
            .note(&format!("failures classified: {}", failures.join(", ")));
        self.report.note(&format!(
            "double-booked devices, summed over checks: ground truth {}, detector {}",
            self.truth_doubles, self.detector_doubles
        ));
        for (node, samples) in &self.usage {
            let run = longest_run(samples);
            let rss: Vec<(f64, f64)> = run.iter().map(|s| (f64::from(s.0), s.2 as f64)).collect();
            let fds: Vec<(f64, f64)> = run.iter().map(|s| (f64::from(s.0), s.3 as f64)).collect();
            self.report.note(&format!(
                "{node} plugin: RSS slope {:.2} KiB/cycle over {} samples, fd slope {:.2}/cycle over {} samples",
                slope(&rss),
                run.len(),
                slope(&fds),
                run.len()
            ));
        }
        format!(
            "soak: {cycles} cycles, {} events, {} pods, {} violations",
            self.recovery.len(),
            self.pods_made,
            self.report.violations()
        )
    }
}

/// Pending or Running, and not being deleted.
fn alive(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && matches!(pod.status.phase.as_str(), "Pending" | "Running")
}

/// How the pod's container ended: its reason, or `Error/CODE`; `-` while none has.
fn ended(pod: &Pod) -> String {
    pod.status
        .container_statuses
        .iter()
        .filter_map(|status| status.state.terminated.as_ref())
        .map(|ended| {
            if ended.reason == "Error" {
                format!("Error/{}", ended.exit_code)
            } else {
                or_dash(&ended.reason).to_owned()
            }
        })
        .next_back()
        .unwrap_or_else(|| "-".to_owned())
}

fn or_dash(text: &str) -> &str {
    if text.is_empty() { "-" } else { text }
}

/// The samples of the plugin process that was sampled the most (a restart starts a new one).
fn longest_run(samples: &[(u32, u32, u64, u64)]) -> Vec<(u32, u32, u64, u64)> {
    let mut by_pid: BTreeMap<u32, Vec<(u32, u32, u64, u64)>> = BTreeMap::new();
    for sample in samples {
        by_pid.entry(sample.1).or_default().push(*sample);
    }
    by_pid
        .into_values()
        .max_by_key(Vec::len)
        .unwrap_or_default()
}

/// Process `pid`'s resident memory in KiB and its open file descriptors, read on the host.
fn usage(pid: &str) -> Option<(u64, u64)> {
    let proc = Path::new("/proc").join(pid);
    let status = fs::read_to_string(proc.join("status")).ok()?;
    let rss = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let fds = fs::read_dir(proc.join("fd")).ok()?.count() as u64;
    Some((rss, fds))
}

fn log_length(log: &Path) -> u64 {
    fs::metadata(log).map(|meta| meta.len()).unwrap_or(0)
}

/// The kubelet's log `log`, from byte `mark` on, records the plugin's registration, within
/// [`RECOVERY`].
fn registered_since(log: &Path, mark: u64) -> Result<()> {
    wait_for(
        &format!("the plugin's registration in {}", log.display()),
        RECOVERY,
        || Ok(start_to_register_in(&log_since(log, mark)?).ok()),
    )
    .map(drop)
    .map_err(|err| anyhow!("{err:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_27_plans_what_the_bash_soak_ran_every_kind_on_both_nodes() {
        // The first six cycles of seed 27 in the bash soak's report.
        let plan: Vec<(Event, &str)> = plan(&mut Seeded::new(27), 6)
            .iter()
            .map(|step| (step.event, step.node))
            .collect();
        assert_eq!(
            plan,
            [
                (Event::Reboot, EFA_A),
                (Event::Kubelet, EFA_A),
                (Event::Flap, EFA_A),
                (Event::Rollout, EFA_B),
                (Event::Reboot, EFA_B),
                (Event::Kill, EFA_B),
            ]
        );
    }

    #[test]
    fn the_plan_is_the_seeds_whatever_is_drawn_after_it() {
        let of = |seed| {
            plan(&mut Seeded::new(seed), 12)
                .iter()
                .map(|step| (step.pause, step.event, step.node))
                .collect::<Vec<_>>()
        };
        assert_eq!(of(27), of(27));
        assert_ne!(of(27), of(28));
    }

    #[test]
    fn a_container_that_ended_in_error_reads_with_its_exit_code() {
        let pod: Pod = serde_json::from_str(
            r#"{"metadata": {"name": "soak-3"}, "status": {"phase": "Failed",
                "containerStatuses": [{"name": "probe",
                  "state": {"terminated": {"reason": "Error", "exitCode": 137}}}]}}"#,
        )
        .unwrap();
        assert_eq!(ended(&pod), "Error/137");
        assert!(Regex::new(KNOWN_KILL).unwrap().is_match(&ended(&pod)));
    }

    #[test]
    fn the_longest_run_is_the_most_sampled_process() {
        let samples = [
            (1, 10, 100, 5),
            (2, 10, 101, 5),
            (3, 11, 90, 4),
            (4, 10, 102, 5),
        ];
        assert_eq!(longest_run(&samples).len(), 3);
    }
}
