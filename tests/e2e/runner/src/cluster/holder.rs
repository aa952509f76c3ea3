//! What the plugin reports about the EFAs a running pod holds on `efa-a`, and how that survives
//! change: metrics naming the holder, a rolling update of the DaemonSet that keeps the holder's
//! devices, and a device node that goes and comes back. Each case runs against the holder of
//! [`ensure_holder`].

use std::time::Instant;

use anyhow::{Context, Result, anyhow, ensure};

use super::kube::Pod;
use super::single_node::{EFAS, HOLDER, NODE, Overlay, efas, ensure_holder, ensure_plugin, shown};
use super::{Cluster, NODE_STATUS_PERIOD};
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::plugin::allocation_series;
use crate::wait::{secs, wait_for, wait_until};

/// The line the plugin's metrics show with all of `efa-a`'s EFAs healthy.
fn all_healthy() -> String {
    format!("efa_device_plugin_devices{{health=\"healthy\"}} {EFAS}")
}

/// (5) A scrape of the plugin pod's IP shows 4 healthy EFAs and, for each of the holder's 2,
/// its counters and exactly one `efa_device_allocation` naming its namespace, pod and container.
pub fn metrics(cluster: &mut Cluster) -> Result<Detail> {
    let plugin = ensure_plugin(cluster, Overlay::P4d)?;
    metrics_of(cluster, &plugin)
}

/// Case 5 against the plugin pod `plugin`.
pub fn metrics_of(cluster: &mut Cluster, plugin: &Pod) -> Result<Detail> {
    let holder = ensure_holder(cluster)?;
    let efas = efas(cluster)?;
    // An ID is the ibdev name, or with device-id-strategy pci the PCI address.
    let ibdevs = holder
        .ids
        .iter()
        .map(|id| {
            efas.iter()
                .find(|efa| &efa.ibdev == id || &efa.bdf == id)
                .map(|efa| (id.as_str(), efa.ibdev.as_str()))
                .with_context(|| format!("the holder's {id} is none of {NODE}'s EFAs"))
        })
        .collect::<Result<Vec<_>>>()?;
    let shows_holder = |metrics: &str, id: &str, ibdev: &str| {
        let device = format!("device=\"{id}\"");
        let named = format!("ibdev=\"{ibdev}\"");
        let counters = metrics.lines().any(|line| {
            line.starts_with("efa_")
                && line
                    .split('{')
                    .next()
                    .is_some_and(|family| family.ends_with("_total"))
                && line.contains('{')
                && line.contains(&device)
                && line.contains(&named)
        });
        let allocation = format!(
            "efa_device_allocation{{device=\"{id}\",namespace=\"default\",pod=\"{HOLDER}\",container=\"probe\"}} 1"
        );
        counters && metrics.lines().any(|line| line == allocation)
    };
    let mut last = None;
    // The plugin learns holders from the kubelet once per rescan interval (5 s), so a scrape
    // right after the pod starts may still show the pods before it.
    let shown = wait_until("the holder's EFAs in the metrics", secs(15), || {
        let Ok(metrics) = plugin.plugin_http("/metrics") else {
            return false;
        };
        let held = ibdevs
            .iter()
            .filter(|(id, ibdev)| shows_holder(&metrics, id, ibdev))
            .count();
        let whole = metrics.lines().any(|line| line == all_healthy())
            && held == holder.ids.len()
            && allocation_series(&metrics, HOLDER) == holder.ids.len();
        last = Some((metrics, held));
        whole
    });
    if shown.is_ok() {
        return Ok(Detail::new());
    }
    Err(match last {
        None => anyhow!(
            "no answer from http://{}:9465/metrics",
            plugin.status.pod_ip
        ),
        Some((metrics, _)) if !metrics.lines().any(|line| line == all_healthy()) => anyhow!(
            "metrics lack {}: {}",
            all_healthy(),
            lines_of(&metrics, "efa_device_plugin_devices", usize::MAX)
        ),
        Some((metrics, held)) => anyhow!(
            "after 15s {held} of the holder's {} EFAs have counters and an efa_device_allocation naming its namespace, pod and container: {}",
            holder.ids.len(),
            lines_of(&metrics, "efa_device_allocation{", 3)
        ),
    })
}

/// The first `count` lines of `metrics` that start with `prefix`, joined by `|`.
fn lines_of(metrics: &str, prefix: &str, count: usize) -> String {
    metrics
        .lines()
        .filter(|line| line.starts_with(prefix))
        .take(count)
        .collect::<Vec<_>>()
        .join("|")
}

