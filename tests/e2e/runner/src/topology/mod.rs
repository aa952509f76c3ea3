//! The topology suite's host: the standalone kubelet on a view of two NUMA nodes (bind-mounted
//! by the suite's bash before anything started), the plugin on one of three fake hosts, and a
//! GPU device plugin beside it (the suite's Go stand-in, built on the kubelet's own stub).
//! Each case names the policy, scope and host it needs; switching restarts the kubelet or the
//! plugin only when they differ.

pub mod cases;
pub mod observe;
mod pod;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use efa_device_plugin::testkit::simulate::{self, FakeDevice, FakeNode, Nodes, Shape};
use serde_json::Value;

use crate::daemon::{Daemon, tail};
use crate::kubelet::{Assigned, Kubelet, PodStatus};
use crate::node::RESOURCE;
use crate::plugin::Plugin;
use crate::pods::Pods;
use crate::wait::{secs, wait_for, wait_until};
use observe::Gpa;
pub use pod::Container;

/// The stand-in's resource, its devices (ID@NUMA) and the variable its Allocate sets.
pub const GPU: &str = "nvidia.com/gpu";
const GPU_DEVICES: &str = "GPU-0@0,GPU-1@1";
const GPU_ENV: &str = "NVIDIA_VISIBLE_DEVICES";
/// Where cAdvisor, the kubelet's only reader of NUMA topology, finds the nodes.
const NODE_SYSFS: &str = "/sys/devices/system/node";

/// The fake hosts the plugin can serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    /// 4 EFAs, 2 per NUMA node.
    P4d,
    /// 16 EFAs, 2 per PCIe switch, 8 per node.
    P5en,
    /// g5-shaped: no NUMA node (`numa_node` -1), with p4d's four EFAs where a g5 has one, so a
    /// pod can ask for two.
    G5,
}

impl Host {
    const ALL: [Host; 3] = [Host::P4d, Host::P5en, Host::G5];

    fn name(self) -> &'static str {
        match self {
            Host::P4d => "p4d",
            Host::P5en => "p5en",
            Host::G5 => "g5",
        }
    }

    fn devices(self) -> Vec<FakeDevice> {
        match self {
            Host::P4d => simulate::devices(Shape::P4d),
            Host::P5en => simulate::devices(Shape::P5en),
            Host::G5 => simulate::devices(Shape::P4d)
                .into_iter()
                .map(|device| FakeDevice { numa: -1, ..device })
                .collect(),
        }
    }
}

/// An EFA of a fake host as the plugin itself reports it, whichever ID strategy it uses.
struct Efa {
    id: String,
    /// -1: none.
    numa: i64,
    /// The PCIe switch above it (its upstream port), where it has one.
    switch: Option<String>,
}

struct FakeHost {
    host: Host,
    fake: FakeNode,
    efas: Vec<Efa>,
}

