//! The fixtures of the cases on one node, `efa-a` (a fake p4d with 4 EFAs): the plugin installed
//! as users install it and found serving, a long-running holder of 2 EFAs, and Jobs whose
//! containers see exactly their EFAs. Each is cheap when the state is there already, so a case
//! run alone sets up what the cases before it would have left.

use std::fs;
use std::net::IpAddr;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, ensure};
use efa_device_plugin::testkit::simulate::FakeDevice;

use super::fleet::{EFA_A, Held, check_devices, node_efas, start_pod, summary, uverbs_entries};
use super::kube::{Kube, Pod};
use super::workload::{Placement, short_job};
use super::{Cluster, NODE_STATUS_PERIOD, pod_spec};
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::wait::{secs, wait_for, wait_until};

pub const NODE: &str = EFA_A;
/// The EFAs of `efa-a`'s fake p4d.
pub const EFAS: u64 = 4;
/// The long-running pod with 2 EFAs that the cases reading a running pod share, as a new pod
/// would cost a scheduling round each.
pub const HOLDER: &str = "holder";
/// The release of this chart that the README and docs/migration.md install.
pub const OURS_RELEASE: &str = "efa-device-plugin";
/// The pod network (`POD_SUBNET` in cluster.sh), whose first address is the node's own.
const POD_NETWORK: [u8; 3] = [198, 18, 0];
/// The image the suite builds, imported under this name; its arm64 half alone is `IMAGE-arm64`.
pub const IMAGE: &str = "localhost/efa-device-plugin:e2e";

/// A kustomize overlay of the shipped manifests (`tests/e2e/cluster/kustomize/`), and which
/// serving plugin a case that needs it accepts.
#[derive(Clone, Copy)]
pub enum Overlay {
    /// The p4d tree with the multi-arch image: any serving plugin with 4 EFAs will do.
    P4d,
    /// The same with the arm64 image alone: only a plugin that runs it will do.
    P4dArm64,
}

impl Overlay {
    fn dir(self) -> &'static str {
        match self {
            Overlay::P4d => "p4d",
            Overlay::P4dArm64 => "p4d-arm64",
        }
    }

    fn accepts(self, pod: &Pod) -> bool {
        match self {
            Overlay::P4d => true,
            Overlay::P4dArm64 => runs_arm64_image(pod),
        }
    }
}

/// Whether the pod runs the arm64 image alone, as the suite names it.
pub fn runs_arm64_image(pod: &Pod) -> bool {
    pod.status
        .container_statuses
        .first()
        .is_some_and(|container| container.image == format!("{IMAGE}-arm64"))
}

fn allocatable(cluster: &Cluster) -> Option<u64> {
    cluster.kube.allocatable(NODE, RESOURCE).ok().flatten()
}

/// `efa-a`'s allocatable as the Node shows it: a count, or `none`.
pub fn shown(count: Option<u64>) -> String {
    count.map_or_else(|| "none".to_owned(), |count| count.to_string())
}

/// `name phase node` of each plugin pod, for a failure's reason.
fn plugin_pods(cluster: &Cluster) -> String {
    cluster
        .kube
        .all_plugin_pods()
        .map_or_else(|err| format!("{err:#}"), |pods| summary(&pods))
}

/// A serving plugin pod on `efa-a` that `overlay` accepts, with 4 EFAs allocatable; otherwise
/// the overlay installed after whatever else is there is gone.
pub fn ensure_plugin(cluster: &mut Cluster, overlay: Overlay) -> Result<Pod> {
    if let Some(pod) = cluster.kube.serving_plugin_pod(NODE)?
        && overlay.accepts(&pod)
        && allocatable(cluster) == Some(EFAS)
    {
        return Ok(pod);
    }
    cluster.host.request("uninstall", &[])?;
    kustomize_install(cluster, overlay)
}

