//! Health that follows how an EFA fails in place, on the fleet's p5en node.

use std::fs;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail, ensure};
use efa_device_plugin::testkit::simulate::{FakeDevice, FakeNode, Shape, devices};

use super::fleet::serving;
use super::fleet::watch::allocatable_stays;
use super::workload::pod_on;
use super::{Cluster, NODE_STATUS_PERIOD};
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::wait::{secs, wait_until};

const NODE: &str = "efa-b";
const HOLDER: &str = "e1-holder";
const ALL: &str = "e1-all";
const TIMEOUT_ALERT: &str = "EfaAdminCommandTimeouts";
const ERRORS_ALERT: &str = "EfaAdminCommandErrors";

/// `efa-b`'s EFAs as the fleet laid them out, checked against its tree: the same layout as
/// testkit's p5en, which the case changes as the driver would.
fn efas_of(fake: &FakeNode) -> Result<Vec<FakeDevice>> {
    let efas: Vec<FakeDevice> = devices(Shape::P5en)
        .into_iter()
        .filter(FakeDevice::is_efa)
        .collect();
    for efa in &efas {
        let entry = fake.sysfs.join("class/infiniband").join(&efa.ibdev);
        let real =
            fs::canonicalize(&entry).with_context(|| format!("{} on {NODE}", entry.display()))?;
        let want = format!(
            "{}/{}/infiniband/{}",
            efa.parents.join("/"),
            efa.bdf,
            efa.ibdev
        );
        ensure!(
            real.ends_with(&want),
            "{NODE}'s {} is at {}, not at testkit's p5en place {want}",
            efa.ibdev,
            real.display()
        );
    }
    Ok(efas)
}

/// (E1) On `efa-b`, an EFA held by a pod and a free one have their admin queue closed
/// (`no_completion_cmds` rises): both leave allocatable, the holder runs on with its device
/// Unhealthy in its status, Prometheus fires the fatal alert naming the holder, and a pod
/// asking for every EFA of the node stays Pending. The free one probed again (a new device,
/// counters at 0) comes back. A third EFA with only `cmds_err` rising keeps its health and has
/// its alert.
pub fn admin_queue_closed(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("chart", &[])?;
    let prometheus = cluster.prometheus()?;
    serving(&cluster.kube, &[NODE])?;
    let fake = cluster.fake_node(NODE)?;
    let efas = efas_of(&fake)?;
    let total = efas.len() as u64;
    let checkpoint = cluster.checkpoint(NODE)?;

    let holder = cluster.kube.run_pod(&pod_on(HOLDER, 1, NODE))?;
    let held_ids = checkpoint.allocated(&holder.metadata.uid, RESOURCE);
    let [held_id] = held_ids.as_slice() else {
        bail!("the checkpoint gives the holder {held_ids:?}, want one EFA");
    };
    let by_id = |id: &str| efas.iter().find(|efa| efa.ibdev == id);
    let held =
        by_id(held_id).with_context(|| format!("the holder's {held_id} is no EFA of {NODE}"))?;
    let mut free = efas.iter().filter(|efa| efa.ibdev != *held_id);
    let (closed, erring) = (
        free.next().context("no free EFA")?,
        free.next().context("no third EFA")?,
    );

    let efa_b = EfaB {
        fake: &fake,
        held,
        closed,
        erring,
        total,
    };
    let outcome = closed_queues(cluster, &prometheus, &efa_b);
    // The node whole again for the cases after: no pod, every EFA probed anew.
    let cleaned = cluster
        .kube
        .delete_pods(&[HOLDER, ALL])
        .and_then(|()| {
            for efa in [held, closed, erring] {
                fake.remove(efa)?;
                fake.add(efa)?;
            }
            Ok(())
        })
        .and_then(|()| {
            wait_until(
                &format!("{NODE} back to {total}"),
                NODE_STATUS_PERIOD + secs(30),
                || cluster.kube.allocatable(NODE, RESOURCE).ok().flatten() == Some(total),
            )
        });
    let detail = outcome?;
    cleaned.context("restoring efa-b")?;
    Ok(detail)
}

/// `efa-b` and the three EFAs the case changes.
struct EfaB<'a> {
    fake: &'a FakeNode,
    /// The holder's EFA, whose admin queue closes.
    held: &'a FakeDevice,
    /// A free EFA whose admin queue closes, then probed again.
    closed: &'a FakeDevice,
    /// A free EFA with only `cmds_err` rising.
    erring: &'a FakeDevice,
    total: u64,
}

