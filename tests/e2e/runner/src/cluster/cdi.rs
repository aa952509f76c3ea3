//! The chart in cdi mode on `efa-a`: a Job gets its EFAs through the plugin's CDI spec, and the
//! spec outlives the plugin while a container holds an EFA, since the kubelet restarts a
//! container from its checkpoint without calling the plugin and containerd resolves its CDI
//! names from the spec file.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result, anyhow, ensure};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Deserialize;

use super::fleet::check_devices;
use super::install::RELEASE;
use super::single_node::{
    NODE, efas, helm_template, installed_ok, kept_log, no_plugin_pod_within_60s, run_job,
    test_values,
};
use super::workload::pod_sleeping;
use super::{Cluster, pod_spec};
use crate::cases::Detail;
use crate::pods::{joined, listing_entries};
use crate::wait::{secs, wait_for, wait_until};

/// The chart's switch to cdi mode, and an env the spec must carry to the container.
const CDI: [&str; 4] = [
    "--set",
    "cdi.enabled=true",
    "--set-string",
    "config.allocate.env.FI_PROVIDER=efa",
];
/// The spec file the plugin writes in cdi mode, where containerd 2 reads it.
/// The plugin's CDI spec, where the shipped CDI mode writes it (`/var/run/cdi`, a link to
/// `/run/cdi`). Spelled under `/run`, the path a fleet node binds its own dir over, so that
/// `host_path` finds a further node's spec.
pub const CDI_SPEC: &str = "/run/cdi/vpc.amazonaws.com-efa.json";
const HOLDER: &str = "cdi-holder";
/// The holder's process is `sleep` this long, which names it on the host.
const HOLDER_SLEEP: u64 = 100_017;

#[derive(Deserialize)]
struct Spec {
    devices: Vec<SpecDevice>,
}

#[derive(Deserialize)]
struct SpecDevice {
    name: String,
}

/// The chart installed in cdi mode with the test values (no plugin installed before), found
/// serving.
fn install_cdi(cluster: &mut Cluster) -> Result<()> {
    let shipped = helm_template(cluster, &CDI)?;
    let mut install = vec![RELEASE];
    install.extend(CDI);
    cluster.host.request("helm_install", &install)?;
    installed_ok(cluster, &shipped)?;
    Ok(())
}

/// (10) In cdi mode the spec names every EFA, and a Job sees exactly its 2 uverbs nodes through
/// it, with `FI_PROVIDER=efa`; with no holder left, the spec goes with the plugin.
pub fn job(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("uninstall", &[])?;
    let shipped = helm_template(cluster, &CDI)?;
    let values = test_values(cluster);
    let mut test = vec!["-f", values.as_str()];
    test.extend(CDI);
    pod_spec::compare(&shipped, &helm_template(cluster, &test)?)?;
    install_cdi(cluster)?;
    let spec = cluster.host_path(NODE, CDI_SPEC)?;
    wait_until("the CDI spec written", secs(10), || {
        fs::metadata(&spec).is_ok_and(|meta| meta.len() > 0)
    })
    .map_err(|err| anyhow!("{err}: no CDI spec at {}", spec.display()))?;
    let text = fs::read_to_string(&spec)?;
    let parsed: Spec = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a CDI spec", spec.display()))?;
    let mut names: Vec<String> = parsed.devices.into_iter().map(|d| d.name).collect();
    names.sort();
    let mut want: Vec<String> = efas(cluster)?.into_iter().map(|efa| efa.ibdev).collect();
    want.sort();
    ensure!(
        names == want,
        "CDI spec devices [{}], want [{}]",
        names.join(" "),
        want.join(" ")
    );
    let held = run_job(cluster, "cdi-job", 2)?;
    let log = kept_log(cluster, &held.name)?;
    let env = log.lines().find(|line| line.starts_with("FI_PROVIDER="));
    ensure!(
        env == Some("FI_PROVIDER=efa"),
        "the Job's container has {}, want FI_PROVIDER=efa",
        env.unwrap_or("no FI_PROVIDER line")
    );
    // The spec goes with the plugin only once the kubelet lists no container holding an EFA:
    // the holder of other cases may still hold two.
    cluster.kube.delete_all_pods()?;
    cluster.host.request("helm_uninstall", &[RELEASE])?;
    no_plugin_pod_within_60s(cluster, "after helm uninstall")?;
    ensure!(
        !spec.exists(),
        "{} remains after the plugin stopped with no holder left",
        spec.display()
    );
    Ok(Detail::new())
}

/// (11) In cdi mode, with the plugin uninstalled under a holder of 1 EFA, the spec stays; the
/// holder's process killed, its container restarts and sees the same EFA.
pub fn spec_outlives_the_plugin(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("uninstall", &[])?;
    install_cdi(cluster)?;
    cluster
        .kube
        .apply(&pod_sleeping(HOLDER, 1, "Always", HOLDER_SLEEP))?;
    wait_until(&format!("{HOLDER} Running"), secs(60), || {
        cluster
            .kube
            .pod(HOLDER)
            .ok()
            .flatten()
            .is_some_and(|pod| pod.status.phase == "Running")
    })?;
    let held = check_devices(cluster, HOLDER, 1, NODE)?;
    let before = listing_entries(&kept_log(cluster, &held.name)?);

    cluster.host.request("helm_uninstall", &[RELEASE])?;
    no_plugin_pod_within_60s(cluster, "after helm uninstall")?;
    let spec = cluster.host_path(NODE, CDI_SPEC)?;
    ensure!(
        fs::metadata(&spec).is_ok_and(|meta| meta.len() > 0),
        "the plugin removed {} although {HOLDER} holds an EFA",
        spec.display()
    );
    let pid = process_running(&format!("sleep {HOLDER_SLEEP}"))?
        .context("holder's process not found on the host")?;
    kill(Pid::from_raw(pid), Signal::SIGKILL).context("kill the holder's process")?;
    let kube = &cluster.kube;
    wait_for("the holder's container running again", secs(60), || {
        Ok(kube.pod(HOLDER)?.filter(|pod| {
            pod.restarts() >= 1
                && pod
                    .status
                    .container_statuses
                    .first()
                    .is_some_and(|c| c.state.running.is_some())
        }))
    })?;
    let after = listing_entries(&kube.log(HOLDER)?);
    ensure!(
        after == before,
        "the restarted container sees [{}], want [{}]",
        joined(&after, ";"),
        joined(&before, ";")
    );
    kube.delete_pods(&[HOLDER])?;
    // Nobody is left to remove it: the plugin is gone.
    fs::remove_file(&spec).with_context(|| format!("remove {}", spec.display()))?;
    Ok("spec kept with the plugin gone; the restarted container has its EFA".to_owned())
}

/// The pid of a process on the host whose whole command line is `command` (words joined by
/// spaces), if there is one.
fn process_running(command: &str) -> Result<Option<i32>> {
    for entry in fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // A process may end while the directory is read.
        let Ok(cmdline) = fs::read(Path::new("/proc").join(entry.file_name()).join("cmdline"))
        else {
            continue;
        };
        let words: Vec<&str> = cmdline
            .split(|&b| b == 0)
            .filter(|word| !word.is_empty())
            .map(|word| std::str::from_utf8(word).unwrap_or(""))
            .collect();
        if words.join(" ") == command {
            return Ok(Some(pid));
        }
    }
    Ok(None)
}
