//! What restarts on one node leave of the others: a rollout across the fleet (F4), and `efa-a`'s
//! kubelet and plugin restarted beside `efa-b` (F7), both watched from the API meanwhile.

use std::thread::sleep;

use anyhow::{Context, Result, anyhow, ensure};

use super::watch::{Sample, rollout as rolled_out_across, steady, watching};
use super::{
    EFA_A, EFA_B, FLEET, NAMES, check_devices, fleet_node, serving, start_pod, summary, with_chart,
};
use crate::cases::Detail;
use crate::cluster::workload::Placement;
use crate::cluster::{Cluster, NODE_STATUS_PERIOD};
use crate::node::RESOURCE;
use crate::plugin::sample;
use crate::pods::joined;
use crate::wait::{secs, wait_until};

const HOLD_A: &str = "hold-a";
const HOLD_B: &str = "hold-b";
const HELD_B: &str = "held-b";
const REGISTRATIONS: &str = "efa_device_plugin_registrations_total";

/// (F4) A `helm upgrade` rolls the DaemonSet across the fleet: never two nodes without a plugin,
/// each node's allocatable back, and holders on both EFA nodes keep their pod and device nodes.
pub fn rollout(cluster: &mut Cluster) -> Result<Detail> {
    with_chart(cluster, &[HOLD_A, HOLD_B], upgraded)
}

/// A holder as a user sees it: its UID and the device nodes its container sees now.
fn holder(cluster: &Cluster, name: &str) -> Result<String> {
    let pod = cluster
        .kube
        .pod(name)?
        .with_context(|| format!("pod {name} is gone"))?;
    Ok(format!(
        "{} {}",
        pod.metadata.uid,
        joined(&cluster.kube.device_nodes(name)?, ";")
    ))
}

fn upgraded(cluster: &mut Cluster) -> Result<Detail> {
    start_pod(cluster, HOLD_A, 2, Placement::Node(EFA_A))?;
    start_pod(cluster, HOLD_B, 4, Placement::Node(EFA_B))?;
    let before = [holder(cluster, HOLD_A)?, holder(cluster, HOLD_B)?];
    let (rolled, samples) = watching(&cluster.kube, || -> Result<()> {
        sleep(secs(2));
        cluster
            .host
            .request("upgrade", &["--set", "config.log-level=debug"])
            .context("helm upgrade")?;
        cluster
            .kube
            .plugin_rolled_out(secs(300))
            .context("the rollout did not complete within 300s")?;
        serving(&cluster.kube, &NAMES)?;
        sleep(secs(2));
        Ok(())
    });
    rolled.map_err(|err| {
        let pods = cluster
            .kube
            .all_plugin_pods()
            .map_or_else(|err| format!("{err:#}"), |pods| summary(&pods));
        anyhow!("{err:#}; last: {}; {pods}", last_sample(&samples))
    })?;
    let want: Vec<(&str, u64)> = FLEET.iter().map(|node| (node.name, node.efas)).collect();
    let detail = rolled_out_across(&samples, &want, NODE_STATUS_PERIOD + secs(30))?;
    let after = [holder(cluster, HOLD_A)?, holder(cluster, HOLD_B)?];
    ensure!(
        after == before,
        "a holder changed across the rollout: {HOLD_A} [{}] -> [{}], {HOLD_B} [{}] -> [{}]",
        before[0],
        after[0],
        before[1],
        after[1]
    );
    for name in [HOLD_A, HOLD_B] {
        let restarts = cluster.kube.pod(name)?.map(|pod| pod.restarts());
        ensure!(
            restarts == Some(0),
            "{name}'s container restarted during the rollout ({restarts:?} restarts)"
        );
    }
    Ok(format!("{detail}; holders kept their devices"))
}

/// Each node of the last sample: `node serving allocatable`.
fn last_sample(samples: &[Sample]) -> String {
    samples.last().map_or_else(
        || "no samples".to_owned(),
        |sample| {
            sample
                .nodes
                .iter()
                .map(|(node, state)| {
                    format!(
                        "{node} {} {}",
                        u8::from(state.serving),
                        state.allocatable.as_deref().unwrap_or("-")
                    )
                })
                .collect::<Vec<_>>()
                .join("|")
        },
    )
}

/// (F7) `efa-a`'s kubelet restarted, then its plugin container killed: `efa-b`'s registrations,
/// allocatable and its holder's restarts stay as they were, and its allocatable never moves
/// meanwhile.
pub fn isolation(cluster: &mut Cluster) -> Result<Detail> {
    with_chart(cluster, &[HELD_B], isolated)
}

/// `efa-b` as its plugin pod `plugin` and the API show it: the plugin's registrations, the
/// node's allocatable and the holder's restarts.
fn efa_b_state(cluster: &Cluster, plugin: &str) -> Result<String> {
    let kube = &cluster.kube;
    let pod = kube
        .plugin_pods(EFA_B)?
        .into_iter()
        .find(|pod| pod.metadata.name == plugin)
        .with_context(|| format!("{EFA_B}'s plugin pod {plugin} is gone"))?;
    let metrics = pod.plugin_http("/metrics")?;
    let registrations = sample(&metrics, REGISTRATIONS).unwrap_or("none");
    let allocatable = kube
        .allocatable(EFA_B, RESOURCE)?
        .map_or_else(|| "none".to_owned(), |count| count.to_string());
    let restarts = kube
        .pod(HELD_B)?
        .with_context(|| format!("pod {HELD_B} is gone"))?
        .restarts();
    Ok(format!("{registrations} {allocatable} {restarts}"))
}

fn isolated(cluster: &mut Cluster) -> Result<Detail> {
    start_pod(cluster, HELD_B, 2, Placement::Node(EFA_B))?;
    let plugin = cluster.kube.serving_plugin(EFA_B)?.metadata.name;
    let before = efa_b_state(cluster, &plugin)?;
    let (disturbed, samples) = watching(&cluster.kube, || -> Result<()> {
        cluster
            .host
            .request("restart_kubelet", &[EFA_A])
            .with_context(|| format!("{EFA_A} not Ready after its kubelet restarted"))?;
        serving(&cluster.kube, &[EFA_A])?;
        let pod = cluster.kube.serving_plugin(EFA_A)?;
        let container = pod
            .status
            .container_statuses
            .first()
            .and_then(|status| status.container_id.strip_prefix("containerd://"))
            .with_context(|| format!("{} has no container", pod.metadata.name))?;
        cluster
            .host
            .request("kill_container", &[EFA_A, container])
            .with_context(|| format!("cannot kill the plugin container on {EFA_A}"))?;
        let kube = &cluster.kube;
        wait_until(
            &format!("the plugin on {EFA_A} restarted"),
            secs(60),
            || {
                kube.plugin_pods(EFA_A).is_ok_and(|pods| {
                    pods.iter()
                        .any(|p| p.metadata.name == pod.metadata.name && p.restarts() >= 1)
                })
            },
        )?;
        serving(&cluster.kube, &[EFA_A])
    });
    disturbed?;
    let after = efa_b_state(cluster, &plugin)?;
    ensure!(
        after == before,
        "on {EFA_B}, registrations, allocatable and the holder's restarts went from [{before}] to [{after}]"
    );
    let efas = fleet_node(EFA_B)?.efas;
    let count = steady(&samples, EFA_B, efas)
        .map_err(|seen| anyhow!("{EFA_B}'s allocatable changed meanwhile: {seen}"))?;
    check_devices(cluster, HELD_B, 2, EFA_B)?;
    Ok(format!(
        "{EFA_B} unchanged (registrations, allocatable, holder restarts: {after}) over {count} samples"
    ))
}
