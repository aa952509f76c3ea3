//! Reboots of the standalone node, and node mode: the plugin started the way its systemd unit
//! starts it (`manifests/systemd/efa-device-plugin.service`), before the kubelet, which starts
//! only once the plugin said `READY=1`, as systemd orders `Before=kubelet.service` with
//! `Type=notify`.

use std::fs;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use crate::cases::Detail;
use crate::daemon::{Daemon, tail};
use crate::kubelet::PodStatus;
use crate::node::{Node, RESOURCE};
use crate::plugin::Plugin;
use crate::pods::Restart;
use crate::wait::{secs, wait_for};

/// The unit and the config its `ExecStart` names, as the packages install them.
const UNIT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../manifests/systemd/efa-device-plugin.service"
);
const SHIPPED_CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../manifests/systemd/config.yaml"
);
/// Where the packages install the binary and the config the unit's `ExecStart` names.
const INSTALLED_BINARY: &str = "/usr/bin/efa-device-plugin";
const INSTALLED_CONFIG: &str = "/etc/efa-device-plugin/config.yaml";

/// The unit's `Type=` and `ExecStart=`, read from the file, never copied.
#[derive(Debug, PartialEq, Eq)]
pub struct Unit {
    pub kind: String,
    pub exec_start: Vec<String>,
}

impl Unit {
    pub fn read() -> Result<Unit> {
        let text = fs::read_to_string(UNIT).with_context(|| format!("read {UNIT}"))?;
        Unit::parse(&text)
    }

    /// The `[Service]` section's `Type` and `ExecStart` (words split on blanks: the unit quotes
    /// nothing).
    pub fn parse(text: &str) -> Result<Unit> {
        let mut section = "";
        let (mut kind, mut exec_start) = (None, None);
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line;
            } else if section == "[Service]" {
                match line.split_once('=') {
                    Some(("Type", value)) => kind = Some(value.to_owned()),
                    Some(("ExecStart", value)) => {
                        exec_start = Some(value.split_whitespace().map(str::to_owned).collect())
                    }
                    _ => {}
                }
            }
        }
        Ok(Unit {
            kind: kind.ok_or_else(|| anyhow!("{UNIT}: no Type= in [Service]"))?,
            exec_start: exec_start.ok_or_else(|| anyhow!("{UNIT}: no ExecStart= in [Service]"))?,
        })
    }

    /// `ExecStart` with the installed binary and config swapped for the ones under test and
    /// shipped: the program and its arguments.
    pub fn command(&self, binary: &Path) -> Result<Command> {
        let (program, args) = self
            .exec_start
            .split_first()
            .ok_or_else(|| anyhow!("{UNIT}: ExecStart is empty"))?;
        if program != INSTALLED_BINARY {
            bail!("{UNIT}: ExecStart runs {program}, not {INSTALLED_BINARY}");
        }
        let mut command = Command::new(binary);
        command.args(args.iter().map(|arg| match arg.as_str() {
            INSTALLED_CONFIG => SHIPPED_CONFIG,
            other => other,
        }));
        Ok(command)
    }
}

/// What a power-off does to the node: the kubelet and the plugin stopped, every container of
/// the runtime killed (none runs when the node comes back).
pub fn power_off(node: &mut Node, node_mode: &mut Option<Daemon>) -> Result<()> {
    node.kubelet.stop()?;
    node.plugin.stop(secs(10))?;
    if let Some(plugin) = node_mode.take() {
        plugin.stop(secs(10))?;
    }
    let ctr = |args: &[&str]| {
        Command::new("ctr")
            .arg("--address")
            .arg(node.pods.run.join("containerd/containerd.sock"))
            .args(["--namespace", "k8s.io"])
            .args(args)
            .output()
    };
    let tasks = ctr(&["tasks", "ls", "-q"]).context("ctr tasks ls")?;
    for task in String::from_utf8_lossy(&tasks.stdout).split_whitespace() {
        ctr(&["tasks", "kill", "-s", "SIGKILL", task]).context("ctr tasks kill")?;
    }
    wait_for("every task stopped", secs(30), || {
        let listed = ctr(&["tasks", "ls"]).context("ctr tasks ls")?;
        let running = String::from_utf8_lossy(&listed.stdout)
            .lines()
            .skip(1)
            .any(|line| line.split_whitespace().nth(2) == Some("RUNNING"));
        Ok((!running).then_some(()))
    })
}

