//! (F8) One Prometheus for the fleet: every node's plugin scraped, each naming only its own
//! node's holders, and the README's per-pod and per-node queries.

use anyhow::{Context, Result, anyhow, ensure};

use super::{EFA_A, EFA_B, FLEET, NAMES, start_pod, with_chart};
use crate::cases::Detail;
use crate::cluster::Cluster;
use crate::cluster::kube::METRICS_PORT;
use crate::cluster::prometheus::Prometheus;
use crate::cluster::workload::Placement;
use crate::wait::{secs, wait_until};

const HOLD_A: &str = "hold-a";
const HOLD_B: &str = "hold-b";
/// The scrape job that finds pods by their `prometheus.io/*` annotations (the suite's
/// Prometheus config, `PROMETHEUS_JOB` in cluster/prometheus.sh).
const JOB: &str = "kubernetes-pods";
const BY_NODE: &str = "count by (node, namespace, pod) (efa_device_allocation)";
const BY_POD: &str = "count by (namespace, pod) (efa_device_allocation)";
const HEALTHY_BY_NODE: &str = "sum by (node) (efa_device_plugin_devices{health=\"healthy\"})";

/// `expr`'s result, one line per series: the values of `labels` (`-` for a missing one), then
/// the sample's value; sorted.
fn lines(prometheus: &Prometheus, expr: &str, labels: &[&str]) -> Result<Vec<String>> {
    let mut lines: Vec<String> = prometheus
        .query(expr)?
        .iter()
        .map(|sample| {
            labels
                .iter()
                .map(|label| sample.label(label))
                .chain([sample.value()])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    lines.sort();
    Ok(lines)
}

/// Whether Prometheus scrapes the Ready plugin pod of every node, and finds it up.
fn every_node_scraped(cluster: &Cluster, prometheus: &Prometheus) -> Result<bool> {
    let targets = prometheus.active_targets(JOB)?;
    for node in NAMES {
        let Some(pod) = cluster.kube.serving_plugin_pod(node)? else {
            return Ok(false);
        };
        let url = format!("http://{}:{METRICS_PORT}/metrics", pod.status.pod_ip);
        let up = targets
            .iter()
            .any(|target| target.scrape_url == url && target.health == "up");
        if pod.status.pod_ip.is_empty() || !up {
            return Ok(false);
        }
    }
    Ok(true)
}

/// (F8) With a holder on `efa-a` and one on `efa-b`, Prometheus scrapes the plugin pod of every
/// node; `efa_device_allocation` counted by the scraped pod's node names each holder on its own
/// node only; the README's count per pod gives one series per holder, and its healthy EFAs per
/// node one per node with its count.
pub fn one_prometheus(cluster: &mut Cluster) -> Result<Detail> {
    with_chart(cluster, &[HOLD_A, HOLD_B], scraped)
}

fn scraped(cluster: &mut Cluster) -> Result<Detail> {
    start_pod(cluster, HOLD_A, 2, Placement::Node(EFA_A))?;
    start_pod(cluster, HOLD_B, 4, Placement::Node(EFA_B))?;
    let prometheus = cluster.prometheus()?;
    wait_until("Prometheus scraping every node's plugin", secs(60), || {
        every_node_scraped(cluster, &prometheus).unwrap_or(false)
    })
    .map_err(|err| anyhow!("{err}: {}", prometheus.targets(JOB)))?;

    // Each plugin names its own node's holders only: the scraped pod's node is the holder's.
    let mut want = vec![
        format!("{EFA_A} default {HOLD_A} 2"),
        format!("{EFA_B} default {HOLD_B} 4"),
    ];
    want.sort();
    let by_node = ["node", "namespace", "pod"];
    wait_until(&format!("{BY_NODE} by the scraped node"), secs(60), || {
        lines(&prometheus, BY_NODE, &by_node).is_ok_and(|got| got == want)
    })
    .map_err(|err| {
        let got = lines(&prometheus, BY_NODE, &by_node).unwrap_or_default();
        anyhow!("{err}: [{}], want [{}]", got.join("|"), want.join("|"))
    })?;

    // The README's per-pod count: one series per holder, whichever node it runs on.
    let want = [format!("default {HOLD_A} 2"), format!("default {HOLD_B} 4")];
    let got = lines(&prometheus, BY_POD, &["namespace", "pod"])?;
    ensure!(
        got == want,
        "{BY_POD}: [{}], want [{}]",
        got.join("|"),
        want.join("|")
    );

    // The README's per-node capacity: one series per node, with its count.
    let mut want: Vec<String> = FLEET
        .iter()
        .map(|node| format!("{} {}", node.name, node.efas))
        .collect();
    want.sort();
    let healthy = lines(&prometheus, HEALTHY_BY_NODE, &["node"])?;
    ensure!(
        healthy == want,
        "healthy EFAs by node: [{}], want [{}]",
        healthy.join("|"),
        want.join("|")
    );
    let holders = lines(
        &prometheus,
        "count by (node, pod) (efa_device_allocation)",
        &["node", "pod"],
    )
    .context("holders by node")?;
    Ok(format!(
        "{} targets; holders by node [{}]; healthy by node [{}]",
        NAMES.len(),
        holders.join(","),
        healthy.join(",")
    ))
}
