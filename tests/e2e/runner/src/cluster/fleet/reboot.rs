//! `efa-a` rebooted under pods holding its EFAs (F6), in the power cycle's steps F10 takes too:
//! how long from the kubelet's start to the plugin's registration, and what the kubelet did
//! with each pod bound there.

use std::fs;

use anyhow::{Context, Result, anyhow, ensure};
use serde::Deserialize;

use super::{EFA_A, fleet_chart, serving};
use crate::cases::Detail;
use crate::cluster::reboots::{log_since, settled};
use crate::cluster::workload::{Placement, deployment, pod};
use crate::cluster::{Cluster, Kube};
use crate::reboot::start_to_register_in;
use crate::wait::{secs, wait_for, wait_until};

/// A bare pod that always restarts, bound by the scheduler before the reboot.
const BARE: &str = "rb-bare";
/// A Deployment's pod, which its controller replaces if the kubelet refuses it.
const DEPLOY: &str = "rb-deploy";
/// Bound to `efa-a` while it is down, as a pod bound before a reboot and not started yet: the
/// kubelet admits it at start, with or without the plugin.
const BOUND_WHILE_DOWN: &str = "rb-new";
/// EFAs each pod holds.
const HELD: u32 = 2;

/// (F6) A bare pod and a Deployment's pod holding EFAs on `efa-a`, which is powered off; a third
/// pod bound to it meanwhile; powered on: kubelet start to the plugin's registration, and each
/// pod Running again or refused (`UnexpectedAdmissionError`), the Deployment Running there.
pub fn efa_a_rebooted(cluster: &mut Cluster) -> Result<Detail> {
    fleet_chart(cluster, &[])?;
    let kube = &cluster.kube;
    let on_a = Placement::Node(EFA_A);
    kube.apply(&pod(BARE, HELD, "Always", on_a))
        .and_then(|()| kube.apply(&deployment(DEPLOY, HELD, on_a)))
        .context("the reboot case's pods were not accepted")?;
    wait_until(&format!("pod {BARE} Running"), secs(60), || {
        kube.pod(BARE)
            .is_ok_and(|pod| pod.is_some_and(|pod| pod.status.phase == "Running"))
    })
    .and_then(|()| deployment_running_on_a(kube, secs(60)))
    .map_err(|err| {
        anyhow!(
            "the reboot case's pods are not Running: {err:#}: {}",
            outcome(kube).join("|")
        )
    })?;

    let log = cluster.run.join(format!("logs/kubelet-{EFA_A}.log"));
    cluster.host.request("stop_node", &[EFA_A])?;
    cluster
        .kube
        .apply(&pod(
            BOUND_WHILE_DOWN,
            HELD,
            "Always",
            Placement::Bound(EFA_A),
        ))
        .with_context(|| format!("pod {BOUND_WHILE_DOWN} not accepted"))?;
    // What the kubelet logs from here on is its new start's.
    let mark = fs::metadata(&log).map(|meta| meta.len()).unwrap_or(0);
    cluster.host.request("start_containerd", &[EFA_A])?;
    cluster.host.request("start_kubelet", &[EFA_A])?;
    // The API shows the old plugin pod Ready until the kubelet says otherwise: its log tells.
    let register_ms = wait_for(
        &format!("the registration of the plugin in {EFA_A}'s kubelet log after its reboot"),
        secs(120),
        || Ok(start_to_register_in(&log_since(&log, mark)?).ok()),
    )?;

    let kube = &cluster.kube;
    let bound = [BARE.to_owned(), BOUND_WHILE_DOWN.to_owned()];
    settled(kube, &bound, secs(90))
        .and_then(|_| deployment_running_on_a(kube, secs(90)))
        .map_err(|err| {
            anyhow!(
                "pods not settled 90s after the reboot: {err:#}: {}",
                outcome(kube).join("|")
            )
        })?;
    let outcome = outcome(kube).join(",");
    for name in &bound {
        let pod = kube
            .pod(name)?
            .with_context(|| format!("pod {name} is gone after the reboot: {outcome}"))?;
        let (phase, reason) = (&pod.status.phase, &pod.status.reason);
        ensure!(
            (phase == "Running" && reason.is_empty())
                || (phase == "Failed" && reason == "UnexpectedAdmissionError"),
            "{name} ended '{phase} {reason}' after the reboot, want Running or Failed UnexpectedAdmissionError: {outcome}"
        );
    }
    serving(&cluster.kube, &[EFA_A])?;
    let plugin_ms =
        plugin_start_to_register(cluster)?.map_or_else(|| "?".to_owned(), |ms| ms.to_string());
    let detail = format!(
        "kubelet start to Register {:.1}s, of which the plugin's own start to Register {plugin_ms} ms; pods (name phase reason restarts): {outcome}",
        register_ms as f64 / 1000.0
    );
    crate::note(&format!("F6 reboot: {detail}"));
    let kube = &cluster.kube;
    kube.delete(&[&format!("deployment/{DEPLOY}")])?;
    kube.delete_all_pods()?;
    Ok(detail)
}

