//! Migrating `efa-a` from the AWS plugin to this one (docs/migration.md), with the suite's
//! stand-in for the AWS plugin (`tests/e2e/aws-standin`: its socket, ibdev-name IDs, one `rw`
//! DeviceSpec per uverbs node, no GetPreferredAllocation), installed as the AWS chart installs
//! it; and CloudWatch's lookup of the container that holds each EFA.
//!
//! Each case starts from a node with neither plugin installed and no pod in `default` (it
//! deletes what the cases before left) and leaves it so.

use std::collections::BTreeSet;
use std::fs;
use std::path::PathBuf;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

use super::fleet::watch::{Sample, watching_every};
use super::fleet::{Held, node_efas, start_pod, summary, uverbs_entry};
use super::kube::Pod;
use super::single_node::{
    EFAS, NODE, OURS_RELEASE as RELEASE, SETTLES, allocatable_settles, between_resets,
};
use super::workload::Placement;
use super::{Cluster, Host, Kube, NODE_STATUS_PERIOD, pod_resources};
use crate::cases::Detail;
use crate::kubelet::registrations_in;
use crate::node::RESOURCE;
use crate::plugin::sample;
use crate::pods::joined;
use crate::wait::{secs, wait_for, wait_until};

/// The holder H, which takes 2 EFAs before the migration, and the new pod N after it.
const HOLDER: &str = "mig-h";
const NEW: &str = "mig-n";
/// The label the AWS chart gives the stand-in's pods (its release's name).
const STANDIN: &str = "name=aws-efa-k8s-device-plugin";
/// How long the allocatable sampler sleeps between answers: the Node's figure changes only
/// with a status report, but the time below 4 is read to a fraction of a second.
const SAMPLE_PAUSE: Duration = Duration::from_millis(200);
const REGISTRATIONS: &str = "efa_device_plugin_registrations_total";
const COMPETING: &str = "efa_device_plugin_competing_plugin";
const FOREIGN: &str = "efa_device_plugin_foreign_allocations";
/// What the AWS plugin's socket is called: the competitor our plugin names in its errors.
const STANDIN_SOCKET: &str = "aws-efa-device-plugin.sock";
/// How long case 13 keeps both plugins installed.
const BESIDE: Duration = Duration::from_secs(60);

/// (12) The steps of docs/migration.md, in order, with H holding 2 EFAs through the stand-in:
/// H keeps running with the same device nodes, allocatable comes back to 4, a new pod gets
/// exactly the 2 EFAs H does not hold, and PodResources names H's ibdev names.
pub fn documented_order(cluster: &mut Cluster) -> Result<Detail> {
    on_clean_node(cluster, |cluster| {
        let holder = standin_with_holder(cluster)?;
        let log = KubeletLog::mark(cluster);
        let (migrated, samples) = watching_every(&cluster.kube, SAMPLE_PAUSE, || -> Result<()> {
            cluster.host.request("standin_uninstall", &[])?;
            cluster.host.request("helm_install", &[RELEASE])?;
            rolled_out(&cluster.kube)
        });
        migrated?;
        holder_intact(cluster, &holder)?;
        new_pod_gets_free(cluster, &holder)?;
        let lookup = cloudwatch_lookup(cluster)?;
        let held = held_ids(cluster)?;
        for id in &held {
            let line = format!("{id} default/{HOLDER}/probe");
            ensure!(
                lookup.contains(&line),
                "PodResources does not show {HOLDER} holding the ibdev name {id}: {}",
                lookup.join("|")
            );
        }
        let (below, lowest) = below(&samples)?;
        Ok(format!(
            "node showed fewer than 4 allocatable for {below:.1}s (lowest {lowest}), the kubelet counted none for {:.3}s; H holds {}",
            log.counted_none()?,
            held.join(" ")
        ))
    })
}

