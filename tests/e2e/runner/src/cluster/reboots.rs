//! Reboots of a fleet node with the plugin in node mode and as the DaemonSet: what the kubelet
//! does with the pods bound to the node when it comes back.

use std::fs;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use super::Cluster;
use super::fleet::serving;
use super::kube::Pod;
use super::node_mode::{LABEL, Service};
use super::workload::{Placement, deployment, job, pod};
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::reboot::{Tally, boots, start_to_register_in};
use crate::wait::{secs, wait_for, wait_until};

/// The node in the host's namespaces, where node mode runs as the host's service would.
const NODE: &str = "efa-a";
const EFAS: u64 = 4;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    NodeMode,
    DaemonSet,
}

impl Mode {
    fn tag(self) -> &'static str {
        match self {
            Mode::NodeMode => "nm",
            Mode::DaemonSet => "ds",
        }
    }
}

/// (F10) Reboots of `efa-a` with four pods asking for EFAs bound to it each time (a bare pod, a
/// Deployment's, a Job's, and one bound while the node is down): node mode, started as its
/// unit starts it before the kubelet on every boot and stopped after it at shutdown, refuses
/// none; the DaemonSet's count is measured in the same run, F6's way.
pub fn node_mode_survives_reboots(cluster: &mut Cluster) -> Result<Detail> {
    let reboots = boots()?;
    cluster.host.request("chart", &[])?;
    serving(&cluster.kube, &[NODE])?;
    let mut service = Service::on_efa_a(cluster)?;
    let outcome = both_modes(cluster, &mut service, reboots);
    let kube = &cluster.kube;
    let restored = service
        .stop()
        .and_then(|()| kube.label_node(NODE, LABEL, None))
        .and_then(|()| serving(&cluster.kube, &[NODE]));
    let (ours, theirs) = outcome?;
    restored.context("giving efa-a back to the DaemonSet")?;
    let line = format!(
        "node mode refused {}/{}, kubelet start → Register {}; DaemonSet refused {}/{}, Register {}",
        ours.refused,
        ours.pods,
        ours.registers(),
        theirs.refused,
        theirs.pods,
        theirs.registers()
    );
    if ours.refused > 0 {
        bail!("{line}");
    }
    Ok(line)
}

fn both_modes(
    cluster: &mut Cluster,
    service: &mut Service,
    reboots: u32,
) -> Result<(Tally, Tally)> {
    let (mut ours, mut theirs) = (Tally::default(), Tally::default());
    for round in 1..=reboots {
        reboot(cluster, Mode::DaemonSet, round, service, &mut theirs)?;
    }
    cluster.kube.label_node(NODE, LABEL, Some("true"))?;
    wait_until(
        &format!("no DaemonSet pod on the labelled {NODE}"),
        secs(60),
        || {
            cluster
                .kube
                .plugin_pods(NODE)
                .is_ok_and(|pods| pods.is_empty())
        },
    )?;
    service.start("f10-0")?;
    for round in 1..=reboots {
        reboot(cluster, Mode::NodeMode, round, service, &mut ours)?;
    }
    Ok((ours, theirs))
}