/// Starts `plugin` as the unit does, with its paths as the `EFA_DP_*` variables the unit's
/// `EnvironmentFile` would hold, and waits for its `READY=1`. `start` names its log and notify
/// socket under the plugin's run dir.
pub fn start_node_mode(plugin: &Plugin, unit: &Unit, start: &str) -> Result<Daemon> {
    let run = &plugin.run;
    let notify_path = run.join(format!("notify.{start}"));
    let _ = fs::remove_file(&notify_path);
    let notify = UnixDatagram::bind(&notify_path)
        .with_context(|| format!("bind {}", notify_path.display()))?;
    notify.set_read_timeout(Some(secs(30)))?;
    let mut command = unit.command(&plugin.binary)?;
    command
        .env("NOTIFY_SOCKET", &notify_path)
        .env("EFA_DP_SYSFS_ROOT", &plugin.sysfs)
        .env("EFA_DP_DEV_ROOT", &plugin.dev)
        .env("EFA_DP_DEVICE_PLUGIN_DIR", &plugin.device_plugin_dir)
        .env("EFA_DP_POD_RESOURCES_SOCKET", &plugin.pod_resources_socket)
        .env_remove("RUST_LOG");
    let log = run
        .join("logs")
        .join(format!("plugin-node-mode.{start}.log"));
    let daemon = Daemon::start("plugin-node-mode", command, &log, &run.join("pids"))?;
    let mut said = [0u8; 256];
    let n = notify.recv(&mut said).map_err(|err| {
        anyhow!(
            "no READY=1 from the plugin started as the unit starts it ({err}): {}",
            tail(&log, 3)
        )
    })?;
    let said = String::from_utf8_lossy(&said[..n]);
    if !said.lines().any(|line| line == "READY=1") {
        bail!("the plugin's first notice is {said:?}, not READY=1");
    }
    Ok(daemon)
}

/// The static pods of one boot: `count` of them, each holding one EFA, restarted always.
pub fn boot_pods(boot: u32, count: usize) -> Vec<String> {
    (0..count).map(|i| format!("boot{boot}-{i}")).collect()
}

/// How each pod came through the boot: Running, or refused at admission (`Failed`,
/// `UnexpectedAdmissionError`); any other end fails the case.
pub fn refused(node: &Node, pods: &[String]) -> Result<usize> {
    let outcomes = wait_for("every pod Running or refused", secs(120), || {
        let statuses: Vec<PodStatus> = pods.iter().map(|pod| node.pods.status(pod)).collect();
        let settled = statuses.iter().all(|status| {
            matches!(status, PodStatus::Listed { phase, .. } if phase == "Running" || phase == "Failed")
        });
        Ok(settled.then_some(statuses))
    })
    .map_err(|err| {
        let now: Vec<String> = pods
            .iter()
            .map(|pod| format!("{pod}: {}", node.pods.status(pod)))
            .collect();
        anyhow!("{err}: {}", now.join("; "))
    })?;
    let mut count = 0;
    for (pod, status) in pods.iter().zip(outcomes) {
        if let PodStatus::Listed { phase, reason, .. } = &status
            && phase == "Failed"
        {
            if reason != "UnexpectedAdmissionError" {
                bail!("{pod} failed for another reason: {status}");
            }
            count += 1;
        }
    }
    Ok(count)
}

/// The pods of one boot written and Running before the power-off.
pub fn place(node: &Node, pods: &[String]) -> Result<()> {
    for pod in pods {
        node.pods.write(pod, 1, Restart::Always, None)?;
    }
    for pod in pods {
        node.pods.wait_phase(pod, "Running", "before the reboot")?;
    }
    Ok(())
}

/// Milliseconds from the kubelet's first log line to its first registration of the resource,
/// both by the kubelet's own clock (klog's `hh:mm:ss.uuuuuu`).
pub fn start_to_register(log: &Path) -> Result<u64> {
    let text = fs::read_to_string(log).with_context(|| format!("read {}", log.display()))?;
    start_to_register_in(&text).with_context(|| log.display().to_string())
}

/// [`start_to_register`] in the lines of one kubelet start.
pub fn start_to_register_in(text: &str) -> Result<u64> {
    let first = text
        .lines()
        .find_map(klog_time)
        .ok_or_else(|| anyhow!("no klog line"))?;
    let quoted = format!("\"{RESOURCE}\"");
    let registered = text
        .lines()
        .filter(|line| {
            line.contains("Got registration request from device plugin") && line.contains(&quoted)
        })
        .find_map(klog_time)
        .ok_or_else(|| anyhow!("no registration of {RESOURCE}"))?;
    Ok(registered.saturating_sub(first).as_millis() as u64)
}

/// The time of day of a klog line (`I1203 19:57:12.432330 …`).
fn klog_time(line: &str) -> Option<Duration> {
    let time = line.split_whitespace().nth(1)?;
    let (clock, micros) = time.split_once('.')?;
    let mut parts = clock.split(':').map(str::parse::<u64>);
    let (h, m, s) = (
        parts.next()?.ok()?,
        parts.next()?.ok()?,
        parts.next()?.ok()?,
    );
    let first = line.chars().next()?;
    if !matches!(first, 'I' | 'W' | 'E' | 'F') {
        return None;
    }
    Some(Duration::from_secs(h * 3600 + m * 60 + s) + Duration::from_micros(micros.parse().ok()?))
}