/// (13) This plugin installed while the stand-in runs: for 60 s its registrations grow by at
/// most one, it reports the competing plugin, allocatable stays 4 and its log names the
/// competitor's socket; with the stand-in uninstalled it is Ready (and `/readyz` 200) within
/// 10 s, allocatable is 4 and a new pod gets only EFAs H does not hold.
pub fn ours_first(cluster: &mut Cluster) -> Result<Detail> {
    on_clean_node(cluster, |cluster| {
        let holder = standin_with_holder(cluster)?;
        let log = KubeletLog::mark(cluster);
        let (beside, samples) = watching_every(&cluster.kube, SAMPLE_PAUSE, || {
            beside_the_standin(&cluster.kube, &mut cluster.host, &log)
        });
        let Beside { pod, first, last } = beside?;
        let (below_with_both, _) = below(&samples)?;

        let log = KubeletLog::mark(cluster);
        let (left, samples) = watching_every(&cluster.kube, SAMPLE_PAUSE, || {
            standin_leaves(&cluster.kube, &mut cluster.host, &pod)
        });
        let ready_after = left?;
        holder_intact(cluster, &holder)?;
        new_pod_gets_free(cluster, &holder)?;
        let pod = fresh(&cluster.kube, &pod)?;
        let (below_after, _) = below(&samples)?;
        Ok(format!(
            "with both for 60s: registrations_total {first} -> {last}, allocatable never below 4 ({below_with_both:.1}s below); stand-in gone: Ready with /readyz 200 after {:.3}s, registrations_total {}, kubelet registrations {}, the kubelet counted none for {:.3}s, node below 4 for {below_after:.1}s",
            ready_after.as_secs_f64(),
            metric(&pod, REGISTRATIONS)?,
            log.registrations(),
            log.counted_none()?
        ))
    })
}

/// What case 13 saw with both plugins installed: this plugin's pod and its registrations at the
/// start and the end.
struct Beside {
    pod: Pod,
    first: u64,
    last: u64,
}

/// This plugin installed beside the stand-in and checked every 2 s for 60 s; what it did
/// meanwhile is noted, with the kubelet's registrations since `log`'s mark.
fn beside_the_standin(kube: &Kube, host: &mut Host, log: &KubeletLog) -> Result<Beside> {
    host.request("helm_install", &[RELEASE])?;
    let pod = wait_for(
        "a Ready efa-device-plugin pod with the stand-in running",
        secs(120),
        || kube.serving_plugin_pod(NODE),
    )
    .map_err(|err| {
        anyhow!(
            "{err}: {}",
            summary(&kube.plugin_pods(NODE).unwrap_or_default())
        )
    })?;
    let registrations = || -> Result<u64> {
        let value = metric(&pod, REGISTRATIONS)?;
        value
            .parse()
            .with_context(|| format!("{REGISTRATIONS} is '{value}'"))
    };
    let first = wait_for(&format!("{REGISTRATIONS} scraped"), secs(10), || {
        Ok(registrations().ok())
    })?;
    let start = Instant::now();
    let mut last = first;
    let mut checks = 0;
    while start.elapsed() < BESIDE {
        checks += 1;
        let competing = metric(&pod, COMPETING)?;
        ensure!(
            competing == "1",
            "{COMPETING} is '{competing}' after {}s with the stand-in running, want 1",
            start.elapsed().as_secs()
        );
        last = registrations()?;
        ensure!(
            last <= first + 1,
            "{REGISTRATIONS} went from {first} to {last} within 60s of the stand-in, want at most one more"
        );
        let allocatable = kube.allocatable(NODE, RESOURCE)?;
        ensure!(
            allocatable == Some(EFAS),
            "allocatable fell to {allocatable:?} with both plugins installed"
        );
        sleep(secs(2));
    }
    let readyz = readyz(&pod);
    let errors = kube
        .plugin_log(&pod.metadata.name, false)?
        .lines()
        .filter(|line| line.to_lowercase().contains("error") && line.contains(STANDIN_SOCKET))
        .count();
    ensure!(
        errors > 0,
        "no error line naming {STANDIN_SOCKET} in {}'s log",
        pod.metadata.name
    );
    crate::note(&format!(
        "ours first, 60s with both: registrations_total {first} -> {last} ({checks} samples), competing_plugin 1, kubelet registrations {}, /readyz {readyz}, {errors} error line(s) naming the competitor",
        log.registrations()
    ));
    Ok(Beside { pod, first, last })
}

