//! Node mode beside the DaemonSet on one fleet: the plugin run the way its systemd unit runs it,
//! on the node in the host's namespaces.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail, ensure};

use super::fleet::serving;
use super::fleet::watch::allocatable_stays;
use super::workload::pod_on;
use super::{Cluster, Prometheus};
use crate::cases::Detail;
use crate::daemon::Daemon;
use crate::kubelet::registrations_in;
use crate::node::RESOURCE;
use crate::plugin::Plugin;
use crate::reboot::{Unit, start_node_mode};
use crate::wait::{secs, wait_for, wait_until};

/// The node in the host's namespaces, where a plugin started by the runner sees what the node's
/// kubelet sees.
const NODE: &str = "efa-a";
const EFAS: u64 = 4;
/// The label the node-mode recipes set through the kubelet's `--node-labels`, which keeps the
/// DaemonSet off the node (docs/node-mode.md).
pub const LABEL: &str = "efa-device-plugin/node-mode";
/// What the plugin that comes second says when the first holds the device-plugin dir's lock.
const SECOND: &str = "holds the dir's lock";
/// The scrape job docs/node-mode.md gives, which the suite's Prometheus runs as written there.
const SCRAPE_JOB: &str = "efa-device-plugin-node-mode";
const FIRST_POD: &str = "f11-first";
const SECOND_POD: &str = "f11-second";

/// The plugin on `efa-a` as its systemd unit runs it: started with the unit's `ExecStart` and
/// awaited until `READY=1`, as systemd does before it starts the kubelet.
pub struct Service {
    unit: Unit,
    plugin: Plugin,
    running: Option<Daemon>,
}

impl Service {
    pub fn on_efa_a(cluster: &mut Cluster) -> Result<Service> {
        let unit = Unit::read()?;
        ensure!(
            unit.kind == "notify",
            "the unit is Type={}, want notify",
            unit.kind
        );
        let plugin = Plugin::new(
            cluster.plugin.clone(),
            cluster.host_path(NODE, "/run/efa-device-plugin-e2e/sys")?,
            PathBuf::from("/dev"),
            cluster.host_path(NODE, "/var/lib/kubelet/device-plugins")?,
            cluster.pod_resources(NODE)?,
            cluster.run.clone(),
        );
        Ok(Service {
            unit,
            plugin,
            running: None,
        })
    }

    /// Starts it; `start` names this start's log.
    pub fn start(&mut self, start: &str) -> Result<()> {
        ensure!(self.running.is_none(), "node mode runs already");
        self.running = Some(start_node_mode(&self.plugin, &self.unit, start)?);
        Ok(())
    }

    /// Stops it, if it runs, as systemd does: SIGTERM, then SIGKILL after a grace period.
    pub fn stop(&mut self) -> Result<()> {
        match self.running.take() {
            Some(daemon) => daemon.stop(secs(10)).map(drop),
            None => Ok(()),
        }
    }

    /// How it exited, if it ran and did.
    pub fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match &mut self.running {
            Some(daemon) => daemon.exited(),
            None => bail!("node mode was not started"),
        }
    }
}

/// (F11) One plugin per node: with the label, `efa-a` gets no DaemonSet pod and node mode serves
/// it; without it, the DaemonSet's pod comes second, says so and never registers, while node
/// mode keeps the node's allocatable and gives each pod EFAs of its own.
pub fn one_plugin_per_node(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("chart", &[])?;
    serving(&cluster.kube, &[NODE])?;
    let prometheus = cluster.prometheus()?;
    let mut service = Service::on_efa_a(cluster)?;
    let outcome = beside_the_daemonset(cluster, &prometheus, &mut service);
    // The node as the chart serves it again: no label, node mode gone, and the DaemonSet's pod
    // started anew instead of waiting out its back-off.
    let kube = &cluster.kube;
    let restored = kube
        .delete_pods(&[FIRST_POD, SECOND_POD])
        .and_then(|()| kube.label_node(NODE, LABEL, None))
        .and_then(|()| service.stop())
        .and_then(|()| {
            for pod in kube.plugin_pods(NODE)? {
                kube.run(&[
                    "delete",
                    "pod",
                    "-n",
                    "kube-system",
                    &pod.metadata.name,
                    "--wait",
                ])?;
            }
            Ok(())
        })
        .and_then(|()| serving(&cluster.kube, &[NODE]));
    let detail = outcome?;
    restored.context("giving efa-a back to the DaemonSet")?;
    Ok(detail)
}

