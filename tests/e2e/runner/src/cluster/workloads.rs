//! Workloads against the installed plugin on `efa-a`: a Job gets exactly the EFAs the scheduler
//! counted for it, a pod asking for more than the node has stays Pending, and the operator's CLI
//! in the plugin pod. The arm64 group runs the Job and the CLI again against its plugin.

use anyhow::{Result, anyhow, ensure};

use super::Cluster;
use super::fleet::listed;
use super::kube::Pod;
use super::single_node::{EFAS, Overlay, efas, ensure_plugin, run_job};
use super::workload::{Placement, pod};
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::note;
use crate::wait::{secs, wait_for};

const OVER_ASK: &str = "over-ask";

/// (2) A Job limited to 2 EFAs is scheduled, sees exactly its 2 uverbs nodes and completes.
pub fn job(cluster: &mut Cluster) -> Result<Detail> {
    ensure_plugin(cluster, Overlay::P4d)?;
    job_with_plugin(cluster)
}

/// The Job of case 2, against whichever plugin serves `efa-a`.
pub fn job_with_plugin(cluster: &mut Cluster) -> Result<Detail> {
    run_job(cluster, "efa-job", 2)?;
    Ok(Detail::new())
}

/// (3) A pod asking for 5 EFAs, one more than the node has, stays Pending with the scheduler's
/// `FailedScheduling … Insufficient vpc.amazonaws.com/efa`.
pub fn over_ask(cluster: &mut Cluster) -> Result<Detail> {
    ensure_plugin(cluster, Overlay::P4d)?;
    let kube = &cluster.kube;
    kube.apply(&pod(
        OVER_ASK,
        EFAS as u32 + 1,
        "Never",
        Placement::Anywhere,
    ))?;
    let insufficient = format!("Insufficient {RESOURCE}");
    let events = wait_for(
        &format!("a FailedScheduling event naming {insufficient}"),
        secs(60),
        || {
            let events = kube.events_of(OVER_ASK);
            Ok(events
                .split('|')
                .any(|event| {
                    event.starts_with("FailedScheduling: ") && event.contains(&insufficient)
                })
                .then_some(events))
        },
    )
    .map_err(|err| {
        let phase = kube
            .pod(OVER_ASK)
            .ok()
            .flatten()
            .map(|pod| pod.status.phase);
        anyhow!(
            "{err}: phase {phase:?}, events: {}",
            kube.events_of(OVER_ASK)
        )
    })?;
    let phase = kube.pod(OVER_ASK)?.map(|pod| pod.status.phase);
    ensure!(
        phase.as_deref() == Some("Pending"),
        "pod {OVER_ASK} is {phase:?}, want Pending"
    );
    note(&format!("over-ask: {events}"));
    kube.delete_pods(&[OVER_ASK])?;
    Ok(Detail::new())
}

/// (4) `kubectl exec` of `list` in the plugin pod prints `efa-a`'s 4 EFAs.
pub fn operator_cli(cluster: &mut Cluster) -> Result<Detail> {
    let plugin = ensure_plugin(cluster, Overlay::P4d)?;
    operator_cli_in(cluster, &plugin)
}

/// `list` in the plugin pod `plugin` prints one row per EFA of the node, by its ID (the ibdev
/// name) and its PCI address; and the image is the binary alone: there is no shell to exec.
pub fn operator_cli_in(cluster: &mut Cluster, plugin: &Pod) -> Result<Detail> {
    let name = &plugin.metadata.name;
    let rows = listed(cluster, name)
        .map_err(|err| anyhow!("kubectl exec {name} -- /efa-device-plugin list: {err:#}"))?;
    let efas = efas(cluster)?;
    let found = efas
        .iter()
        .filter(|efa| {
            rows.iter()
                .any(|row| row.id == efa.ibdev && row.pci_address == efa.bdf)
        })
        .count();
    ensure!(
        found == efas.len() && rows.len() == efas.len(),
        "list printed {found} of the {} devices among {} rows: {}",
        efas.len(),
        rows.len(),
        rows.iter()
            .map(|row| format!("{} {}", row.id, row.pci_address))
            .collect::<Vec<_>>()
            .join("|")
    );
    ensure!(
        cluster
            .kube
            .plugin_exec(name, &["sh", "-c", "true"])
            .is_err(),
        "the plugin image has a shell"
    );
    Ok(Detail::new())
}