/// The stand-in uninstalled: how long from its pod's end until this plugin's pod is Ready with
/// `/readyz` 200; then allocatable at 4.
fn standin_leaves(kube: &Kube, host: &mut Host, pod: &Pod) -> Result<Duration> {
    host.request("standin_uninstall", &[])?;
    let gone = Instant::now();
    let name = &pod.metadata.name;
    wait_until(
        &format!("{name} Ready with /readyz 200 after the stand-in's uninstall"),
        secs(10),
        || fresh(kube, pod).is_ok_and(|now| now.serves() && readyz(&now) == "200"),
    )
    .map_err(|err| anyhow!("{err}: /readyz {}", readyz(pod)))?;
    let ready_after = gone.elapsed();
    let allocatable = || kube.allocatable(NODE, RESOURCE).ok().flatten();
    wait_until(
        &format!("allocatable {EFAS} after the stand-in left"),
        NODE_STATUS_PERIOD + secs(5),
        || allocatable() == Some(EFAS),
    )
    .map_err(|err| anyhow!("{err}: {:?}", allocatable()))?;
    Ok(ready_after)
}

/// (14) The documented order with `device-id-strategy: pci`: the plugin counts H's ibdev-name
/// IDs as foreign, warns naming H and its IDs, and a new pod gets only free EFAs, under PCI
/// addresses, in each of 3 tries.
pub fn pci(cluster: &mut Cluster) -> Result<Detail> {
    on_clean_node(cluster, |cluster| {
        let holder = standin_with_holder(cluster)?;
        let (migrated, samples) = watching_every(&cluster.kube, SAMPLE_PAUSE, || -> Result<()> {
            cluster.host.request("standin_uninstall", &[])?;
            cluster.host.request(
                "helm_install",
                &[RELEASE, "--set", "config.device-id-strategy=pci"],
            )?;
            rolled_out(&cluster.kube)
        });
        migrated?;
        let pod = cluster.kube.serving_plugin(NODE)?;
        let foreign = wait_for(&format!("{FOREIGN} 2"), secs(60), || {
            Ok(metric(&pod, FOREIGN).ok().filter(|value| value == "2"))
        })
        .map_err(|err| {
            anyhow!(
                "{err}: {FOREIGN} is '{}' while {HOLDER} holds {}",
                metric(&pod, FOREIGN).unwrap_or_else(|err| format!("{err:#}")),
                holder.ids.join(" ")
            )
        })?;
        for attempt in 1..=3 {
            let new = new_pod_gets_free(cluster, &holder)
                .map_err(|err| anyhow!("try {attempt}: {err:#}"))?;
            ensure!(
                new.ids.iter().all(|id| id.starts_with("0000:")),
                "try {attempt}: {NEW} holds [{}], want PCI addresses under device-id-strategy pci",
                new.ids.join(" ")
            );
            cluster.kube.delete_pods(&[NEW])?;
        }
        // The chart logs JSON lines; the warning names the pod in its namespace and pod fields.
        let log = cluster.kube.plugin_log(&pod.metadata.name, false)?;
        let pod_field = format!("\"pod\":\"{HOLDER}\"");
        let warnings = log
            .lines()
            .filter(|line| {
                line.contains("\"level\":\"WARN\"")
                    && line.contains("\"namespace\":\"default\"")
                    && line.contains(&pod_field)
                    && holder.ids.iter().all(|id| has_word(line, id))
            })
            .count();
        if warnings == 0 {
            let last: Vec<&str> = log
                .lines()
                .filter(|line| line.to_lowercase().contains("warn"))
                .collect();
            bail!(
                "no warning in {}'s log naming namespace default, pod {HOLDER} and {}: {}",
                pod.metadata.name,
                holder.ids.join(" "),
                last[last.len().saturating_sub(2)..].join("|")
            );
        }
        let (below, lowest) = below(&samples)?;
        Ok(format!(
            "foreign_allocations {foreign}; {warnings} warning line(s) naming default/{HOLDER} and its IDs; node below 4 for {below:.1}s (lowest {lowest})"
        ))
    })
}

/// (15) With this plugin serving and H holding 2 EFAs, CloudWatch's lookup names H's container
/// for H's two EFAs and no one for the others.
pub fn cloudwatch(cluster: &mut Cluster) -> Result<Detail> {
    on_clean_node(cluster, |cluster| {
        cluster.host.request("helm_install", &[RELEASE])?;
        rolled_out(&cluster.kube)?;
        let holder = start_pod(cluster, HOLDER, 2, Placement::Node(NODE))?;
        let mut lookup = cloudwatch_lookup(cluster)?;
        let mut want: Vec<String> = ibdevs(cluster)?
            .into_iter()
            .map(|name| {
                let holder = if holder.ids.contains(&name) {
                    format!("default/{HOLDER}/probe")
                } else {
                    "-".to_owned()
                };
                format!("{name} {holder}")
            })
            .collect();
        let detail = lookup.join(",");
        lookup.sort();
        want.sort();
        ensure!(
            lookup == want,
            "the lookup answers [{}], want [{}]",
            lookup.join("|"),
            want.join("|")
        );
        Ok(detail)
    })
}