fn beside_the_daemonset(
    cluster: &mut Cluster,
    prometheus: &Prometheus,
    service: &mut Service,
) -> Result<Detail> {
    let checkpoint = cluster.checkpoint(NODE)?;
    let kube = &cluster.kube;
    let kubelet_log = cluster.run.join(format!("logs/kubelet-{NODE}.log"));
    kube.label_node(NODE, LABEL, Some("true"))?;
    wait_until(
        &format!("no DaemonSet pod on the labelled {NODE}"),
        secs(60),
        || kube.plugin_pods(NODE).is_ok_and(|pods| pods.is_empty()),
    )?;
    let before = registrations_in(&kubelet_log, RESOURCE);
    service.start("f11")?;
    let allocatable = || kube.allocatable(NODE, RESOURCE).ok().flatten();
    wait_until(
        &format!("{NODE} at {EFAS} from node mode"),
        secs(40),
        || allocatable() == Some(EFAS),
    )
    .map_err(|err| anyhow!("{err}: allocatable {:?}", allocatable()))?;
    let registered = registrations_in(&kubelet_log, RESOURCE) - before;
    ensure!(
        registered == 1,
        "node mode registered {registered} times, want once"
    );
    // The scrape docs/node-mode.md gives: node discovery, kept by the label, on the host's port.
    let scraped = format!(
        "efa_device_plugin_devices{{job=\"{SCRAPE_JOB}\", node=\"{NODE}\", health=\"healthy\"}} == {EFAS}"
    );
    wait_until(
        &format!("Prometheus scraping node mode through {SCRAPE_JOB}"),
        secs(60),
        || {
            prometheus
                .query(&scraped)
                .is_ok_and(|samples| samples.len() == 1)
        },
    )
    .map_err(|err| anyhow!("{err}: {}", prometheus.targets(SCRAPE_JOB)))?;

    let held = |name: &str| -> Result<Vec<String>> {
        let pod = kube.run_pod(&pod_on(name, 2, NODE))?;
        Ok(checkpoint.allocated(&pod.metadata.uid, RESOURCE))
    };
    let first = held(FIRST_POD)?;

    kube.label_node(NODE, LABEL, None)?;
    let said = wait_for(
        "the DaemonSet's pod on efa-a saying it comes second",
        secs(90),
        || {
            for pod in kube.plugin_pods(NODE)? {
                let name = &pod.metadata.name;
                for previous in [false, true] {
                    let log = kube.plugin_log(name, previous).unwrap_or_default();
                    if let Some(line) = log.lines().find(|line| line.contains(SECOND)) {
                        return Ok(Some((name.clone(), line.to_owned(), pod.restarts())));
                    }
                }
            }
            Ok(None)
        },
    )?;
    if let Some(status) = service.exited()? {
        bail!("node mode exited ({status}) when the DaemonSet's pod came");
    }
    let second = held(SECOND_POD)?;
    allocatable_stays(kube, NODE, EFAS, secs(5)).context("with both plugins")?;
    let again = registrations_in(&kubelet_log, RESOURCE) - before;
    ensure!(
        again == 1,
        "{again} registrations on {NODE} with both plugins, want node mode's 1"
    );
    let mut all: Vec<&String> = first.iter().chain(&second).collect();
    all.sort();
    all.dedup();
    ensure!(
        first.len() == 2 && second.len() == 2 && all.len() == 4,
        "{FIRST_POD} holds {first:?} and {SECOND_POD} {second:?}: want 2 each, none shared"
    );
    let (pod, line, restarts) = said;
    let line = line
        .split_once("another")
        .map_or(line.as_str(), |(_, rest)| rest);
    Ok(format!(
        "labelled: no DaemonSet pod, node mode registered once and scraped through {SCRAPE_JOB}, {FIRST_POD} [{}]; unlabelled: {pod} ({restarts} restarts) said \"another{line}\", registrations still 1, allocatable {EFAS} throughout, {SECOND_POD} [{}]",
        first.join(" "),
        second.join(" ")
    ))
}
