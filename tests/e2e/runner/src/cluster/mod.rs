//! The cluster suite's fixture: the API server through kubectl, the suite's bash for the
//! infrastructure it keeps (nodes, charts, Prometheus), and the nodes' fake EFA trees as the
//! host sees them.

mod counters;
pub mod fleet;
pub mod health;
mod host;
mod kube;
pub mod node_mode;
mod prometheus;
pub mod reboots;
pub mod scrapes;
mod workload;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, ensure};
use efa_device_plugin::testkit::simulate::{FakeDevice, FakeNode, Nodes, Shape, devices};

use crate::daemon::tail;
use crate::kubelet::Checkpoint;
use crate::wait::{secs, wait_until};
use counters::RisingCounters;
pub use host::Host;
pub use kube::Kube;
use prometheus::{POD_JOB, Prometheus};

/// Where the suite lays out each node's fake sysfs tree, as the node sees it.
const FIXTURES_SYSFS: &str = "/run/efa-device-plugin-e2e/sys";
const DEVICE_NODES: &str = "/dev/infiniband";
const CHECKPOINT: &str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint";
/// How often every kubelet of the suite reports node status (`NODE_STATUS_PERIOD` in
/// cluster.sh): allocatable moves on the next report.
pub const NODE_STATUS_PERIOD: Duration = Duration::from_secs(10);
/// Where the plugin serves its metrics, which the shipped pod's `prometheus.io/port` names.
pub const METRICS_PORT: u16 = 9465;
/// The node of the single-node cases, in the host's namespaces.
const EFA_A: &str = "efa-a";

pub struct Cluster {
    pub kube: Kube,
    pub host: Host,
    /// The suite's run dir: `logs/` holds each daemon's log.
    pub run: PathBuf,
    /// The kubelet binary every node runs.
    pub kubelet: PathBuf,
    /// The plugin's static binary, as the packages install it.
    pub plugin: PathBuf,
    /// `efa-a`'s counters rising, once a case asked for them; they stop with the runner.
    pub counters: Option<RisingCounters>,
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

    /// `node`'s fake EFA tree and its EFAs of `shape` as the tree lays them out ([`laid_out`]).
    pub fn fake_efas(&mut self, node: &str, shape: Shape) -> Result<(FakeNode, Vec<FakeDevice>)> {
        let fake = self.fake_node(node)?;
        let efas = laid_out(&fake, shape).with_context(|| format!("{node}'s tree"))?;
        Ok((fake, efas))
    }

    pub fn checkpoint(&mut self, node: &str) -> Result<Checkpoint> {
        Ok(Checkpoint {
            path: self.host_path(node, CHECKPOINT)?,
        })
    }

    /// The suite's Prometheus, started if it was not, with `efa-a`'s plugin pod a healthy target.
    pub fn prometheus(&mut self) -> Result<Prometheus> {
        let prometheus = Prometheus::at(&self.host.request("prometheus", &[])?)?;
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

/// The EFAs of `shape` as `fake`'s tree lays them out: testkit's devices of that shape (IDs, PCI
/// addresses, uverbs numbers, checked against the tree), each below the bridges the tree puts
/// above it, so that the test kit changes the files the plugin reads.
fn laid_out(fake: &FakeNode, shape: Shape) -> Result<Vec<FakeDevice>> {
    let pci = fs::canonicalize(fake.sysfs.join("devices")).context("devices/")?;
    let mut efas = Vec::new();
    for mut efa in devices(shape).into_iter().filter(FakeDevice::is_efa) {
        let entry = fake.sysfs.join("class/infiniband").join(&efa.ibdev);
        let real = fs::canonicalize(&entry).with_context(|| format!("{}", entry.display()))?;
        let mut path: Vec<String> = real
            .strip_prefix(&pci)
            .with_context(|| format!("{} is not below devices/", efa.ibdev))?
            .iter()
            .map(|part| part.to_string_lossy().into_owned())
            .collect();
        let tail = [efa.bdf.clone(), "infiniband".to_owned(), efa.ibdev.clone()];
        ensure!(
            path.len() > tail.len() && path.ends_with(&tail),
            "{} is at {}, not at {}/infiniband/{}",
            efa.ibdev,
            real.display(),
            efa.bdf,
            efa.ibdev
        );
        path.truncate(path.len() - tail.len());
        efa.parents = path;
        let uverbs = fake
            .sysfs
            .join("class/infiniband_verbs")
            .join(efa.uverbs_name())
            .join("dev");
        let dev = fs::read_to_string(&uverbs).with_context(|| format!("{}", uverbs.display()))?;
        ensure!(
            dev.trim() == efa.dev.to_string(),
            "{} is {}, not {}",
            uverbs.display(),
            dev.trim(),
            efa.dev
        );
        efas.push(efa);
    }
    Ok(efas)
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

#[cfg(test)]
mod tests {
    use efa_device_plugin::testkit::simulate::Nodes;

    use super::*;

    #[test]
    fn efas_are_found_below_the_bridges_their_tree_puts_above_them() {
        let dir = tempfile::tempdir().unwrap();
        let (fake, _) = FakeNode::build(dir.path(), Shape::P4d, Nodes::Files).unwrap();
        // One EFA moved below a bridge, as the suite's own p4d tree has them.
        let mut moved = devices(Shape::P4d).remove(3);
        fake.remove(&moved).unwrap();
        moved.parents.push("0000:a0:01.0".to_owned());
        fake.add(&moved).unwrap();

        let efas = laid_out(&fake, Shape::P4d).unwrap();
        assert_eq!(efas.len(), 4);
        assert_eq!(efas[0].parents, ["pci0000:10"]);
        assert_eq!(efas[3].parents, ["pci0000:a0", "0000:a0:01.0"]);
        assert!(laid_out(&fake, Shape::P5en).is_err());
    }
}