/// `body` on a clean node: no pod in `default`, neither plugin installed ([`reset`]).
fn on_clean_node(
    cluster: &mut Cluster,
    body: impl FnOnce(&mut Cluster) -> Result<Detail>,
) -> Result<Detail> {
    between_resets(cluster, reset, body)
}

fn reset(cluster: &mut Cluster) -> Result<()> {
    cluster.kube.delete_all_pods()?;
    cluster.host.request("standin_uninstall", &[])?;
    cluster.host.request("uninstall", &[]).map(drop)
}

/// The stand-in installed the AWS way, Ready and registered with all 4 EFAs under their ibdev
/// names, and H holding 2 EFAs through it.
fn standin_with_holder(cluster: &mut Cluster) -> Result<Held> {
    cluster.host.request("standin_chart", &[])?;
    let kube = &cluster.kube;
    wait_for("a Ready stand-in pod", secs(60), || {
        kube.serving_pod(STANDIN, NODE)
    })
    .map_err(|err| {
        anyhow!(
            "{err}: {}",
            summary(&kube.system_pods(STANDIN, NODE).unwrap_or_default())
        )
    })?;
    allocatable_settles(kube, EFAS, SETTLES, "with the stand-in")?;
    let want = ibdevs(cluster)?;
    let registered = cluster.checkpoint(NODE)?.registered(RESOURCE);
    ensure!(
        registered == want,
        "the kubelet registered [{}] from the stand-in, want [{}]",
        registered.join(" "),
        want.join(" ")
    );
    start_pod(cluster, HOLDER, 2, Placement::Node(NODE))
}

/// The check of docs/migration.md's step 3, then allocatable back at 4.
fn rolled_out(kube: &Kube) -> Result<()> {
    kube.plugin_rolled_out(secs(120))
        .context("the plugin's rollout did not succeed within 120s")?;
    allocatable_settles(kube, EFAS, SETTLES, "after the install")
}

/// efa-a's EFAs by ibdev name, sorted, as testkit's p4d lays them out and the node's tree has
/// them.
fn ibdevs(cluster: &mut Cluster) -> Result<Vec<String>> {
    let mut names: Vec<String> = node_efas(cluster, NODE)?
        .into_iter()
        .map(|efa| efa.ibdev)
        .collect();
    names.sort();
    Ok(names)
}

/// The IDs the checkpoint records for H.
fn held_ids(cluster: &mut Cluster) -> Result<Vec<String>> {
    let pod = cluster
        .kube
        .pod(HOLDER)?
        .with_context(|| format!("pod {HOLDER} is gone"))?;
    Ok(cluster
        .checkpoint(NODE)?
        .allocated(&pod.metadata.uid, RESOURCE))
}

/// H still runs, and still sees exactly what it saw at its start.
fn holder_intact(cluster: &Cluster, holder: &Held) -> Result<()> {
    let pod = cluster
        .kube
        .pod(HOLDER)?
        .with_context(|| format!("holder {HOLDER} is gone"))?;
    ensure!(
        pod.status.phase == "Running",
        "holder {HOLDER} is {}, want Running",
        pod.status.phase
    );
    let now = cluster.kube.device_nodes(HOLDER)?;
    ensure!(
        now == holder.entries,
        "holder {HOLDER} now sees [{}] in /dev/infiniband, had [{}]",
        joined(&now, ";"),
        joined(&holder.entries, ";")
    );
    Ok(())
}

