//! A node that joins late with a pod waiting for it, as Karpenter adds one (F5): how long from
//! the node Ready until its plugin serves, it offers EFAs and the pod runs, for this plugin and
//! for the AWS plugin's stand-in installed the AWS way. The suite's bash joins each node (a p4d)
//! and removes it again.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

use super::fleet_chart;
use crate::cases::Detail;
use crate::cluster::Cluster;
use crate::cluster::kube::plugin_selector;
use crate::cluster::workload::pod_on;
use crate::node::RESOURCE;
use crate::stats::median;
use crate::wait::{secs, wait_until};

/// Joins per plugin: the line gives their medians.
const ROUNDS: u32 = 3;
/// The pod that waits, Pending, for the node that joins.
const WAITING: &str = "late";
/// The label the AWS chart gives its pods: its release's name.
const STANDIN_SELECTOR: &str = "name=aws-efa-k8s-device-plugin";

/// (F5) Three joins with this plugin's chart installed, then three with the AWS plugin's
/// stand-in in its place; the line gives the medians of each.
pub fn late_join(cluster: &mut Cluster) -> Result<Detail> {
    fleet_chart(cluster, &[])?;
    let ours = medians(cluster, "efa-late", &plugin_selector())?;
    cluster.host.request("standin", &[])?;
    let theirs = medians(cluster, "efa-late-aws", STANDIN_SELECTOR);
    let removed = cluster.host.request("standin_uninstall", &[]);
    let theirs = theirs?;
    removed?;
    crate::note(&format!("F5 join medians: ours [{ours}], aws [{theirs}]"));
    Ok(format!(
        "medians over {ROUNDS} joins from node Ready: this plugin: {ours}; AWS stand-in: {theirs}"
    ))
}

/// From the node Ready: to its plugin pod Ready, to allocatable above 0, to the waiting pod
/// Running.
struct Join {
    plugin: Duration,
    allocatable: Duration,
    running: Duration,
}

/// [`ROUNDS`] joins of nodes named `prefix-1` …, whose plugin pods `selector` selects: the
/// medians of each figure.
fn medians(cluster: &mut Cluster, prefix: &str, selector: &str) -> Result<String> {
    let mut joins = Vec::new();
    for round in 1..=ROUNDS {
        joins.push(join_once(cluster, &format!("{prefix}-{round}"), selector)?);
    }
    let of = |figure: fn(&Join) -> Duration| {
        median(
            &joins
                .iter()
                .map(|join| figure(join).as_secs_f64())
                .collect::<Vec<_>>(),
        )
    };
    Ok(format!(
        "plugin Ready {:.1}s, allocatable {:.1}s, pod Running {:.1}s",
        of(|join| join.plugin),
        of(|join| join.allocatable),
        of(|join| join.running)
    ))
}

/// With the pod [`WAITING`] Pending for 2 EFAs on `node`, `node` joins; it and the pod go
/// afterwards, whatever the outcome.
fn join_once(cluster: &mut Cluster, node: &str, selector: &str) -> Result<Join> {
    cluster
        .kube
        .apply(&pod_on(WAITING, 2, node))
        .with_context(|| format!("pod {WAITING} not accepted"))?;
    let joined = cluster
        .host
        .request("join", &[node])
        .and_then(|_| measure(cluster, node, selector));
    // Forced: the node goes next, and a pod on a node that is gone waits for the pod GC.
    let deleted = cluster.kube.force_delete_pod(WAITING);
    let left = cluster.host.request("leave", &[node]);
    let join = joined?;
    deleted?;
    left?;
    Ok(join)
}

/// [`join_once`]'s figures, from now: `node` just became Ready.
fn measure(cluster: &Cluster, node: &str, selector: &str) -> Result<Join> {
    let ready = Instant::now();
    let kube = &cluster.kube;
    wait_until(
        &format!("a Ready plugin pod ({selector}) on {node}"),
        secs(120),
        || {
            kube.serving_pod(selector, node)
                .is_ok_and(|pod| pod.is_some())
        },
    )?;
    let plugin = ready.elapsed();
    wait_until(
        &format!("{RESOURCE} allocatable on {node}"),
        secs(120),
        || {
            kube.allocatable(node, RESOURCE)
                .is_ok_and(|count| count.is_some_and(|count| count > 0))
        },
    )?;
    let allocatable = ready.elapsed();
    wait_until(
        &format!("pod {WAITING} Running on {node}"),
        secs(120),
        || {
            kube.pod(WAITING)
                .is_ok_and(|pod| pod.is_some_and(|pod| pod.status.phase == "Running"))
        },
    )
    .map_err(|err| anyhow!("{err}: {}", kube.events_of(WAITING)))?;
    Ok(Join {
        plugin,
        allocatable,
        running: ready.elapsed(),
    })
}
