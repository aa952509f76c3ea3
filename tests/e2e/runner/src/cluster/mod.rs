//! The cluster suite's fixture: the API server through kubectl, the suite's bash for the
//! infrastructure it keeps (nodes, charts, Prometheus), and the nodes' fake EFA trees as the
//! host sees them.

pub mod arm64;
pub mod cdi;
mod counters;
pub mod dra;
pub mod fleet;
pub mod gdrdrv;
pub mod health;
pub mod holder;
mod host;
pub mod install;
mod kube;
pub mod migration;
pub mod node_mode;
mod pod_resources;
mod pod_spec;
mod prometheus;
pub mod reboots;
pub mod scrapes;
mod single_node;
mod workload;
pub mod workloads;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use efa_device_plugin::testkit::simulate::{FakeNode, Nodes};

use crate::daemon::tail;
use crate::kubelet::Checkpoint;
use crate::wait::{secs, wait_until};
use counters::RisingCounters;
pub use host::Host;
pub use kube::Kube;
use prometheus::{POD_JOB, Prometheus};
use single_node::Overlay;

/// Where the suite lays out each node's fake sysfs tree, as the node sees it.
const FIXTURES_SYSFS: &str = "/run/efa-device-plugin-e2e/sys";
const DEVICE_NODES: &str = "/dev/infiniband";
const CHECKPOINT: &str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint";
const POD_RESOURCES: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// How often every kubelet of the suite reports node status (`NODE_STATUS_PERIOD` in
/// cluster.sh): allocatable moves on the next report.
pub const NODE_STATUS_PERIOD: Duration = Duration::from_secs(10);
/// The node of the single-node cases, in the host's namespaces.
const EFA_A: &str = "efa-a";

pub struct Cluster {
    pub kube: Kube,
    pub host: Host,
    /// The suite's run dir: `logs/` holds each daemon's log.
    pub run: PathBuf,
    /// The repository under test: the manifests, the chart and the suite's overlays and values.
    pub repo: PathBuf,
    /// The kubelet binary every node runs.
    pub kubelet: PathBuf,
    /// The plugin's static binary, as the packages install it.
    pub plugin: PathBuf,
    /// `efa-a`'s counters rising, once a case asked for them; they stop with the runner.
    pub counters: Option<RisingCounters>,
    /// The suite's Prometheus, once a case started it; it runs until the suite ends.
    pub started_prometheus: Option<Prometheus>,
    /// The Kubernetes version of every component, `v1.34.4`.
    pub kube_version: String,
}

impl Cluster {
    /// Where the host sees what `node` sees at `path` (a further node's binds live under its
    /// home).
    pub fn host_path(&mut self, node: &str, path: &str) -> Result<PathBuf> {
        Ok(PathBuf::from(
            self.host.request("host_path", &[node, path])?,
        ))
    }

    /// `node`'s fake EFA tree and device nodes, to change as a driver would.
    pub fn fake_node(&mut self, node: &str) -> Result<FakeNode> {
        let sysfs = self.host_path(node, FIXTURES_SYSFS)?;
        let nodes = self.host_path(node, DEVICE_NODES)?;
        let dev = nodes
            .parent()
            .with_context(|| format!("{} has no parent", nodes.display()))?
            .to_owned();
        Ok(FakeNode {
            sysfs,
            dev,
            nodes: Nodes::CharDevices,
        })
    }

    /// Where the host sees `node`'s kubelet's PodResources socket.
    pub fn pod_resources(&mut self, node: &str) -> Result<PathBuf> {
        self.host_path(node, POD_RESOURCES)
    }

    pub fn checkpoint(&mut self, node: &str) -> Result<Checkpoint> {
        Ok(Checkpoint {
            path: self.host_path(node, CHECKPOINT)?,
        })
    }

    /// The suite's Prometheus, with `efa-a`'s plugin pod a healthy target. The first call starts
    /// it, on the plugin of [`single_node::ensure_plugin`] (the p4d overlay unless a plugin
    /// serves `efa-a` already); later ones find it running on whatever the case installed.
    pub fn prometheus(&mut self) -> Result<Prometheus> {
        let prometheus = match self.started_prometheus {
            Some(prometheus) => prometheus,
            None => {
                single_node::ensure_plugin(self, Overlay::P4d)?;
                let started = Prometheus::at(&self.host.request("prometheus", &[])?)?;
                self.started_prometheus = Some(started);
                started
            }
        };
        wait_until(
            &format!("a healthy {POD_JOB} target for {EFA_A}'s plugin pod"),
            secs(60),
            || {
                let (Ok(targets), Ok(Some(pod))) = (
                    prometheus.active_targets(POD_JOB),
                    self.kube.serving_plugin_pod(EFA_A),
                ) else {
                    return false;
                };
                prometheus::scrapes(&targets, &pod)
            },
        )
        .map_err(|err| {
            anyhow!(
                "{err}: {}; {}",
                prometheus.targets(POD_JOB),
                tail(&self.run.join("logs/prometheus.log"), 2)
            )
        })?;
        Ok(prometheus)
    }

    /// Whether this kubelet has the `ResourceHealthStatus` gate (the suite turns it on), and so
    /// reports device health in pod status.
    pub fn reports_device_health(&self) -> Result<bool> {
        let help = Command::new(&self.kubelet)
            .arg("--help")
            .output()
            .with_context(|| format!("run {} --help", self.kubelet.display()))?;
        Ok(String::from_utf8_lossy(&help.stdout).contains("ResourceHealthStatus="))
    }

    /// The pods that are not Running, each plugin pod's and each kubelet's last lines.
    pub fn diagnostics(&self) -> Vec<String> {
        let mut lines = Vec::new();
        match self
            .kube
            .run(&["get", "pods", "-A", "-o", "wide", "--no-headers"])
        {
            Ok(pods) => lines.extend(pods.lines().filter(|pod| !pod.contains(" Running ")).map(
                |pod| {
                    format!(
                        "pod {}",
                        pod.split_whitespace().collect::<Vec<_>>().join(" ")
                    )
                },
            )),
            Err(err) => lines.push(format!("cannot list pods: {err:#}")),
        }
        let plugin_logs = self.kube.run(&[
            "logs",
            "-n",
            "kube-system",
            "-l",
            "app.kubernetes.io/name=efa-device-plugin",
            "--tail",
            "3",
            "--prefix",
        ]);
        lines.extend(
            plugin_logs
                .unwrap_or_else(|err| format!("{err:#}"))
                .lines()
                .map(|line| format!("plugin {line}")),
        );
        lines.extend(kubelet_logs(&self.run.join("logs")));
        lines
    }
}

fn kubelet_logs(logs: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(logs) else {
        return Vec::new();
    };
    let mut logs: Vec<PathBuf> = entries
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("kubelet-") && name.ends_with(".log"))
        })
        .collect();
    logs.sort();
    logs.iter()
        .map(|log| {
            let name = log.file_stem().unwrap_or_default().to_string_lossy();
            format!("{name} log: {}", tail(log, 3))
        })
        .collect()
}
