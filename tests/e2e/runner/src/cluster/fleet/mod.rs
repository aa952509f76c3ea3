//! The fleet's cases: what users live through on a fleet of nodes of different shapes (a node
//! that joins late, a reboot, one plugin per node, placement by each node's count, rollouts and
//! restarts that touch one node at a time, a drain, one Prometheus for all). The suite's bash
//! brings the fleet up and joins and removes late nodes (`cluster/fleet.sh`); each case
//! installs the chart anew and pins its pods to the nodes it is about.

mod burst;
mod join;
mod labelled;
mod metrics;
mod placement;
mod reboot;
mod report;
mod restarts;
mod seeded;
mod soak;
mod truth;
pub(super) mod watch;

use std::collections::BTreeSet;
use std::fs;
use std::io;

use anyhow::{Context, Result, anyhow, bail, ensure};
use efa_device_plugin::testkit::simulate::{FakeDevice, Shape, devices};
use serde::Deserialize;

use super::kube::Pod;
use super::single_node::shown;
use super::workload::{Placement, pod};
use super::{Cluster, Kube, NODE_STATUS_PERIOD};
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::pods::{joined, listing_entries};
use crate::wait::{secs, wait_for, wait_until};

pub use burst::burst;
pub use join::late_join;
pub use labelled::labelled_scope;
pub use metrics::one_prometheus;
pub use placement::{drain, placement};
pub use reboot::efa_a_rebooted;
pub use restarts::{isolation, rollout};
pub use soak::soak;

/// The node every single-node case runs on, whose fake EFAs are p4d's.
pub(super) const EFA_A: &str = "efa-a";
const EFA_B: &str = "efa-b";
const PLAIN: &str = "plain";

/// A node of the fleet: its name, the shape its fake EFAs have (as `cluster/fleet.sh` lays them
/// out) and how many it offers.
pub(super) struct FleetNode {
    pub(super) name: &'static str,
    pub(super) shape: Shape,
    pub(super) efas: u64,
}

const FLEET: [FleetNode; 3] = [
    FleetNode {
        name: EFA_A,
        shape: Shape::P4d,
        efas: 4,
    },
    FleetNode {
        name: EFA_B,
        shape: Shape::P5en,
        efas: 16,
    },
    FleetNode {
        name: PLAIN,
        shape: Shape::NoEfa,
        efas: 0,
    },
];

const NAMES: [&str; 3] = [EFA_A, EFA_B, PLAIN];

pub(super) fn fleet_node(name: &str) -> Result<&'static FleetNode> {
    FLEET
        .iter()
        .find(|node| node.name == name)
        .with_context(|| format!("{name} is no node of the fleet"))
}

/// The fleet up, no pod left in `default`, the chart installed anew with the suite's values
/// and `helm_args`, and every node with a Ready plugin pod and its count allocatable.
fn fleet_chart(cluster: &mut Cluster, helm_args: &[&str]) -> Result<()> {
    cluster.host.request("chart", helm_args)?;
    serving(&cluster.kube, &NAMES)
}

/// `body` on the fleet with the chart installed anew; the pods it makes (`pods`) are deleted
/// after it, whatever its outcome.
fn with_chart(
    cluster: &mut Cluster,
    pods: &[&str],
    body: fn(&mut Cluster) -> Result<Detail>,
) -> Result<Detail> {
    fleet_chart(cluster, &[])?;
    let outcome = body(cluster);
    let cleaned = cluster.kube.delete_pods(pods);
    let detail = outcome?;
    cleaned.context("deleting the case's pods")?;
    Ok(detail)
}

/// Each of `nodes` with a serving plugin pod (Ready, not terminating) within 120 s, then its
/// count allocatable within a node-status period and 30 s: 0 or none on a node without EFA.
pub(super) fn serving(kube: &Kube, nodes: &[&str]) -> Result<()> {
    for &name in nodes {
        let node = fleet_node(name)?;
        wait_for(&format!("a Ready plugin pod on {name}"), secs(120), || {
            kube.serving_plugin_pod(name)
        })
        .map_err(|err| {
            let pods = kube
                .plugin_pods(name)
                .map_or_else(|err| format!("{err:#}"), |pods| summary(&pods));
            anyhow!("{err}: {pods}")
        })?;
        let allocatable = || kube.allocatable(name, RESOURCE).ok().flatten();
        let settled = |count: Option<u64>| match node.efas {
            0 => matches!(count, None | Some(0)),
            efas => count == Some(efas),
        };
        wait_until(
            &format!("{name} at {} allocatable", node.efas),
            NODE_STATUS_PERIOD + secs(30),
            || settled(allocatable()),
        )
        .map_err(|err| {
            anyhow!(
                "{err}: allocatable on {name} is {}, want {}",
                shown(allocatable()),
                node.efas
            )
        })?;
    }
    Ok(())
}