/// A new pod asking for 2 gets exactly the 2 EFAs whose nodes H does not see.
fn new_pod_gets_free(cluster: &mut Cluster, holder: &Held) -> Result<Held> {
    let new = start_pod(cluster, NEW, 2, Placement::Node(NODE))?;
    let all: BTreeSet<String> = node_efas(cluster, NODE)?.iter().map(uverbs_entry).collect();
    let shared: BTreeSet<String> = holder.entries.intersection(&new.entries).cloned().collect();
    let both: BTreeSet<String> = holder.entries.union(&new.entries).cloned().collect();
    ensure!(
        shared.is_empty() && both == all,
        "new pod {NEW} [{}] sees [{}], holder sees [{}]{}",
        new.ids.join(" "),
        joined(&new.entries, ";"),
        joined(&holder.entries, ";"),
        if shared.is_empty() {
            String::new()
        } else {
            format!(": both see {}", joined(&shared, ";"))
        }
    );
    Ok(new)
}

/// What CloudWatch's Container Insights agent finds (its EFA receiver,
/// `receiver/awscontainerinsightreceiver/internal/efa/efaSysfs.go`): for each name under the
/// node's `class/infiniband`, sorted, the container PodResources says holds a device with that
/// ID under the resource, as `name namespace/pod/container`, or `name -`.
fn cloudwatch_lookup(cluster: &mut Cluster) -> Result<Vec<String>> {
    let class = cluster.fake_node(NODE)?.sysfs.join("class/infiniband");
    let mut names = fs::read_dir(&class)
        .with_context(|| format!("list {}", class.display()))?
        .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<Vec<String>>>()?;
    names.sort();
    let socket = cluster.pod_resources(NODE)?;
    let resources = pod_resources::list(&socket)?;
    Ok(names
        .into_iter()
        .map(|name| {
            let holder = pod_resources::holder(&resources, RESOURCE, &name);
            format!("{name} {}", holder.as_deref().unwrap_or("-"))
        })
        .collect())
}

/// The plugin pod `pod` as the API shows it now.
fn fresh(kube: &Kube, pod: &Pod) -> Result<Pod> {
    let name = &pod.metadata.name;
    kube.plugin_pods(NODE)?
        .into_iter()
        .find(|now| &now.metadata.name == name)
        .with_context(|| format!("{name} is gone"))
}

/// The value of the unlabelled `family` in a scrape of the plugin pod `pod`.
fn metric(pod: &Pod, family: &str) -> Result<String> {
    let metrics = pod.plugin_http("/metrics")?;
    sample(&metrics, family)
        .map(str::to_owned)
        .with_context(|| format!("no {family} in {}'s metrics", pod.metadata.name))
}

/// The status code of the plugin pod `pod`'s `/readyz`, or why there is none.
fn readyz(pod: &Pod) -> String {
    pod.plugin_status("/readyz")
        .unwrap_or_else(|err| format!("{err:#}"))
}

/// How long the samples showed efa-a with fewer than 4 allocatable (each gap between two samples
/// counts by the first), and the lowest figure; a Node without the resource counts as 0.
fn below(samples: &[Sample]) -> Result<(f64, u64)> {
    let counts: Vec<(Duration, u64)> = samples
        .iter()
        .map(|sample| {
            let count = sample
                .nodes
                .get(NODE)
                .and_then(|node| node.allocatable.as_deref())
                .and_then(|count| count.parse().ok())
                .unwrap_or(0);
            (sample.at, count)
        })
        .collect();
    let lowest = counts
        .iter()
        .map(|(_, count)| *count)
        .min()
        .context("no sample of allocatable")?;
    let below: Duration = counts
        .windows(2)
        .filter(|pair| pair[0].1 != EFAS)
        .map(|pair| pair[1].0 - pair[0].0)
        .sum();
    Ok((below.as_secs_f64(), lowest))
}

/// Whether `word` stands in `line` as a whole word, as `grep -w` finds it.
fn has_word(line: &str, word: &str) -> bool {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back();
        let after = line[at + word.len()..].chars().next();
        !before.is_some_and(is_word) && !after.is_some_and(is_word)
    })
}

/// efa-a's kubelet log from a mark on.
struct KubeletLog {
    path: PathBuf,
    lines: usize,
    registrations: usize,
}

impl KubeletLog {
    /// The log as it stands: what it logs after this is what the readers below read.
    fn mark(cluster: &Cluster) -> KubeletLog {
        let path = cluster.run.join(format!("logs/kubelet-{NODE}.log"));
        KubeletLog {
            lines: fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .count(),
            registrations: registrations_in(&path, RESOURCE),
            path,
        }
    }

    /// Registrations of the resource since the mark.
    fn registrations(&self) -> usize {
        registrations_in(&self.path, RESOURCE) - self.registrations
    }