/// The Deployment has a Running pod on `efa-a` within `deadline`.
fn deployment_running_on_a(kube: &Kube, deadline: std::time::Duration) -> Result<()> {
    wait_until(
        &format!("a pod of {DEPLOY} Running on {EFA_A}"),
        deadline,
        || {
            kube.pods_labelled(&format!("app={DEPLOY}"))
                .is_ok_and(|pods| {
                    pods.iter()
                        .any(|pod| pod.status.phase == "Running" && pod.spec.node_name == EFA_A)
                })
        },
    )
}

/// Each pod of `default`, oldest first: `name phase reason restarts`, `-` for no reason.
fn outcome(kube: &Kube) -> Vec<String> {
    match kube.pods() {
        Ok(mut pods) => {
            pods.sort_by(|a, b| {
                a.metadata
                    .creation_timestamp
                    .cmp(&b.metadata.creation_timestamp)
            });
            pods.iter()
                .map(|pod| {
                    let status = &pod.status;
                    format!(
                        "{} {} {} {}",
                        pod.metadata.name,
                        or_else(&status.phase, "?"),
                        or_else(&status.reason, "-"),
                        pod.restarts()
                    )
                })
                .collect()
        }
        Err(err) => vec![format!("(no pods: {err:#})")],
    }
}

fn or_else<'a>(text: &'a str, empty: &'a str) -> &'a str {
    if text.is_empty() { empty } else { text }
}

/// A line of the plugin's JSON log, as the chart's values have it log.
#[derive(Deserialize)]
struct Record {
    #[serde(default)]
    message: String,
    #[serde(default)]
    timestamp: String,
}

/// From the `starting` line of `efa-a`'s serving plugin to its first `registered with the
/// kubelet`, in milliseconds by its own log's timestamps; `None` when its log lacks either.
fn plugin_start_to_register(cluster: &Cluster) -> Result<Option<u128>> {
    let kube = &cluster.kube;
    let pod = kube.serving_plugin(EFA_A)?;
    Ok(start_to_register_ms(
        &kube.plugin_log(&pod.metadata.name, false)?,
    ))
}

/// [`plugin_start_to_register`] in the text of one log.
fn start_to_register_ms(log: &str) -> Option<u128> {
    let first = |message: &str| {
        log.lines()
            .filter_map(|line| serde_json::from_str::<Record>(line).ok())
            .find(|record| record.message == message)
            .and_then(|record| humantime::parse_rfc3339(&record.timestamp).ok())
    };
    let start = first("starting")?;
    let registered = first("registered with the kubelet")?;
    let took = registered.duration_since(start).ok()?;
    Some((took.as_secs_f64() * 1000.0).round() as u128)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugins_start_to_register_is_read_from_its_first_lines_of_each() {
        let log = r#"{"timestamp":"2026-12-06T22:33:16.100250Z","level":"INFO","message":"starting"}
not json
{"timestamp":"2026-12-06T22:33:16.200000Z","level":"INFO","message":"listening"}
{"timestamp":"2026-12-06T22:33:16.412750Z","level":"INFO","message":"registered with the kubelet"}
{"timestamp":"2026-12-06T22:33:20.000000Z","level":"INFO","message":"registered with the kubelet"}"#;
        assert_eq!(start_to_register_ms(log), Some(313));
        assert_eq!(
            start_to_register_ms(&log[..log.find("not json").unwrap()]),
            None
        );
    }
}