/// (6) `kubectl rollout restart` of the DaemonSet: a new plugin pod becomes Ready, the holder
/// keeps running with its devices, allocatable returns to 4; the line says how long the Node
/// showed fewer.
pub fn rolling_update(cluster: &mut Cluster) -> Result<Detail> {
    let holder = ensure_holder(cluster)?;
    let kube = &cluster.kube;
    let old = kube
        .serving_plugin_pod(NODE)?
        .context("no serving plugin pod")?
        .metadata
        .name;
    kube.restart_plugin_rollout()?;
    // Each poll samples allocatable, adding up the time the node showed fewer than 4.
    let mut lowest = EFAS;
    let mut below_since: Option<Instant> = None;
    let mut below = std::time::Duration::ZERO;
    let mut last = (None, String::new());
    wait_until(
        "a new plugin pod Ready with 4 allocatable",
        secs(180),
        || {
            let count = kube.allocatable(NODE, RESOURCE).ok().flatten();
            if count == Some(EFAS) {
                if let Some(since) = below_since.take() {
                    below += since.elapsed();
                }
            } else {
                below_since.get_or_insert_with(Instant::now);
                lowest = lowest.min(count.unwrap_or(EFAS));
            }
            let new = kube
                .serving_plugin_pod(NODE)
                .ok()
                .flatten()
                .map(|pod| pod.metadata.name)
                .unwrap_or_default();
            let done = !new.is_empty() && new != old && count == Some(EFAS);
            last = (count, new);
            done
        },
    )
    .map_err(|err| {
        anyhow!(
            "{err}: ready pod '{}' (old {old}), allocatable {}",
            last.1,
            shown(last.0)
        )
    })?;
    let pod = kube.pod(HOLDER)?;
    let phase = pod.as_ref().map(|pod| pod.status.phase.as_str());
    ensure!(
        phase == Some("Running"),
        "holder is {phase:?} after the rollout"
    );
    let uid = pod.map(|pod| pod.metadata.uid).unwrap_or_default();
    let ids = cluster.checkpoint(NODE)?.allocated(&uid, RESOURCE);
    ensure!(
        ids == holder.ids,
        "holder's devices changed across the rollout: [{}] -> [{}]",
        holder.ids.join(" "),
        ids.join(" ")
    );
    Ok(if below.is_zero() {
        "node never showed fewer than 4 allocatable".to_owned()
    } else {
        format!(
            "node showed fewer than 4 allocatable for {:.3}s, lowest {lowest}",
            below.as_secs_f64()
        )
    })
}

/// (7) The device node of one of the holder's EFAs removed: allocatable 3 within the kubelet's
/// node-status period and 2 s, the holder's `allocatedResourcesStatus` shows it Unhealthy where
/// the kubelet reports device health; restored, both come back.
pub fn device_loss(cluster: &mut Cluster) -> Result<Detail> {
    let holder = ensure_holder(cluster)?;
    let gone = holder
        .ids
        .first()
        .context("the holder holds no EFA")?
        .clone();
    let efa = efas(cluster)?
        .into_iter()
        .find(|efa| efa.ibdev == gone || efa.bdf == gone)
        .with_context(|| format!("the holder's {gone} is none of {NODE}'s EFAs"))?;
    let fake = cluster.fake_node(NODE)?;
    fake.remove_node(&efa)?;
    let outcome = lost_and_back(cluster, &gone, &efa);
    // The node back whatever happened, for the cases after.
    let restored = if fake.node_path(&efa).exists() {
        Ok(())
    } else {
        fake.create_node(&efa)
    };
    let detail = outcome?;
    restored.with_context(|| format!("recreate {}", fake.node_path(&efa).display()))?;
    Ok(detail)
}

fn lost_and_back(
    cluster: &mut Cluster,
    gone: &str,
    efa: &efa_device_plugin::testkit::simulate::FakeDevice,
) -> Result<Detail> {
    let within = NODE_STATUS_PERIOD + secs(2);
    let allocatable = |cluster: &Cluster| cluster.kube.allocatable(NODE, RESOURCE).ok().flatten();
    let start = Instant::now();
    wait_until(
        &format!("allocatable 3 after {} went", efa.uverbs_name()),
        within,
        || allocatable(cluster) == Some(EFAS - 1),
    )
    .map_err(|err| anyhow!("{err}: allocatable is {}", shown(allocatable(cluster))))?;
    let mut detail = format!("3 after {:.1}s", start.elapsed().as_secs_f64());
    let health = cluster.reports_device_health()?;
    let holder_shows = |cluster: &Cluster, health: &str| -> Result<()> {
        wait_for(
            &format!("the holder's {gone} {health} in allocatedResourcesStatus"),
            secs(30),
            || {
                let pod = cluster.kube.pod(HOLDER)?;
                Ok(pod.filter(|pod| pod.device_health(RESOURCE, gone) == Some(health)))
            },
        )
        .map(drop)
        .map_err(|err| {
            let status = cluster
                .kube
                .pod(HOLDER)
                .ok()
                .flatten()
                .and_then(|pod| pod.device_health(RESOURCE, gone).map(str::to_owned));
            anyhow!("{err}: the holder's status shows {gone} as {status:?}")
        })
    };
    if health {
        holder_shows(cluster, "Unhealthy")?;
    }
    cluster.fake_node(NODE)?.create_node(efa)?;
    wait_until(
        &format!("allocatable 4 after {} came back", efa.uverbs_name()),
        within,
        || allocatable(cluster) == Some(EFAS),
    )
    .map_err(|err| anyhow!("{err}: allocatable is {}", shown(allocatable(cluster))))?;
    if health {
        holder_shows(cluster, "Healthy")?;
        detail.push_str(&format!(
            "; holder's {gone} Unhealthy in allocatedResourcesStatus"
        ));
    } else {
        detail.push_str("; pod-status health not shown: ResourceHealthStatus is not available in this Kubernetes version");
    }
    Ok(detail)
}