/// The plugin installed from `overlay` as users install the shipped manifests, checked first to
/// add nothing but the fake tree (and the image), and found as [`installed_ok`] says.
pub fn kustomize_install(cluster: &mut Cluster, overlay: Overlay) -> Result<Pod> {
    let kustomize = |dir: &std::path::Path| -> Result<Vec<serde_json::Value>> {
        pod_spec::load(&cluster.kube.run(&["kustomize", &dir.to_string_lossy()])?)
    };
    let test = kustomize(
        &cluster
            .repo
            .join("tests/e2e/cluster/kustomize")
            .join(overlay.dir()),
    )?;
    let shipped = kustomize(&cluster.repo.join("manifests"))?;
    // Anything else would mean the suite tests a pod spec users do not get.
    pod_spec::compare(&shipped, &test)?;
    cluster.host.request("kustomize", &[overlay.dir()])?;
    installed_ok(cluster, &shipped)
}

/// The chart rendered by `helm template` with `helm_args`, read back.
pub fn helm_template(cluster: &mut Cluster, helm_args: &[&str]) -> Result<Vec<serde_json::Value>> {
    let path = cluster.host.request("template", helm_args)?;
    pod_spec::load(&fs::read_to_string(&path).with_context(|| format!("read {path}"))?)
}

/// The suite's chart values: the local image and the fake tree.
pub fn test_values(cluster: &Cluster) -> String {
    cluster
        .repo
        .join("tests/e2e/cluster/values-e2e.yaml")
        .to_string_lossy()
        .into_owned()
}

/// A serving plugin pod on `efa-a` within 120 s, on the pod network, with the securityContext
/// of `shipped` (the rendered manifests users install), and the node's 4 EFAs allocatable.
pub fn installed_ok(cluster: &mut Cluster, shipped: &[serde_json::Value]) -> Result<Pod> {
    let pod = wait_for("a Ready plugin pod", secs(120), || {
        cluster.kube.serving_plugin_pod(NODE)
    })
    .map_err(|err| {
        anyhow!(
            "{err}: {}; {}",
            plugin_pods(cluster),
            cluster.kube.plugin_events()
        )
    })?;
    let ip: Option<IpAddr> = pod.status.pod_ip.parse().ok();
    let on_pod_network = matches!(ip, Some(IpAddr::V4(ip))
        if ip.octets()[..3] == POD_NETWORK && ip.octets()[3] != 1);
    ensure!(
        on_pod_network,
        "plugin pod {} has IP '{}', want one on the pod network {}.0/24 other than the node's",
        pod.metadata.name,
        pod.status.pod_ip,
        POD_NETWORK.map(|octet| octet.to_string()).join(".")
    );
    let want = pod_spec::shipped_security_context(shipped)?;
    let got = pod_spec::security_context(&pod)?;
    ensure!(
        got == want,
        "plugin pod's securityContext differs from the shipped one: got {got}, want {want}"
    );
    allocatable_settles(
        &cluster.kube,
        EFAS,
        SETTLES,
        "with the shipped securityContext",
    )?;
    Ok(pod)
}

/// How long allocatable may take to settle after what moved it: the node's next status report,
/// and 30 s for the plugin to have said so.
pub const SETTLES: Duration = Duration::from_secs(NODE_STATUS_PERIOD.as_secs() + 30);

/// `efa-a`'s allocatable reaches `count` within `within`; otherwise the error says what it is
/// `when`.
pub fn allocatable_settles(kube: &Kube, count: u64, within: Duration, when: &str) -> Result<()> {
    let allocatable = || kube.allocatable(NODE, RESOURCE).ok().flatten();
    wait_until(&format!("{NODE} at {count} allocatable"), within, || {
        allocatable() == Some(count)
    })
    .map_err(|err| {
        anyhow!(
            "{err}: node allocatable {RESOURCE} is {} {when}, want {count}",
            shown(allocatable())
        )
    })
}

/// Waits until no plugin pod is left, `after` what should have removed it.
pub fn no_plugin_pod_within_60s(cluster: &Cluster, after: &str) -> Result<()> {
    wait_until(&format!("no plugin pod {after}"), secs(60), || {
        cluster.kube.no_plugin_pods().unwrap_or(false)
    })
    .map_err(|err| anyhow!("{err}: {}", plugin_pods(cluster)))
}