impl FakeHost {
    /// Lays out `host` under `<run>/<name>` and asks the plugin what it sees there.
    fn build(host: Host, run: &Path, plugin: &Path) -> Result<FakeHost> {
        let root = run.join(host.name());
        let (fake, _) = FakeNode::build(&root, Shape::NoEfa, Nodes::CharDevices)
            .with_context(|| format!("lay out the fake {} host", host.name()))?;
        let devices = host.devices();
        for device in &devices {
            fake.add(device).with_context(|| {
                format!("add {} to the fake {} host", device.ibdev, host.name())
            })?;
        }
        let output = Command::new(plugin)
            .arg("--sysfs-root")
            .arg(&fake.sysfs)
            .arg("--dev-root")
            .arg(&fake.dev)
            .args(["list", "--output", "json"])
            .output()
            .with_context(|| format!("run {} list", plugin.display()))?;
        if !output.status.success() {
            bail!(
                "list on the fake {} host: {}: {}",
                host.name(),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        let rows: Value = serde_json::from_slice(&output.stdout)
            .with_context(|| format!("parse list --output json on the fake {}", host.name()))?;
        let efas = rows
            .as_array()
            .ok_or_else(|| anyhow!("list --output json gave no array"))?
            .iter()
            .map(|row| {
                let id = row["id"]
                    .as_str()
                    .ok_or_else(|| anyhow!("a listed EFA without an id: {row}"))?;
                let ibdev = row["ibdev"].as_str().unwrap_or_default();
                Ok(Efa {
                    id: id.to_owned(),
                    numa: row["numa_node"].as_i64().unwrap_or(-1),
                    switch: devices
                        .iter()
                        .find(|d| d.ibdev == ibdev)
                        .and_then(|d| d.parents.get(2).cloned()),
                })
            })
            .collect::<Result<Vec<Efa>>>()?;
        Ok(FakeHost { host, fake, efas })
    }

    /// The IDs (on NUMA node `numa` only), sorted as the checkpoint's reader sorts them.
    fn ids(&self, numa: Option<i64>) -> Vec<String> {
        let mut ids: Vec<String> = self
            .efas
            .iter()
            .filter(|efa| numa.is_none_or(|n| efa.numa == n))
            .map(|efa| efa.id.clone())
            .collect();
        ids.sort();
        ids
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologyPolicy {
    SingleNumaNode,
    Restricted,
    BestEffort,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Container,
    Pod,
}

/// What the kubelet runs with: the Topology Manager's policy and scope, and whether the static
/// CPU manager runs beside them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub topology: TopologyPolicy,
    pub scope: Scope,
    pub static_cpus: bool,
}

impl Policy {
    pub const fn new(topology: TopologyPolicy, scope: Scope) -> Policy {
        Policy {
            topology,
            scope,
            static_cpus: false,
        }
    }

    fn names(self) -> (&'static str, &'static str, &'static str) {
        (
            match self.topology {
                TopologyPolicy::SingleNumaNode => "single-numa-node",
                TopologyPolicy::Restricted => "restricted",
                TopologyPolicy::BestEffort => "best-effort",
            },
            match self.scope {
                Scope::Container => "container",
                Scope::Pod => "pod",
            },
            if self.static_cpus { "static" } else { "none" },
        )
    }

    /// The kubelet config's lines for it. The static CPU manager keeps CPU 0, the first node's,
    /// for the system, so an exclusive CPU can only come from node 1.
    fn config_lines(self) -> String {
        let (topology, scope, cpu) = self.names();
        let mut lines = format!(
            "topologyManagerPolicy: {topology}\ntopologyManagerScope: {scope}\ncpuManagerPolicy: {cpu}\n"
        );
        if self.static_cpus {
            lines.push_str("reservedSystemCPUs: \"0\"\n");
        }
        lines
    }
}

/// The GPU device plugin, registered with the current kubelet or stopped. It registers once,
/// so it is started again after each kubelet restart.
struct GpuStandin {
    binary: PathBuf,
    device_plugin_dir: PathBuf,
    run: PathBuf,
    starts: u32,
    daemon: Option<Daemon>,
}

impl GpuStandin {
    fn log(&self) -> PathBuf {
        self.run
            .join("logs")
            .join(format!("gpu-standin.{}.log", self.starts))
    }

    fn start(&mut self) -> Result<()> {
        self.starts += 1;
        let mut command = Command::new(&self.binary);
        command
            .arg("--plugin-dir")
            .arg(&self.device_plugin_dir)
            .args([
                "--resource",
                GPU,
                "--devices",
                GPU_DEVICES,
                "--env",
                GPU_ENV,
            ]);
        self.daemon = Some(Daemon::start(
            "gpu-standin",
            command,
            &self.log(),
            &self.run.join("pids"),
        )?);
        Ok(())
    }

    fn stop(&mut self) -> Result<()> {
        if let Some(daemon) = self.daemon.take() {
            daemon.stop(secs(10))?;
        }
        Ok(())
    }
}

pub struct Topology {
    pub kubelet: Kubelet,
    pub plugin: Plugin,
    pub pods: Pods,
    standin: GpuStandin,
    run: PathBuf,
    /// The kubelet's config as the suite's bash wrote it, before the policy's lines.
    base_config: String,
    policy: Policy,
    hosts: Vec<FakeHost>,
    serving: Option<Host>,
    /// The plugin's GetPreferredAllocation answers logged before the last pod was written.
    gpa_seen: usize,
}

/// The paths and binaries the suite's bash hands over.
pub struct Setup {
    pub kubelet: Kubelet,
    pub plugin: Plugin,
    pub pods: Pods,
    pub gpu_standin: PathBuf,
    pub device_plugin_dir: PathBuf,
    pub run: PathBuf,
}

impl Topology {
    /// Checks the two-node view, lays out the fake hosts, starts the kubelet under
    /// single-numa-node, the plugin on the p4d and the GPU stand-in.
    pub fn up(setup: Setup) -> Result<Topology> {
        check_two_node_view()?;
        let hosts = Host::ALL
            .into_iter()
            .map(|host| FakeHost::build(host, &setup.run, &setup.plugin.binary))
            .collect::<Result<Vec<_>>>()
            .context("cannot build the fake EFA hosts")?;
        let config = setup.run.join("kubelet/config.yaml");
        let base_config =
            fs::read_to_string(&config).with_context(|| format!("read {}", config.display()))?;
        let mut plugin = setup.plugin;
        // The plugin logs each GetPreferredAllocation answer at debug level.
        plugin.flags = vec!["--log-level".into(), "info,efa_device_plugin=debug".into()];
        let mut topology = Topology {
            kubelet: setup.kubelet,
            plugin,
            pods: setup.pods,
            standin: GpuStandin {
                binary: setup.gpu_standin,
                device_plugin_dir: setup.device_plugin_dir,
                run: setup.run.clone(),
                starts: 0,
                daemon: None,
            },
            run: setup.run,
            base_config,
            policy: Policy::new(TopologyPolicy::SingleNumaNode, Scope::Container),
            hosts,
            serving: None,
            gpa_seen: 0,
        };
        topology.write_config()?;
        crate::note("starting kubelet");
        topology.kubelet.start()?;
        topology.use_host(Host::P4d)?;
        topology.start_standin().map_err(|_| {
            anyhow!(
                "gpu-standin did not register: {}",
                tail(&topology.standin.log(), 3)
            )
        })?;
        Ok(topology)
    }

    fn write_config(&self) -> Result<()> {
        let path = self.run.join("kubelet/config.yaml");
        fs::write(
            &path,
            format!("{}{}", self.base_config, self.policy.config_lines()),
        )
        .with_context(|| format!("write {}", path.display()))
    }

    fn host(&self, host: Host) -> &FakeHost {
        self.hosts
            .iter()
            .find(|h| h.host == host)
            .expect("every host is built at setup")
    }

    /// The IDs of `host` (on NUMA node `numa` only), sorted.
    pub fn ids(&self, host: Host, numa: Option<i64>) -> Vec<String> {
        self.host(host).ids(numa)
    }

    /// The PCIe switch above `id` on the p5en host; empty for none.
    pub fn switch_of(&self, id: &str) -> String {
        self.host(Host::P5en)
            .efas
            .iter()
            .find(|efa| efa.id == id)
            .and_then(|efa| efa.switch.clone())
            .unwrap_or_default()
    }

    fn start_standin(&mut self) -> Result<()> {
        self.standin.start()?;
        let want = ["GPU-0", "GPU-1"];
        wait_until("gpu-standin registered", secs(30), || {
            self.kubelet.registrations(GPU) > 0 && self.pods.checkpoint.registered(GPU) == want
        })
    }

    /// No pods, the kubelet under `policy` and the plugin serving `host`.
    pub fn fresh(&mut self, policy: Policy, host: Host) -> Result<()> {
        self.pods.remove_all_but(&[])?;
        self.use_policy(policy)?;
        self.use_host(host)
    }

    /// The plugin serves `host`, restarted onto it if it served another.
    fn use_host(&mut self, host: Host) -> Result<()> {
        if self.serving == Some(host) {
            return Ok(());
        }
        self.plugin.stop(secs(10))?;
        let fake = self.host(host).fake.clone();
        self.plugin.sysfs = fake.sysfs.clone();
        self.plugin.dev = fake.dev;
        // The checkpoint keeps the IDs of the host served before, which may be the same (the
        // g5 host's are the p4d's): only a registration logged after the start is this plugin's.
        let before = self.kubelet.registrations(RESOURCE);
        self.plugin.start()?;
        let want = self.ids(host, None);
        wait_until("plugin registered", secs(30), || {
            self.kubelet.registrations(RESOURCE) > before
                && self.pods.checkpoint.registered(RESOURCE) == want
        })
        .map_err(|_| {
            anyhow!(
                "fixture {}: checkpoint lists [{}], want [{}]; plugin log: {}",
                host.name(),
                self.pods.checkpoint.registered(RESOURCE).join(" "),
                want.join(" "),
                tail(&self.plugin.log(), 3)
            )
        })?;
        self.serving = Some(host);
        Ok(())
    }

    /// The kubelet runs under `policy`, restarted (with no pods) if it did not; both plugins
    /// register with the new kubelet.
    fn use_policy(&mut self, policy: Policy) -> Result<()> {
        if self.policy == policy {
            return Ok(());
        }
        self.pods.remove_all_but(&[])?;
        self.standin.stop()?;
        self.kubelet.stop()?;
        self.policy = policy;
        self.write_config()?;
        // The CPU manager refuses to start on a checkpoint of another policy.
        let state = self.run.join("kubelet/root/cpu_manager_state");
        if let Err(err) = fs::remove_file(&state)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            return Err(err).with_context(|| format!("remove {}", state.display()));
        }
        let (topology, scope, cpu) = policy.names();
        self.kubelet
            .start()
            .with_context(|| format!("kubelet ({topology}, {scope}, CPU manager {cpu})"))?;
        let want = self
            .serving
            .map(|host| self.ids(host, None))
            .unwrap_or_default();
        wait_until("plugin registered again", secs(60), || {
            self.kubelet.registrations(RESOURCE) > 0
                && self.pods.checkpoint.registered(RESOURCE) == want
        })
        .map_err(|_| {
            anyhow!(
                "plugin did not register with the restarted kubelet: {}",
                tail(&self.plugin.log(), 3)
            )
        })?;
        self.start_standin()
            .map_err(|_| anyhow!("gpu-standin did not register with the restarted kubelet"))
    }

    /// Writes the pod and waits up to 60 s until it runs or is rejected; its status then.
    fn run_pod(&mut self, name: &str, containers: &[Container]) -> Result<PodStatus> {
        self.gpa_seen = self.all_gpa().len();
        let out = self.pods.make_out(name)?;
        self.pods
            .publish(name, &pod::manifest(name, &out, containers))?;
        let settled = wait_for(&format!("pod {name} settled"), secs(60), || {
            let status = self.pods.status(name);
            Ok(matches!(status.phase(), "Running" | "Failed" | "Succeeded").then_some(status))
        });
        // A pod that never settled is judged by the status it has.
        Ok(settled.unwrap_or_else(|_| self.pods.status(name)))
    }

    /// The pod runs, and each of its containers has written its files.
    pub fn expect_running(&mut self, name: &str, containers: &[Container]) -> Result<()> {
        let status = self.run_pod(name, containers)?;
        if status.phase() != "Running" {
            bail!("pod {name} is {}, want Running", described(&status));
        }
        for container in containers {
            let written = self.pods.out(name).join(format!("{}.ls", container.name));
            wait_until("container output", secs(20), || written.exists())
                .map_err(|_| anyhow!("container {} of pod {name} wrote nothing", container.name))?;
        }
        Ok(())
    }

    /// The kubelet rejects the pod with `reason`; its status.
    pub fn expect_rejected(
        &mut self,
        name: &str,
        reason: &str,
        containers: &[Container],
    ) -> Result<PodStatus> {
        let status = self.run_pod(name, containers)?;
        match &status {
            PodStatus::Listed {
                phase, reason: got, ..
            } if phase == "Failed" && got == reason => Ok(status),
            _ => bail!(
                "pod {name} is {}, want Failed ({reason})",
                described(&status)
            ),
        }
    }

    /// The pod gone, with its output.
    pub fn drop_pod(&self, name: &str) -> Result<()> {
        self.pods.remove_with_output(name)
    }

    /// What the checkpoint gives pod `name` under `resource` (in `container` only).
    fn devices_of(&self, name: &str, resource: &str, container: Option<&str>) -> Vec<Assigned> {
        let PodStatus::Listed { uid, .. } = self.pods.status(name) else {
            return Vec::new();
        };
        self.pods
            .checkpoint
            .devices(&uid, resource)
            .into_iter()
            .filter(|device| container.is_none_or(|c| device.container == c))
            .collect()
    }

    /// The device IDs, sorted.
    pub fn ids_of(&self, name: &str, resource: &str, container: Option<&str>) -> Vec<String> {
        let mut ids: Vec<String> = self
            .devices_of(name, resource, container)
            .into_iter()
            .map(|device| device.id)
            .collect();
        ids.sort();
        ids
    }

    /// The distinct NUMA keys, space-separated.
    pub fn numa_keys_of(&self, name: &str, resource: &str, container: Option<&str>) -> String {
        let mut keys: Vec<String> = self
            .devices_of(name, resource, container)
            .into_iter()
            .map(|device| device.numa)
            .collect();
        keys.sort();
        keys.dedup();
        keys.join(" ")
    }

    /// What a container wrote into file `<container>.<what>`, without the trailing newline;
    /// empty when it wrote nothing.
    fn written(&self, name: &str, container: &str, what: &str) -> String {
        fs::read_to_string(self.pods.out(name).join(format!("{container}.{what}")))
            .unwrap_or_default()
            .trim_end_matches('\n')
            .to_owned()
    }

    /// The stand-in's variable as the container saw it.
    pub fn gpu_env_of(&self, name: &str, container: &str) -> String {
        self.written(name, container, "gpu")
    }

    /// The CPU list the container was allowed to run on.
    pub fn cpus_of(&self, name: &str, container: &str) -> String {
        self.written(name, container, "cpus")
    }

    fn all_gpa(&self) -> Vec<Gpa> {
        observe::gpa_answers(&fs::read_to_string(self.plugin.log()).unwrap_or_default())
    }

    /// The plugin's answers since the last pod was written.
    pub fn new_gpa(&self) -> Vec<Gpa> {
        let mut answers = self.all_gpa();
        answers.split_off(self.gpa_seen.min(answers.len()))
    }

    /// Those answers, for a case's line.
    pub fn gpa_summary(&self) -> String {
        let answers = self.new_gpa();
        if answers.is_empty() {
            return "no GPA call".to_owned();
        }
        answers
            .iter()
            .map(Gpa::summary)
            .collect::<Vec<_>>()
            .join(";")
    }

    /// The kubelet's hints for pod `name` and `resource`, one per line it logged.
    pub fn hints_of(&self, name: &str, resource: &str) -> String {
        let log = fs::read_to_string(self.kubelet.log()).unwrap_or_default();
        observe::hints(&log, &format!("{name}-{}", self.pods.node), resource).join("\n")
    }

    /// Each pod's status and the three daemons' last lines.
    pub fn diagnostics(&self) -> Vec<String> {
        let mut lines =
            crate::node::standalone_diagnostics(&self.pods, &self.kubelet, &self.plugin);
        lines.push(format!("gpu-standin log: {}", tail(&self.standin.log(), 3)));
        lines
    }

    /// The stand-in, the plugin, then the kubelet; each failure is noted.
    pub fn stop(&mut self) {
        if let Err(err) = self.standin.stop() {
            crate::note(&format!("stopping the gpu-standin: {err:#}"));
        }
        if let Err(err) = self.plugin.stop(secs(10)) {
            crate::note(&format!("stopping the plugin: {err:#}"));
        }
        if let Err(err) = self.kubelet.stop() {
            crate::note(&format!("stopping the kubelet: {err:#}"));
        }
    }
}

/// `PHASE (REASON: MESSAGE)`, as a failure quotes a pod.
fn described(status: &PodStatus) -> String {
    match status {
        PodStatus::Listed {
            phase,
            reason,
            message,
            ..
        } => format!("{phase} ({reason}: {message})"),
        other => other.phase().to_owned(),
    }
}

/// The kubelet will see two NUMA nodes, from a tree mounted in this mount namespace only: the
/// host (init's namespace) does not have the mount.
fn check_two_node_view() -> Result<()> {
    let seen = numa_nodes(Path::new(NODE_SYSFS))?;
    if seen != ["0", "1"] {
        bail!(
            "NUMA nodes seen in the namespace: [{}], want [0 1]",
            seen.join(" ")
        );
    }
    if !mounted_at("/proc/self/mountinfo", NODE_SYSFS)? {
        bail!("{NODE_SYSFS} is the host's own tree: the two-node view is not mounted");
    }
    if mounted_at("/proc/1/mountinfo", NODE_SYSFS)? {
        bail!("the mount leaked out of the namespace: init's mounts list {NODE_SYSFS}");
    }
    Ok(())
}

/// The node IDs a `node` tree gives, as cAdvisor finds them (`nodeN` dirs), sorted numerically.
fn numa_nodes(dir: &Path) -> Result<Vec<String>> {
    let mut ids: Vec<u32> = fs::read_dir(dir)
        .with_context(|| format!("list {}", dir.display()))?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name();
            name.to_str()?.strip_prefix("node")?.parse().ok()
        })
        .collect();
    ids.sort_unstable();
    Ok(ids.iter().map(u32::to_string).collect())
}