/// Boots per order unless `EFA_DP_E2E_REBOOTS` says otherwise (10 by hand): node mode and the
/// plugin after the kubelet take turns, so both see the same host load.
const BOOTS: u32 = 3;

pub fn boots() -> Result<u32> {
    match std::env::var("EFA_DP_E2E_REBOOTS") {
        Ok(text) => match text.parse() {
            Ok(n) if n > 0 => Ok(n),
            _ => bail!("EFA_DP_E2E_REBOOTS: {text:?} is not a positive count of reboots"),
        },
        Err(_) => Ok(BOOTS),
    }
}
/// Pods bound to the node at each power-off, each holding one EFA: more than one, since the
/// kubelet drops the checkpointed devices of pods it has not re-admitted yet when it admits the
/// first.
const PODS_PER_BOOT: usize = 3;

/// K8: reboots in node mode refuse no pod; the plugin started after the kubelet (a
/// DaemonSet's order, at best) is measured beside it.
pub fn node_mode_survives_reboots(node: &mut Node) -> Result<Detail> {
    let unit = Unit::read()?;
    if unit.kind != "notify" {
        bail!("{UNIT}: Type={}, want notify", unit.kind);
    }
    node.pods.remove_all_but(&[])?;
    node.ensure_plugin()?;
    let mut node_mode = None;
    let outcome = reboots(node, &unit, &mut node_mode);
    if let Some(plugin) = node_mode.take() {
        plugin.stop(secs(10))?;
    }
    node.pods.remove_all_but(&[])?;
    let (ours, after) = outcome?;
    let line = format!(
        "node mode refused {}/{}, kubelet start → Register {}; plugin after the kubelet refused {}/{}, Register {}",
        ours.refused,
        ours.pods,
        ours.registers(),
        after.refused,
        after.pods,
        after.registers()
    );
    if ours.refused > 0 {
        bail!("{line}");
    }
    Ok(line)
}

/// What the reboots of one order did: pods refused at admission of those bound, and each
/// boot's kubelet start → Register.
#[derive(Default)]
pub struct Tally {
    pub refused: usize,
    pub pods: usize,
    pub register_ms: Vec<u64>,
}

impl Tally {
    pub fn registers(&self) -> String {
        let mut ms = self.register_ms.clone();
        ms.sort_unstable();
        match (ms.get(ms.len() / 2), ms.last()) {
            (Some(median), Some(max)) => format!("median {median} ms, max {max} ms"),
            _ => "never".to_owned(),
        }
    }
}

fn reboots(node: &mut Node, unit: &Unit, node_mode: &mut Option<Daemon>) -> Result<(Tally, Tally)> {
    let (mut ours, mut after) = (Tally::default(), Tally::default());
    let all = node.all_ids();
    for boot in 1..=2 * boots()? {
        let pods = boot_pods(boot, PODS_PER_BOOT);
        place(node, &pods)?;
        power_off(node, node_mode)?;
        let tally = if boot % 2 == 1 {
            *node_mode = Some(start_node_mode(&node.plugin, unit, &boot.to_string())?);
            node.kubelet.start()?;
            &mut ours
        } else {
            node.kubelet.start()?;
            node.plugin.start()?;
            &mut after
        };
        // The checkpoint still lists the IDs from before the power-off: the new kubelet's own
        // log says when the plugin registered with it.
        crate::wait::wait_until("registered after the boot", secs(60), || {
            node.registered_since(0, &all)
        })
        .map_err(|_| anyhow!("boot {boot}: the plugin did not register within 60s"))?;
        tally.refused += refused(node, &pods)?;
        tally.pods += pods.len();
        tally
            .register_ms
            .push(start_to_register(&node.kubelet.log())?);
        node.pods.remove_all_but(&[])?;
    }
    Ok((ours, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_unit_is_a_notify_service_that_runs_the_installed_binary_with_its_config() {
        let unit = Unit::read().unwrap();
        assert_eq!(unit.kind, "notify");
        let command = unit.command(Path::new("/tmp/plugin")).unwrap();
        let args: Vec<_> = command
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(args.contains(&SHIPPED_CONFIG.to_owned()), "{args:?}");
        assert_eq!(args.last().map(String::as_str), Some("run"));
        assert!(Path::new(SHIPPED_CONFIG).is_file());
    }

    #[test]
    fn a_unit_without_exec_start_or_another_program_is_refused() {
        assert!(Unit::parse("[Service]\nType=notify\n").is_err());
        let other = Unit::parse("[Service]\nType=notify\nExecStart=/bin/true run\n").unwrap();
        assert!(other.command(Path::new("/tmp/plugin")).is_err());
    }

    #[test]
    fn klog_times_are_read_and_other_lines_are_not() {
        assert_eq!(
            klog_time("I1203 19:57:12.432330   16235 kubelet.go:2546] \"x\""),
            Some(Duration::from_secs(19 * 3600 + 57 * 60 + 12) + Duration::from_micros(432330))
        );
        assert_eq!(klog_time("Flag --foo has been deprecated"), None);
    }
}