/// [`ensure_plugin`] with any plugin, and the holder running with 2 EFAs (started if it is not),
/// with the IDs `efa-a`'s kubelet gave it.
pub fn ensure_holder(cluster: &mut Cluster) -> Result<Held> {
    ensure_plugin(cluster, Overlay::P4d)?;
    match cluster.kube.pod(HOLDER)? {
        Some(pod) if pod.status.phase == "Running" => {
            let ids = cluster
                .checkpoint(&pod.spec.node_name)?
                .allocated(&pod.metadata.uid, RESOURCE);
            // Its container's listing was checked against these when it started.
            let entries = uverbs_entries(cluster, &pod.spec.node_name, &ids)?;
            Ok(Held {
                name: HOLDER.to_owned(),
                node: pod.spec.node_name,
                ids,
                entries,
            })
        }
        _ => start_pod(cluster, HOLDER, 2, Placement::Anywhere),
    }
}

/// `efa-a`'s EFAs, as testkit lays out its p4d, checked against the node's tree.
pub fn efas(cluster: &mut Cluster) -> Result<Vec<FakeDevice>> {
    node_efas(cluster, NODE)
}

/// The Job `name` asking for `count` EFAs, made anew: the scheduler places it, its container
/// sees exactly its EFAs on `efa-a`, and it completes; then it is deleted with its pod, which
/// the kubelet would otherwise list as holding its EFAs.
pub fn run_job(cluster: &mut Cluster, name: &str, count: u32) -> Result<Held> {
    let job = format!("job/{name}");
    cluster.kube.delete(&[&job])?;
    cluster.kube.apply(&short_job(name, count, &[]))?;
    let pod = running_job_pod(cluster, name)?;
    let held = check_devices(cluster, &pod.metadata.name, count, NODE)?;
    cluster
        .kube
        .run(&[
            "wait",
            "-n",
            "default",
            "--for=condition=Complete",
            &job,
            "--timeout=60s",
        ])
        .map_err(|err| anyhow!("Job {name} not Complete within 60s: {err:#}"))?;
    cluster.kube.delete(&[&job])?;
    let selector = format!("job-name={name}");
    wait_until(&format!("Job {name}'s pod gone"), secs(60), || {
        cluster
            .kube
            .pods_labelled(&selector)
            .is_ok_and(|pods| pods.is_empty())
    })?;
    Ok(held)
}

/// The Running pod of Job `name`, within 60 s.
pub fn running_job_pod(cluster: &Cluster, name: &str) -> Result<Pod> {
    let selector = format!("job-name={name}");
    let kube = &cluster.kube;
    wait_for(&format!("a Running pod of Job {name}"), secs(60), || {
        Ok(kube
            .pods_labelled(&selector)?
            .into_iter()
            .find(|pod| pod.status.phase == "Running"))
    })
    .map_err(|err| {
        let pods = kube
            .pods_labelled(&selector)
            .map_or_else(|err| format!("{err:#}"), |pods| summary(&pods));
        anyhow!("{err}: {pods}")
    })
}

/// The log `check_devices` kept of pod `name`.
pub fn kept_log(cluster: &Cluster, name: &str) -> Result<String> {
    let path = cluster.run.join(format!("logs/pod-{name}.log"));
    fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
}

/// `body` between two runs of `reset`, which leaves `efa-a` as a group of cases starts from:
/// the first's failure fails the case before it starts, the second's only when `body` passed.
pub fn between_resets(
    cluster: &mut Cluster,
    reset: fn(&mut Cluster) -> Result<()>,
    body: impl FnOnce(&mut Cluster) -> Result<Detail>,
) -> Result<Detail> {
    reset(cluster).context("resetting efa-a before the case")?;
    let outcome = body(cluster);
    let after = reset(cluster);
    let detail = outcome?;
    after.context("resetting efa-a after the case")?;
    Ok(detail)
}