/// Whether the mount table `mountinfo` has a mount at `point`.
fn mounted_at(mountinfo: &str, point: &str) -> Result<bool> {
    let table = fs::read_to_string(mountinfo).with_context(|| format!("read {mountinfo}"))?;
    Ok(mount_points(&table).any(|p| p == point))
}

fn mount_points(table: &str) -> impl Iterator<Item = &str> {
    table.lines().filter_map(|line| line.split(' ').nth(4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_gives_the_kubelet_config_lines() {
        let mut policy = Policy::new(TopologyPolicy::Restricted, Scope::Pod);
        assert_eq!(
            policy.config_lines(),
            "topologyManagerPolicy: restricted\ntopologyManagerScope: pod\ncpuManagerPolicy: none\n"
        );
        policy.static_cpus = true;
        assert!(
            policy
                .config_lines()
                .ends_with("cpuManagerPolicy: static\nreservedSystemCPUs: \"0\"\n")
        );
    }

    #[test]
    fn node_dirs_are_read_as_cadvisor_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["node1", "node0", "node10", "online", "has_cpu"] {
            fs::create_dir(dir.path().join(name)).unwrap();
        }
        assert_eq!(numa_nodes(dir.path()).unwrap(), ["0", "1", "10"]);
    }

    #[test]
    fn mount_points_are_the_fifth_field() {
        let table = "22 27 0:21 / /proc rw,relatime - proc proc rw\n\
            90 23 8:1 /tmp/numa /sys/devices/system/node rw - ext4 /dev/sda1 rw\n";
        assert_eq!(
            mount_points(table).collect::<Vec<_>>(),
            ["/proc", "/sys/devices/system/node"]
        );
    }

    #[test]
    fn the_g5_host_has_four_efas_without_a_numa_node() {
        let devices = Host::G5.devices();
        assert_eq!(devices.len(), 4);
        assert!(devices.iter().all(|d| d.numa == -1));
    }
}