/// One power cycle of `efa-a` with four pods bound to it; adds to `tally`.
fn reboot(
    cluster: &mut Cluster,
    mode: Mode,
    round: u32,
    service: &mut Service,
    tally: &mut Tally,
) -> Result<()> {
    let tag = format!("f10-{}{round}", mode.tag());
    let (bare, deploy, batch, late) = (
        format!("{tag}-bare"),
        format!("{tag}-deploy"),
        format!("{tag}-job"),
        format!("{tag}-late"),
    );
    let kube = &cluster.kube;
    let on_node = Placement::Node(NODE);
    wait_until(
        &format!("{NODE} at {EFAS} before the reboot"),
        secs(40),
        || kube.allocatable(NODE, RESOURCE).ok().flatten() == Some(EFAS),
    )?;
    kube.apply(&pod(&bare, 1, "Always", on_node))?;
    kube.apply(&deployment(&deploy, 1, on_node))?;
    kube.apply(&job(&batch, 1, on_node))?;
    let running = |selector: &str| -> Result<Option<String>> {
        Ok(kube
            .pods_labelled(selector)?
            .into_iter()
            .find(|pod| pod.status.phase == "Running")
            .map(|pod| pod.metadata.name))
    };
    let bound = wait_for(&format!("{tag}'s three pods Running"), secs(90), || {
        let bare_running = kube
            .pod(&bare)?
            .is_some_and(|pod| pod.status.phase == "Running");
        let deploy_pod = running(&format!("app={deploy}"))?;
        let job_pod = running(&format!("job-name={batch}"))?;
        Ok(match (bare_running, deploy_pod, job_pod) {
            (true, Some(deploy_pod), Some(job_pod)) => Some([bare.clone(), deploy_pod, job_pod]),
            _ => None,
        })
    })
    .map_err(|err| anyhow!("{err}: {}", kube.events_of(&bare)))?;

    let log = cluster.run.join(format!("logs/kubelet-{NODE}.log"));
    let mark = fs::metadata(&log).map(|meta| meta.len()).unwrap_or(0);
    // Shutdown: the kubelet and the containers first, node mode after them.
    cluster.host.request("stop_node", &[NODE])?;
    service.stop()?;
    cluster
        .kube
        .apply(&pod(&late, 1, "Always", Placement::Bound(NODE)))?;
    // Boot: containerd, then (node mode) the plugin up to READY=1, then the kubelet.
    cluster.host.request("start_containerd", &[NODE])?;
    if mode == Mode::NodeMode {
        service.start(&tag)?;
    }
    cluster.host.request("start_kubelet", &[NODE])?;
    let register_ms = wait_for(
        "the plugin's registration after the boot",
        secs(120),
        || Ok(start_to_register_in(&log_since(&log, mark)?).ok()),
    )?;

    let mut pods: Vec<String> = bound.into();
    pods.push(late.clone());
    let kube = &cluster.kube;
    let refused = settled(kube, &pods, secs(120))?;
    tally.refused += refused;
    tally.pods += pods.len();
    tally.register_ms.push(register_ms);
    crate::note(&format!(
        "F10 {} reboot {round}: refused {refused}/{}, kubelet start → Register {register_ms} ms",
        mode.tag(),
        pods.len()
    ));
    kube.delete(&[
        &format!("deployment/{deploy}"),
        &format!("job/{batch}"),
        &format!("pod/{bare}"),
        &format!("pod/{late}"),
    ])?;
    wait_until(&format!("{tag}'s pods gone"), secs(60), || {
        kube.run(&["get", "pods", "-n", "default", "--no-headers"])
            .is_ok_and(|pods| !pods.contains(&tag))
    })
}

/// The kubelet's log from byte `mark` on: the lines of its latest start.
pub(super) fn log_since(log: &Path, mark: u64) -> Result<String> {
    let text = fs::read(log).with_context(|| format!("read {}", log.display()))?;
    let start = (mark as usize).min(text.len());
    Ok(String::from_utf8_lossy(&text[start..]).into_owned())
}

/// How many of `pods` the kubelet refused at admission (`Failed`, `UnexpectedAdmissionError`)
/// once each is Running or refused, within `deadline`; any other end fails the case.
pub(super) fn settled(kube: &super::Kube, pods: &[String], deadline: Duration) -> Result<usize> {
    let outcome = |pod: &Option<Pod>| match pod {
        Some(pod) if pod.status.phase == "Running" => Some(false),
        Some(pod) if pod.status.phase == "Failed" => Some(true),
        _ => None,
    };
    let states = wait_for(
        "every pod Running or refused after the boot",
        deadline,
        || {
            let states = pods
                .iter()
                .map(|name| kube.pod(name))
                .collect::<Result<Vec<_>>>()?;
            Ok(states
                .iter()
                .all(|pod| outcome(pod).is_some())
                .then_some(states))
        },
    )
    .map_err(|err| {
        let now: Vec<String> = pods
            .iter()
            .map(|name| match kube.pod(name) {
                Ok(Some(pod)) => format!("{name} {} {}", pod.status.phase, pod.status.reason),
                Ok(None) => format!("{name} gone"),
                Err(err) => format!("{name} ({err:#})"),
            })
            .collect();
        anyhow!("{err}: {}", now.join(", "))
    })?;
    let mut refused = 0;
    for (name, pod) in pods.iter().zip(&states) {
        let Some(pod) = pod else { continue };
        if pod.status.phase == "Failed" {
            if pod.status.reason != "UnexpectedAdmissionError" {
                bail!("{name} failed for another reason: {}", pod.status.reason);
            }
            refused += 1;
        }
    }
    Ok(refused)
}