fn closed_queues(
    cluster: &mut Cluster,
    prometheus: &super::Prometheus,
    efa_b: &EfaB,
) -> Result<Detail> {
    let EfaB {
        fake,
        held,
        closed,
        erring,
        total,
    } = *efa_b;
    let kube = &cluster.kube;
    let allocatable = || kube.allocatable(NODE, RESOURCE).ok().flatten();
    wait_until(
        &format!("{NODE} at {total} allocatable"),
        NODE_STATUS_PERIOD + secs(30),
        || allocatable() == Some(total),
    )?;

    let rise = Instant::now();
    for efa in [held, closed] {
        fake.set_device_counter(efa, "no_completion_cmds", 1)?;
    }
    wait_until(
        &format!("{NODE}'s allocatable down by both closed EFAs"),
        NODE_STATUS_PERIOD + secs(20),
        || allocatable() == Some(total - 2),
    )
    .map_err(|err| anyhow!("{err}: allocatable {:?}", allocatable()))?;
    let to_allocatable = rise.elapsed();

    let health = if cluster.reports_device_health()? {
        wait_until(
            "the holder's device Unhealthy in its status",
            secs(30),
            || {
                kube.pod(HOLDER).ok().flatten().is_some_and(|pod| {
                    pod.device_health(RESOURCE, &held.ibdev) == Some("Unhealthy")
                })
            },
        )?;
        format!(
            "{} Unhealthy in the holder's allocatedResourcesStatus",
            held.ibdev
        )
    } else {
        "device health is not in pod status at this version".to_owned()
    };

    let holder = format!("default/{HOLDER}");
    wait_until(
        &format!(
            "{TIMEOUT_ALERT} firing for {} with holder {holder}",
            held.ibdev
        ),
        secs(90),
        || {
            prometheus
                .firing(
                    TIMEOUT_ALERT,
                    &[("device", &held.ibdev), ("holder", &holder)],
                )
                .unwrap_or(false)
        },
    )
    .map_err(|err| anyhow!("{err}: {}", prometheus.alerts(TIMEOUT_ALERT)))?;
    let to_alert = rise.elapsed();
    // The reason, bounded to the words the metric allows, as the runbook reads it.
    let by_reason = format!(
        "efa_device_plugin_unhealthy_devices{{node=\"{NODE}\", reason=\"admin_queue_closed\"}} == 2"
    );
    wait_until(
        "both counted Unhealthy for admin_queue_closed",
        secs(30),
        || {
            prometheus
                .query(&by_reason)
                .is_ok_and(|samples| samples.len() == 1)
        },
    )?;
    wait_until(
        &format!("{TIMEOUT_ALERT} firing for the free {}", closed.ibdev),
        secs(30),
        || {
            prometheus
                .firing(TIMEOUT_ALERT, &[("device", &closed.ibdev), ("holder", "")])
                .unwrap_or(false)
        },
    )
    .map_err(|err| anyhow!("{err}: {}", prometheus.alerts(TIMEOUT_ALERT)))?;

    let pod = kube.pod(HOLDER)?.context("the holder is gone")?;
    ensure!(
        pod.status.phase == "Running" && pod.restarts() == 0,
        "the holder is {} with {} restarts, want Running with none",
        pod.status.phase,
        pod.restarts()
    );

    kube.apply(&pod_on(ALL, total as u32, NODE))?;
    wait_until(&format!("{ALL} Pending for {RESOURCE}"), secs(30), || {
        kube.pod(ALL)
            .ok()
            .flatten()
            .is_some_and(|pod| pod.pending_for(RESOURCE))
    })
    .map_err(|err| anyhow!("{err}: {}", kube.events_of(ALL)))?;

    // The driver's reset: the device goes and comes back with counters at 0.
    fake.remove(closed)?;
    fake.add(closed)?;
    let probed = Instant::now();
    wait_until(
        &format!("{NODE}'s allocatable up by the re-created {}", closed.ibdev),
        NODE_STATUS_PERIOD + secs(20),
        || allocatable() == Some(total - 1),
    )
    .map_err(|err| anyhow!("{err}: allocatable {:?}", allocatable()))?;
    let to_back = probed.elapsed();
    let still_pending = kube
        .pod(ALL)?
        .is_some_and(|pod| pod.status.phase == "Pending");
    ensure!(
        still_pending,
        "{ALL} left Pending with one EFA still closed"
    );

    let erred = Instant::now();
    fake.set_device_counter(erring, "cmds_err", 5)?;
    wait_until(
        &format!("{ERRORS_ALERT} firing for {}", erring.ibdev),
        secs(90),
        || {
            prometheus
                .firing(
                    ERRORS_ALERT,
                    &[("device", &erring.ibdev), ("counter", "cmds_err")],
                )
                .unwrap_or(false)
        },
    )
    .map_err(|err| anyhow!("{err}: {}", prometheus.alerts(ERRORS_ALERT)))?;
    let to_errors_alert = erred.elapsed();
    allocatable_stays(kube, NODE, total - 1, secs(4)).context("cmds_err alone")?;

    Ok(format!(
        "{} (held) and {} closed: allocatable {total} -> {} after {:.1}s, {TIMEOUT_ALERT} naming {holder} after {:.1}s, unhealthy_devices{{reason=admin_queue_closed}} 2; {health}; {ALL} Pending; {} probed again: {} after {:.1}s; cmds_err on {}: {ERRORS_ALERT} after {:.1}s, allocatable unchanged",
        held.ibdev,
        closed.ibdev,
        total - 2,
        to_allocatable.as_secs_f64(),
        to_alert.as_secs_f64(),
        closed.ibdev,
        total - 1,
        to_back.as_secs_f64(),
        erring.ibdev,
        to_errors_alert.as_secs_f64(),
    ))
}