/// `node`'s EFAs as testkit lays out its shape, checked against the node's tree: the same names
/// under `class/infiniband`, each with the same uverbs node and device number.
pub(super) fn efas_of(cluster: &mut Cluster, node: &FleetNode) -> Result<Vec<FakeDevice>> {
    let sysfs = cluster.fake_node(node.name)?.sysfs;
    let efas: Vec<FakeDevice> = devices(node.shape)
        .into_iter()
        .filter(FakeDevice::is_efa)
        .collect();
    let class = sysfs.join("class/infiniband");
    let names: BTreeSet<String> = match fs::read_dir(&class) {
        Ok(entries) => entries
            .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
            .collect::<io::Result<_>>()?,
        Err(err) if err.kind() == io::ErrorKind::NotFound => BTreeSet::new(),
        Err(err) => return Err(err).with_context(|| format!("list {}", class.display())),
    };
    let want: BTreeSet<String> = efas.iter().map(|efa| efa.ibdev.clone()).collect();
    ensure!(
        names == want,
        "{}'s tree has [{}], not testkit's {:?} [{}]",
        node.name,
        joined(&names, " "),
        node.shape,
        joined(&want, " ")
    );
    for efa in &efas {
        let dev = class
            .join(&efa.ibdev)
            .join("device/infiniband_verbs")
            .join(efa.uverbs_name())
            .join("dev");
        let number = fs::read_to_string(&dev)
            .with_context(|| format!("{}'s {}: {}", node.name, efa.ibdev, dev.display()))?;
        ensure!(
            number.trim() == efa.dev.to_string(),
            "{}'s {} is {} {}, not testkit's {}",
            node.name,
            efa.ibdev,
            efa.uverbs_name(),
            number.trim(),
            efa.dev
        );
    }
    Ok(efas)
}

/// The EFAs of the fleet's node `name`, as [`efas_of`] checks them.
pub(super) fn node_efas(cluster: &mut Cluster, name: &str) -> Result<Vec<FakeDevice>> {
    efas_of(cluster, fleet_node(name)?)
}

/// A pod whose container saw exactly the uverbs nodes of the EFAs its node's kubelet gave it.
pub(super) struct Held {
    pub(super) name: String,
    pub(super) node: String,
    /// As the node's checkpoint lists them, sorted.
    pub(super) ids: Vec<String>,
    /// What its container listed in `/dev/infiniband` at its start, as [`listing_entries`]
    /// gives it.
    pub(super) entries: BTreeSet<String>,
}

/// A long-running pod asking for `count` EFAs, made anew, Running within 60 s, with exactly its
/// EFAs on the node it runs on ([`check_devices`]).
pub(super) fn start_pod(
    cluster: &mut Cluster,
    name: &str,
    count: u32,
    placement: Placement,
) -> Result<Held> {
    let kube = &cluster.kube;
    kube.delete_pods(&[name])?;
    let running = kube.run_pod(&pod(name, count, "Never", placement))?;
    check_devices(cluster, name, count, &running.spec.node_name)
}

/// Pod `name` runs on `node`, and its container saw exactly the uverbs nodes of the `count`
/// EFAs the node's kubelet gave it (its checkpoint, by ibdev name or, under
/// `device-id-strategy: pci`, by PCI address), as testkit pairs them on the node's shape.
pub(super) fn check_devices(
    cluster: &mut Cluster,
    name: &str,
    count: u32,
    node: &str,
) -> Result<Held> {
    let pod = cluster
        .kube
        .pod(name)?
        .with_context(|| format!("pod {name} is gone"))?;
    ensure!(
        pod.spec.node_name == node,
        "pod {name} runs on '{}', want {node}",
        pod.spec.node_name
    );
    let ids = cluster
        .checkpoint(node)?
        .allocated(&pod.metadata.uid, RESOURCE);
    ensure!(
        ids.len() == count as usize,
        "{node}'s checkpoint gives pod {name} {} devices [{}], want {count}",
        ids.len(),
        ids.join(" ")
    );
    let want = uverbs_entries(cluster, node, &ids)?;
    let log = listing(cluster, name)?;
    let got = listing_entries(&log);
    ensure!(
        got == want,
        "pod {name} on {node} sees [{}] in /dev/infiniband, want [{}]",
        joined(&got, ";"),
        joined(&want, ";")
    );
    Ok(Held {
        name: name.to_owned(),
        node: node.to_owned(),
        ids,
        entries: got,
    })
}