    /// Seconds the kubelet counted none of the resource since the mark.
    fn counted_none(&self) -> Result<f64> {
        let text = fs::read_to_string(&self.path)
            .with_context(|| format!("read {}", self.path.display()))?;
        Ok(counted_none(&text, self.lines, RESOURCE))
    }
}

/// From a kubelet log after its first `skip` lines, the seconds between each "Endpoint became
/// unhealthy" of `resource` and the next "Device plugin connected" of it: how long the kubelet
/// counted none allocatable, which the Node, posted every node-status period, may not show.
fn counted_none(log: &str, skip: usize, resource: &str) -> f64 {
    let quoted = format!("\"{resource}\"");
    let mut down: Option<f64> = None;
    let mut gap = 0.0;
    for line in log.lines().skip(skip).filter(|line| line.contains(&quoted)) {
        let Some(at) = klog_seconds(line) else {
            continue;
        };
        if line.contains("Endpoint became unhealthy") && down.is_none() {
            down = Some(at);
        } else if line.contains("Device plugin connected")
            && let Some(since) = down.take()
        {
            gap += at - since;
        }
    }
    gap
}

/// The time of day of a klog line (`I1206 22:21:54.123456 ...`), in seconds.
fn klog_seconds(line: &str) -> Option<f64> {
    let time = line.split_whitespace().nth(1)?;
    let mut parts = time.split(':');
    let hours: f64 = parts.next()?.parse().ok()?;
    let minutes: f64 = parts.next()?.parse().ok()?;
    let seconds: f64 = parts.next()?.parse().ok()?;
    Some(hours * 3600.0 + minutes * 60.0 + seconds)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::fleet::watch::NodeState;
    use super::*;

    #[test]
    fn the_kubelet_counts_none_from_unhealthy_to_connected_after_the_mark() {
        let log = "\
I1206 10:00:00.000000 1 manager.go:1] \"Endpoint became unhealthy\" resourceName=\"vpc.amazonaws.com/efa\"
I1206 10:00:01.000000 1 manager.go:1] \"Device plugin connected\" resourceName=\"vpc.amazonaws.com/efa\"
I1206 10:00:05.000000 1 manager.go:1] \"Endpoint became unhealthy\" resourceName=\"vpc.amazonaws.com/efa\"
I1206 10:00:05.500000 1 manager.go:1] \"Endpoint became unhealthy\" resourceName=\"nvidia.com/gpu\"
I1206 10:00:05.600000 1 manager.go:1] \"Endpoint became unhealthy\" resourceName=\"vpc.amazonaws.com/efa\"
I1206 10:00:06.250000 1 manager.go:1] \"Device plugin connected\" resourceName=\"vpc.amazonaws.com/efa\"
I1206 10:00:07.000000 1 manager.go:1] \"Device plugin connected\" resourceName=\"vpc.amazonaws.com/efa\"
";
        let efa = "vpc.amazonaws.com/efa";
        assert!((counted_none(log, 0, efa) - 2.25).abs() < 1e-6);
        assert!((counted_none(log, 2, efa) - 1.25).abs() < 1e-6);
        assert_eq!(counted_none(log, 7, efa), 0.0);
    }

    #[test]
    fn time_below_4_counts_each_gap_by_the_sample_before_it() {
        let at = |ms: u64, count: Option<&str>| Sample {
            at: Duration::from_millis(ms),
            nodes: BTreeMap::from([(
                NODE.to_owned(),
                NodeState {
                    serving: true,
                    allocatable: count.map(str::to_owned),
                },
            )]),
        };
        let samples = [
            at(0, Some("4")),
            at(300, Some("2")),
            at(700, None),
            at(1000, Some("4")),
            at(1300, Some("4")),
        ];
        let (seconds, lowest) = below(&samples).unwrap();
        assert!((seconds - 0.7).abs() < 1e-9);
        assert_eq!(lowest, 0);
        assert!(below(&[]).is_err());
    }

    #[test]
    fn a_word_stands_alone() {
        let line = r#"{"ids":"rdmap16s27,rdmap32s27"}"#;
        assert!(has_word(line, "rdmap16s27") && has_word(line, "rdmap32s27"));
        assert!(!has_word(line, "rdmap16s2") && !has_word(line, "map16s27"));
    }
}
