//! Where the scheduler puts pods on the fleet: by each node's count (F3), and off a drained
//! node (F9).

use std::collections::BTreeMap;

use anyhow::{Context, Result, anyhow, bail, ensure};

use super::{
    EFA_A, EFA_B, FLEET, Held, PLAIN, check_devices, fleet_chart, serving, start_pod, summary,
    with_chart,
};
use crate::cases::Detail;
use crate::cluster::kube::Pod;
use crate::cluster::workload::{Placement, deployment, pod};
use crate::cluster::{Cluster, Kube};
use crate::node::RESOURCE;
use crate::wait::{secs, wait_for, wait_until};

const BIG: &str = "big";
const HUGE: &str = "huge";
const FOURS: [&str; 6] = ["four-1", "four-2", "four-3", "four-4", "four-5", "four-6"];
const TRAINER: &str = "trainer";
const TRAINER_PODS: &str = "app=trainer";

/// (F3) 5 EFAs fit `efa-b` only; 17, more than any node has though the fleet has 20, stay
/// Pending; of six pods of 4, one lands on `efa-a`, four on `efa-b`, none on `plain`, and one
/// waits.
pub fn placement(cluster: &mut Cluster) -> Result<Detail> {
    let pods: Vec<&str> = [BIG, HUGE].into_iter().chain(FOURS).collect();
    with_chart(cluster, &pods, placed_by_count)
}

fn placed_by_count(cluster: &mut Cluster) -> Result<Detail> {
    let most = FLEET.iter().map(|node| node.efas).max().unwrap_or(0);
    // More than efa-a has: the scheduler can only pick efa-b.
    let big = start_pod(cluster, BIG, 5, Placement::Anywhere)?;
    ensure!(
        big.node == EFA_B,
        "pod {BIG} runs on '{}', want {EFA_B}",
        big.node
    );
    let kube = &cluster.kube;
    kube.delete_pods(&[BIG])?;

    // More than any node has, less than the fleet has.
    let over = most + 1;
    kube.apply(&pod(HUGE, over as u32, "Never", Placement::Anywhere))?;
    wait_until(
        &format!("pod {HUGE} asking for {over} Pending for {RESOURCE}"),
        secs(30),
        || {
            kube.pod(HUGE)
                .ok()
                .flatten()
                .is_some_and(|pod| pod.pending_for(RESOURCE))
        },
    )
    .map_err(|err| anyhow!("{err}: {}", kube.events_of(HUGE)))?;
    kube.delete_pods(&[HUGE])?;

    // Pods of 4: one fits on efa-a, four on efa-b, none on plain, the rest wait.
    for name in FOURS {
        kube.apply(&pod(name, 4, "Never", Placement::Anywhere))?;
    }
    wait_until("5 pods of 4 Running, 1 Pending", secs(90), || {
        let pods = fours(kube);
        let running = pods
            .iter()
            .filter(|pod| pod.status.phase == "Running")
            .count();
        let waiting = pods.iter().filter(|pod| pod.pending_for(RESOURCE)).count();
        running == 5 && waiting == 1
    })
    .map_err(|err| anyhow!("{err}: {}", summary(&fours(kube))))?;
    let mut on: BTreeMap<String, usize> = BTreeMap::new();
    for pod in fours(kube) {
        let node = &pod.spec.node_name;
        if node.is_empty() {
            continue;
        }
        *on.entry(node.clone()).or_default() += 1;
        if pod.status.phase == "Running" {
            check_devices(cluster, &pod.metadata.name, 4, node)?;
        }
    }
    let count = |node: &str| on.get(node).copied().unwrap_or(0);
    if count(EFA_A) != 1 || count(EFA_B) != 4 || count(PLAIN) != 0 {
        bail!(
            "pods of 4 landed: {}, want 1 on {EFA_A}, 4 on {EFA_B}, none on {PLAIN}",
            summary(&fours(&cluster.kube))
        );
    }
    Ok(format!(
        "5 on {EFA_B}; {over} Pending (Insufficient); pods of 4: 1 on {EFA_A}, 4 on {EFA_B}, 1 Pending"
    ))
}

/// The pods of 4 that exist.
fn fours(kube: &Kube) -> Vec<Pod> {
    FOURS
        .iter()
        .filter_map(|name| kube.pod(name).ok().flatten())
        .collect()
}

/// The one Running pod of the Deployment that is not terminating; `None` otherwise.
fn trainer_pod(cluster: &Cluster) -> Result<Option<Pod>> {
    let mut running: Vec<Pod> = cluster
        .kube
        .pods_labelled(TRAINER_PODS)?
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none() && pod.status.phase == "Running")
        .collect();
    Ok((running.len() == 1).then(|| running.remove(0)))
}

/// The Deployment's pod Running on `node` within 60 s, with exactly its 2 EFAs.
fn trainer_on(cluster: &mut Cluster, node: &str, what: &str) -> Result<Held> {
    let trainer = wait_for(&format!("{what} Running on {node}"), secs(60), || {
        Ok(trainer_pod(cluster)?.filter(|pod| pod.spec.node_name == node))
    })
    .map_err(|err| {
        let pods = cluster.kube.pods_labelled(TRAINER_PODS);
        anyhow!(
            "{err}: {}",
            pods.map_or_else(|err| format!("{err:#}"), |pods| summary(&pods))
        )
    })?;
    check_devices(cluster, &trainer.metadata.name, 2, node)
}

/// (F9) A Deployment's pod, on `efa-a` by preference, moves to `efa-b` with `efa-b`'s EFAs when
/// `efa-a` is drained; uncordoned, `efa-a` offers its 4 again.
pub fn drain(cluster: &mut Cluster) -> Result<Detail> {
    fleet_chart(cluster, &[])?;
    let moved = replaced_off_the_drained_node(cluster);
    let uncordoned = cluster.kube.run(&["uncordon", EFA_A]);
    let outcome = moved.and_then(|replacement| {
        uncordoned.context("uncordon")?;
        serving(&cluster.kube, &[EFA_A])?;
        let allocatable = cluster.kube.allocatable(EFA_A, RESOURCE)?;
        Ok(format!(
            "replacement {} on {EFA_B} with [{}]; {EFA_A} back to {} allocatable",
            replacement.name,
            replacement.ids.join(" "),
            allocatable.map_or_else(String::new, |count| count.to_string())
        ))
    });
    let kube = &cluster.kube;
    let removed = kube
        .delete(&[&format!("deployment/{TRAINER}")])
        .and_then(|()| {
            wait_until(&format!("no pod of {TRAINER} left"), secs(60), || {
                kube.pods_labelled(TRAINER_PODS)
                    .is_ok_and(|pods| pods.is_empty())
            })
        });
    let detail = outcome?;
    removed?;
    Ok(detail)
}

fn replaced_off_the_drained_node(cluster: &mut Cluster) -> Result<Held> {
    cluster
        .kube
        .apply(&deployment(TRAINER, 2, Placement::Prefer(EFA_A)))?;
    trainer_on(cluster, EFA_A, TRAINER)?;
    cluster
        .kube
        .run(&[
            "drain",
            EFA_A,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=90s",
        ])
        .map_err(|err| {
            let said = format!("{err:#}");
            let last: Vec<&str> = said.lines().rev().take(2).collect();
            anyhow!(
                "drain of {EFA_A} failed: {}",
                last.into_iter().rev().collect::<Vec<_>>().join("|")
            )
        })?;
    trainer_on(cluster, EFA_B, &format!("{TRAINER}'s replacement"))
}
