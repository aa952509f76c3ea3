//! `efa-device-plugin demo`: the real plugin against a simulated p5.48xlarge and an in-process
//! kubelet stand-in, over real Unix sockets, for a newcomer without EFA hardware.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, anyhow};
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, HEALTHY,
    PreferredAllocationRequest,
};
use crate::testkit::kubelet_stub::{KubeletStub, KubeletView};
use crate::testkit::simulate::{FakeDevice, FakeNode, Nodes, Shape};

const STEP_TIMEOUT: Duration = Duration::from_secs(10);

pub fn run() -> anyhow::Result<()> {
    // Plugin logs would drown the demo's story; warnings still show.
    crate::telemetry::init_logging(
        crate::telemetry::LogFormat::Text,
        tracing_subscriber::EnvFilter::new("warn"),
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let scratch = tempfile::Builder::new()
        .prefix("efa-device-plugin-demo.")
        .tempdir()
        .context("creating the demo's scratch dir")?;
    let outcome = runtime.block_on(story(scratch.path()));
    let where_ = scratch.path().display().to_string();
    scratch.close().context("removing the demo's scratch dir")?;
    outcome?;
    println!("\nDone; removed {where_}.");
    Ok(())
}

async fn story(root: &std::path::Path) -> anyhow::Result<()> {
    let (node, devices) = FakeNode::build(root, Shape::P5, Nodes::Files)?;
    println!(
        "Simulated a p5.48xlarge under {}: {} EFAs over 2 NUMA nodes.",
        root.display(),
        devices.len()
    );
    let plugin_dir = root.join("device-plugins");
    let kubelet = KubeletStub::start(&plugin_dir)?;
    let settings = Settings {
        sysfs_root: node.sysfs.clone(),
        dev_root: node.dev.clone(),
        device_plugin_dir: plugin_dir,
        rescan_interval: Duration::from_secs(1),
        // The demo is self-contained: no port, and none of the host's kubelet dirs.
        metrics_address: None,
        pod_resources_socket: root.join("pod-resources/kubelet.sock"),
        plugins_registry_dir: root.join("plugins_registry"),
        // The simulated nodes are regular files: the demo needs no CAP_MKNOD.
        test_only_regular_file_nodes: true,
        ..Settings::default()
    };
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (settings, shutdown) = (settings.clone(), shutdown.clone());
        async move { crate::app::run(&settings, shutdown).await }
    });

    let outcome = async {
        let view = registration(&kubelet, devices.len()).await?;
        let chosen = allocate_four(&kubelet, &devices, &view).await?;
        fail_and_recover(&kubelet, &node, &devices, &chosen[1]).await
    }
    .await;

    shutdown.cancel();
    running.await.context("plugin task")??;
    kubelet.stop().await;
    outcome
}

/// The kubelet's side of the registration: what it was told, and the devices it lists.
async fn registration(kubelet: &KubeletStub, efas: usize) -> anyhow::Result<KubeletView> {
    let view = wait(kubelet, "registration", |v| v.devices.len() == efas).await?;
    let request = view.last_request.clone().unwrap_or_default();
    println!(
        "\n[kubelet] Register: version={} endpoint={} resource={}",
        request.version, request.endpoint, request.resource_name
    );
    println!("[kubelet] ListAndWatch: {} devices", view.devices.len());
    println!("  {:<14} {:<10} NUMA", "ID", "HEALTH");
    for device in &view.devices {
        let numa = device
            .topology
            .as_ref()
            .and_then(|t| t.nodes.first())
            .map_or("-".to_owned(), |n| n.id.to_string());
        println!("  {:<14} {:<10} {numa}", device.id, device.health);
    }
    Ok(view)
}

/// As the kubelet does for a pod asking for 4: offers every free device, then allocates what
/// the plugin prefers. Returns the IDs allocated.
async fn allocate_four(
    kubelet: &KubeletStub,
    devices: &[FakeDevice],
    view: &KubeletView,
) -> anyhow::Result<Vec<String>> {
    let mut client = kubelet
        .plugin()
        .ok_or_else(|| anyhow!("no plugin connection"))?;
    let offered: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    let preferred = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: offered.clone(),
                must_include_device_i_ds: Vec::new(),
                allocation_size: 4,
            }],
        })
        .await?
        .into_inner();
    let chosen: Vec<String> = preferred
        .container_responses
        .into_iter()
        .flat_map(|c| c.device_i_ds)
        .collect();
    let placed: Vec<&FakeDevice> = devices
        .iter()
        .filter(|d| chosen.contains(&d.ibdev))
        .collect();
    let numa: BTreeSet<i32> = placed.iter().map(|d| d.numa).collect();
    let roots: BTreeSet<&String> = placed.iter().filter_map(|d| d.parents.first()).collect();
    println!(
        "\n[kubelet] GetPreferredAllocation: 4 of {} offered -> {chosen:?}\n  NUMA nodes {numa:?}, PCIe roots {roots:?}",
        offered.len()
    );
    let response = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: chosen.clone(),
            }],
        })
        .await?
        .into_inner();
    println!("\n[kubelet] Allocate {chosen:?}:");
    for spec in response.container_responses.iter().flat_map(|c| &c.devices) {
        println!(
            "  DeviceSpec host_path={} container_path={} permissions={}",
            spec.host_path, spec.container_path, spec.permissions
        );
    }
    Ok(chosen)
}

/// Removes the node of the EFA `id` and puts it back: the kubelet sees it turn Unhealthy and
/// Healthy again.
async fn fail_and_recover(
    kubelet: &KubeletStub,
    node: &FakeNode,
    devices: &[FakeDevice],
    id: &str,
) -> anyhow::Result<()> {
    let victim = devices
        .iter()
        .find(|d| d.ibdev == id)
        .ok_or_else(|| anyhow!("allocated device not simulated"))?;
    println!(
        "\nRemoving {} (the node of {id}) to simulate a failure...",
        node.node_path(victim).display(),
    );
    node.remove_node(victim)?;
    let view = wait(kubelet, "the failure", |v| health_of(v, id) == Some(false)).await?;
    println!(
        "[kubelet] ListAndWatch: {id} is {}; {} of {} allocatable",
        view.devices
            .iter()
            .find(|d| d.id == id)
            .map_or("?", |d| d.health.as_str()),
        view.healthy(),
        view.devices.len()
    );
    println!("Restoring the node...");
    node.create_node(victim)?;
    let view = wait(kubelet, "the recovery", |v| health_of(v, id) == Some(true)).await?;
    println!(
        "[kubelet] ListAndWatch: {id} is Healthy again; {} of {} allocatable",
        view.healthy(),
        view.devices.len()
    );
    Ok(())
}

fn health_of(view: &KubeletView, id: &str) -> Option<bool> {
    view.devices
        .iter()
        .find(|d| d.id == id)
        .map(|d| d.health == HEALTHY)
}

async fn wait(
    kubelet: &KubeletStub,
    what: &str,
    done: impl Fn(&KubeletView) -> bool,
) -> anyhow::Result<KubeletView> {
    kubelet
        .wait_for(STEP_TIMEOUT, done)
        .await
        .map_err(|view| anyhow!("timed out waiting for {what}; the kubelet saw {view:?}"))
}
