//! Installing the plugin on `efa-a` as users do: the kustomize overlay of the shipped manifests,
//! the same on a node without EFA, and the Helm chart from install to uninstall. The installs
//! themselves are the suite's bash (host requests); what they leave is read here.

use anyhow::{Result, anyhow, ensure};

use super::Cluster;
use super::single_node::{
    EFAS, NODE, Overlay, helm_template, installed_ok, kustomize_install, no_plugin_pod_within_60s,
    run_job, shown, test_values,
};
use super::{NODE_STATUS_PERIOD, pod_spec};
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::wait::{secs, wait_for, wait_until};

/// The chart's release in the Helm cases.
pub const RELEASE: &str = "efa";
/// The volume through which the overlays and values mount the fake tree.
const SYSFS_VOLUME: &str = "e2e-sysfs";
/// The empty tree of a node without EFA, where the suite lays it out.
const NO_EFA_TREE: &str = "/run/efa-device-plugin-e2e/no-efa";
/// The plugin's socket in the kubelet's device-plugin dir.
const PLUGIN_SOCKET: &str = "/var/lib/kubelet/device-plugins/efa-device-plugin.sock";

/// (1) The p4d overlay applied with `kubectl apply -k` after whatever was installed: a Ready
/// plugin pod on the pod network with the shipped securityContext, and 4 EFAs allocatable.
pub fn kustomize(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("uninstall", &[])?;
    kustomize_install(cluster, Overlay::P4d)?;
    Ok(Detail::new())
}

/// (8) The no-efa overlay: the plugin pod is Ready on the empty tree and the node offers none.
/// A kustomize install is replaced in place; a release of the chart would fight the overlay
/// over its objects.
pub fn no_efa(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("uninstall_releases", &[])?;
    cluster.host.request("kustomize", &["no-efa"])?;
    let kube = &cluster.kube;
    wait_until("a Ready plugin pod on the empty tree", secs(120), || {
        kube.serving_plugin_pod(NODE)
            .ok()
            .flatten()
            .is_some_and(|pod| pod.host_path_of(SYSFS_VOLUME) == Some(NO_EFA_TREE))
    })
    .map_err(|err| {
        let pods = kube.plugin_pods(NODE).map_or_else(
            |err| format!("{err:#}"),
            |pods| {
                pods.iter()
                    .map(|pod| format!("{} {}", pod.metadata.name, pod.status.phase))
                    .collect::<Vec<_>>()
                    .join("|")
            },
        );
        anyhow!("{err}: {pods}")
    })?;
    let allocatable = || kube.allocatable(NODE, RESOURCE);
    wait_until(
        "allocatable 0 or absent",
        NODE_STATUS_PERIOD + secs(30),
        || matches!(allocatable(), Ok(None | Some(0))),
    )
    .map_err(|err| {
        anyhow!(
            "{err}: allocatable {RESOURCE} is {} on a node without EFA",
            shown(allocatable().ok().flatten())
        )
    })?;
    Ok(format!("allocatable {}", shown(allocatable()?)))
}

/// (9) The chart: the API server accepts, server-side, every object it renders with the defaults
/// and with every switch on; installed with only the test values added, it passes cases 1 and 2
/// again; `helm upgrade` rolls the pod; `helm uninstall` leaves no pod and no socket.
pub fn helm(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("uninstall", &[])?;
    // The PodMonitor and PrometheusRule need their CRDs.
    cluster.host.request("operator_crds", &[])?;
    let variant = cluster.repo.join("tests/deploy/values-variant.yaml");
    let variant = variant.to_string_lossy();
    for values in [None, Some(&*variant)] {
        let args: Vec<&str> = values.map(|path| vec!["-f", path]).unwrap_or_default();
        let rendered = cluster.host.request("template", &args)?;
        let which = values.unwrap_or("default values");
        cluster
            .kube
            .run(&["apply", "--dry-run=server", "-f", &rendered])
            .map_err(|err| {
                anyhow!("API server rejected the chart rendered with {which}: {err:#}")
            })?;
    }
    let shipped = helm_template(cluster, &[])?;
    let values = test_values(cluster);
    pod_spec::compare(&shipped, &helm_template(cluster, &["-f", &values])?)?;
    cluster.host.request("helm_install", &[RELEASE])?;
    let old = installed_ok(cluster, &shipped)?.metadata.name;
    run_job(cluster, "helm-job", 2)?;
    cluster.host.request(
        "helm_upgrade",
        &[RELEASE, "--set", "config.log-level=debug"],
    )?;
    let kube = &cluster.kube;
    wait_for("the plugin pod rolled", secs(120), || {
        let new = kube.serving_plugin_pod(NODE)?;
        Ok(new.filter(|pod| {
            pod.metadata.name != old
                && kube.allocatable(NODE, RESOURCE).ok().flatten() == Some(EFAS)
        }))
    })
    .map_err(|err| anyhow!("{err}: plugin pod did not roll after helm upgrade (still {old})"))?;
    cluster.host.request("helm_uninstall", &[RELEASE])?;
    no_plugin_pod_within_60s(cluster, "after helm uninstall")?;
    let socket = cluster.host_path(NODE, PLUGIN_SOCKET)?;
    ensure!(
        !socket.exists(),
        "{} remains after helm uninstall",
        socket.display()
    );
    Ok(Detail::new())
}