/// The log of pod `name` once its container printed its whole listing (`FI_PROVIDER` comes
/// last), within 20 s; kept in the run's logs as `pod-NAME.log`.
pub(super) fn listing(cluster: &Cluster, name: &str) -> Result<String> {
    let log = wait_for(&format!("pod {name}'s listing"), secs(20), || {
        Ok(cluster
            .kube
            .log(name)
            .ok()
            .filter(|log| log.lines().any(|line| line.starts_with("FI_PROVIDER="))))
    })?;
    fs::write(cluster.run.join(format!("logs/pod-{name}.log")), &log)?;
    Ok(log)
}

/// What a container given the EFAs `ids` of `node` (ibdev names or PCI addresses) lists in
/// `/dev/infiniband`, as [`listing_entries`] gives it.
pub(super) fn uverbs_entries(
    cluster: &mut Cluster,
    node: &str,
    ids: &[String],
) -> Result<BTreeSet<String>> {
    let efas = node_efas(cluster, node)?;
    ids.iter()
        .map(|id| {
            let efa = efas
                .iter()
                .find(|efa| &efa.ibdev == id || &efa.bdf == id)
                .with_context(|| format!("{id} is none of {node}'s EFAs"))?;
            Ok(uverbs_entry(efa))
        })
        .collect()
}

/// The [`listing_entries`] line of `efa`'s uverbs node, as testkit pairs them on the node's
/// shape.
pub(super) fn uverbs_entry(efa: &FakeDevice) -> String {
    format!(
        "c {} {} {}",
        efa.dev.major,
        efa.dev.minor,
        efa.uverbs_name()
    )
}

/// `name phase node` of each pod, for a failure's reason.
pub(super) fn summary(pods: &[Pod]) -> String {
    pods.iter()
        .map(|pod| {
            format!(
                "{} {} {}",
                pod.metadata.name, pod.status.phase, pod.spec.node_name
            )
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// An EFA as `efa-device-plugin list --output json` prints it.
#[derive(Deserialize)]
pub(super) struct Listed {
    pub(super) id: String,
    pub(super) pci_address: String,
}

/// Where the chart's values and the overlays mount the node's fake tree in the plugin pod.
const SYSFS_IN_POD: &str = "/e2e-sysfs";

/// What the operator's `list` prints in the plugin pod `pod`, run there with `kubectl exec`.
pub(super) fn listed(cluster: &Cluster, pod: &str) -> Result<Vec<Listed>> {
    let out = cluster.kube.plugin_exec(
        pod,
        &[
            "/efa-device-plugin",
            "--sysfs-root",
            SYSFS_IN_POD,
            "list",
            "--output",
            "json",
        ],
    )?;
    serde_json::from_str(&out).with_context(|| format!("list in {pod}: not JSON: {out}"))
}

/// The IDs `list` prints in `node`'s plugin pod, sorted.
fn listed_ids(cluster: &Cluster, node: &str) -> Result<Vec<String>> {
    let pod = cluster.kube.serving_plugin(node)?;
    let mut ids: Vec<String> = listed(cluster, &pod.metadata.name)?
        .into_iter()
        .map(|efa| efa.id)
        .collect();
    ids.sort();
    Ok(ids)
}

/// (F1) With the chart's defaults, every node has one Ready plugin pod, which lists exactly its
/// own node's EFAs, and the node offers their count.
pub fn one_plugin_per_node(cluster: &mut Cluster) -> Result<Detail> {
    fleet_chart(cluster, &[])?;
    let mut detail = Vec::new();
    for node in &FLEET {
        let got = listed_ids(cluster, node.name)?;
        let mut want: Vec<String> = efas_of(cluster, node)?
            .into_iter()
            .map(|efa| efa.ibdev)
            .collect();
        want.sort();
        if got != want {
            bail!(
                "the plugin on {} lists [{}], want its own EFAs [{}]",
                node.name,
                got.join(" "),
                want.join(" ")
            );
        }
        let allocatable = cluster
            .kube
            .allocatable(node.name, RESOURCE)?
            .map_or_else(|| "no".to_owned(), |count| count.to_string());
        detail.push(format!(
            "{}: {allocatable} allocatable, {} IDs",
            node.name,
            got.len()
        ));
    }
    Ok(detail.join("; "))
}
