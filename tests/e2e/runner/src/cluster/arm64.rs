//! The arm64 image on `efa-a`, an amd64 node that runs it under qemu-aarch64 through
//! binfmt_misc (the suite registers Debian's entry): installed from the p4d-arm64 overlay, then
//! cases 2, 4 and 5 again against its plugin pod.

use std::fs;
use std::time::Instant;

use anyhow::{Context, Result, ensure};

use super::Cluster;
use super::holder::metrics_of;
use super::single_node::{
    IMAGE, NODE, Overlay, ensure_plugin, kustomize_install, runs_arm64_image,
};
use super::workloads::{job_with_plugin, operator_cli_in};
use crate::cases::Detail;

/// (A1) The p4d-arm64 overlay after whatever was installed: case 1's checks, the pod runs the
/// arm64 image alone, and the kernel runs qemu for the container's process, which shows the pod
/// did not get the amd64 image.
pub fn install(cluster: &mut Cluster) -> Result<Detail> {
    cluster.host.request("uninstall", &[])?;
    let start = Instant::now();
    let pod = kustomize_install(cluster, Overlay::P4dArm64)?;
    let serving = start.elapsed();
    let image = pod
        .status
        .container_statuses
        .first()
        .map(|container| container.image.as_str());
    ensure!(
        runs_arm64_image(&pod),
        "plugin pod {} runs {image:?}, want {IMAGE}-arm64",
        pod.metadata.name
    );
    let container = pod
        .container_id()
        .context("the plugin pod has no container")?;
    let pid = cluster.host.request("task_pid", &[NODE, container])?;
    let exe = fs::read_link(format!("/proc/{pid}/exe"))
        .with_context(|| format!("no plugin process on the host (pid '{pid}')"))?;
    ensure!(
        exe.to_string_lossy().ends_with("/qemu-aarch64-static"),
        "the plugin pod's process runs {}, not qemu-aarch64",
        exe.display()
    );
    Ok(format!(
        "the plugin process is {}; Ready with 4 allocatable {:.1}s after the install",
        exe.display(),
        serving.as_secs_f64()
    ))
}

/// (A2) Case 2's Job against the arm64 plugin.
pub fn job(cluster: &mut Cluster) -> Result<Detail> {
    ensure_plugin(cluster, Overlay::P4dArm64)?;
    job_with_plugin(cluster)
}

/// (A3) Case 4's `list` in the arm64 plugin pod.
pub fn operator_cli(cluster: &mut Cluster) -> Result<Detail> {
    let plugin = ensure_plugin(cluster, Overlay::P4dArm64)?;
    operator_cli_in(cluster, &plugin)
}

/// (A4) Case 5's metrics and holder, scraped from the arm64 plugin pod.
pub fn metrics(cluster: &mut Cluster) -> Result<Detail> {
    let plugin = ensure_plugin(cluster, Overlay::P4dArm64)?;
    metrics_of(cluster, &plugin)
}
