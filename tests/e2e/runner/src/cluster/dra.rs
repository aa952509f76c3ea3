//! Handing a node from this plugin to a DRA driver and back with pod specs unchanged (KEP-5004,
//! `DRAExtendedResource`): the DeviceClass `efa.networking.k8s.aws` maps
//! `vpc.amazonaws.com/efa` to DRA, and the plugin's DRA guard (allocatable 0 while `dra.net` is
//! registered) lets the scheduler hand the resource to DRA on that node. The driver is
//! `tests/e2e/dra-standin`, registered as DRANET is; the suite's bash builds its image and
//! starts and stops its DaemonSet.
//!
//! Each case starts from `efa-a` with no plugin, no DRA driver, no DeviceClass, no pod in
//! `default` and the node schedulable, and leaves it so. The fleet's other nodes are not up yet
//! when these cases run, so the pods need no pinning.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde::Deserialize;
use serde_json::Value;

use super::fleet::{EFA_A, efas_of, fleet_node, listing, start_pod, uverbs_entries};
use super::kube::{List, Pod};
use super::single_node::{OURS_RELEASE, between_resets};
use super::workload::{Placement, pod};
use super::{Cluster, NODE_STATUS_PERIOD};
use crate::cases::{Detail, runs_at};
use crate::node::RESOURCE;
use crate::pods::{joined, listing_entries};
use crate::wait::{secs, wait_for, wait_until};

const NODE: &str = EFA_A;
const DRIVER: &str = "dra.net";
/// Where the driver registers with the kubelet, as the plugin's guard watches for it.
const DRA_SOCKET: &str = "/var/lib/kubelet/plugins_registry/dra.net-reg.sock";
/// Where the stand-in writes a claim's CDI spec, `dra.net-efa-<claim uid>.json`.
const CDI_DIR: &str = "/var/run/cdi";
const DEVICE_CLASS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../dra-standin/deviceclass.yaml"
);
const DEVICE_CLASS_NAME: &str = "efa.networking.k8s.aws";
/// The label `nodeScope.mode=labelled` keeps the plugin to.
const SCOPE_LABEL: &str = "efa-device-plugin/enabled";
const STANDIN_NAMESPACE: &str = "kube-system";
const STANDIN_PODS: &str = "name=dra-standin";
const CONFLICT: &str = "efa_device_plugin_dra_conflict";
const HELD_DEVICES: &str = "efa_device_plugin_dra_conflict_held_devices";
/// What the plugin logs for each pod that holds an EFA while the driver is registered.
const HELD_WARNING: &str = "while an EFA DRA driver is registered";
/// The first version whose kubelet starts a DRA pod for the resource a restart found in its
/// device-plugin checkpoint (kubernetes PR #141426).
const RESTART_FIXED: &str = "v1.38";
/// The first DRA helper (k8s.io/dynamic-resource-allocation, built at the cluster's version)
/// that publishes again as soon as the kubelet deletes its ResourceSlice. Before it, the
/// resourceslice controller's DeleteFunc leaves the slice in its mutation cache, so the sync
/// the delete triggers still finds it, and it is created again only by the re-sync due when its
/// last add leaves that cache (`DefaultMutationCacheTTL`, one minute; v0.37 added
/// `c.sliceStore.OnDelete(slice)` to DeleteFunc, resourceslicecontroller.go:666 in v0.37.2). A
/// kubelet wipes its node's slices at every start (`NewDRAPluginManager`).
const REPUBLISHES_AT_ONCE: &str = "v1.37";
/// How long a slice may take to come back after the kubelet wiped it: at once from
/// [`REPUBLISHES_AT_ONCE`], else up to the helper's mutation cache TTL after its last add.
fn republish_within(kube_version: &str) -> Duration {
    if runs_at(Some(REPUBLISHES_AT_ONCE), None, kube_version) {
        secs(30)
    } else {
        secs(90)
    }
}
/// The first pod (through the plugin), the pods after it, and a second DRA pod.
const P1: &str = "dra-p1";
const P2: &str = "dra-p2";
const P3: &str = "dra-p3";

/// (D1) The procedure of docs/dra.md: the plugin serves P1; cordon, drain, install the driver;
/// the guard trips; uncordon; P2, the same spec, runs through DRA; the plugin leaves the node
/// through its label; P2 keeps running.
pub fn handoff(cluster: &mut Cluster) -> Result<Detail> {
    on_dra_node(cluster, handed_off)
}

/// (D2) The driver arrives while P1 holds an EFA through the plugin. Records whom the scheduler
/// then gives which EFA: DRA sees all 4 as free.
pub fn unsafe_handoff(cluster: &mut Cluster) -> Result<Detail> {
    on_dra_node(cluster, handed_off_while_held)
}

/// (D3) From a node DRA serves back to the plugin: drain the DRA pods, remove the driver; the
/// guard clears and the same spec runs through the plugin.
pub fn hand_back(cluster: &mut Cluster) -> Result<Detail> {
    on_dra_node(cluster, handed_back)
}

/// (D4) Without the bridge the guard still withholds every EFA, and nothing serves the
/// resource: the same pod stays Pending.
pub fn no_bridge(cluster: &mut Cluster) -> Result<Detail> {
    on_dra_node(cluster, stays_pending)
}

/// (D5) The hand-over with a kubelet restart in it (kubernetes PR #141426, fixed in 1.38): P1
/// holds an EFA through the plugin; docs/dra.md's hand-over (cordon, drain, driver in, plugin
/// out by its label); the kubelet restarts, with the plugin's resource in its checkpoint; P2,
/// the same spec, is given an EFA by DRA. Records whether P2's container starts. Before 1.38
/// the kubelet may still take the resource for the device plugin's and refuse or fail P2: the
/// case passes either way there and says which; from 1.38 on P2 must run.
pub fn restart_handoff(cluster: &mut Cluster) -> Result<Detail> {
    on_dra_node(cluster, restarted_after_handoff)
}

/// `body` on the node as the DRA cases start from it ([`reset`]).
fn on_dra_node(cluster: &mut Cluster, body: fn(&mut Cluster) -> Result<Detail>) -> Result<Detail> {
    between_resets(cluster, reset, body)
}

/// The node schedulable, with no pod in `default`, no driver, no DeviceClass, no plugin and
/// no scope label. Every step is tried; the first failure is the error.
fn reset(cluster: &mut Cluster) -> Result<()> {
    let kube = &cluster.kube;
    let steps = [
        kube.run(&["uncordon", NODE]).map(drop),
        kube.delete_all_pods(),
        cluster.host.request("dra_standin_down", &[]).map(drop),
        cluster
            .kube
            .run(&["delete", "-f", DEVICE_CLASS, "--ignore-not-found"])
            .map(drop),
        cluster.host.request("uninstall", &[]).map(drop),
        cluster.kube.label_node(NODE, SCOPE_LABEL, None),
        driver_gone(cluster),
    ];
    steps.into_iter().collect()
}

// ---------------------------------------------------------------- the driver

/// The stand-in's pods on the node, by its label.
fn standin_pods(cluster: &Cluster) -> Result<Vec<Pod>> {
    let list: List<Pod> = cluster.kube.get(&[
        "get",
        "pods",
        "-n",
        STANDIN_NAMESPACE,
        "-l",
        STANDIN_PODS,
        "--field-selector",
        &format!("spec.nodeName={NODE}"),
    ])?;
    Ok(list.items)
}

/// The driver's registration socket on the node, as the host sees it.
fn dra_socket(cluster: &mut Cluster) -> Result<PathBuf> {
    cluster.host_path(NODE, DRA_SOCKET)
}

fn socket_is_there(socket: &Path) -> bool {
    fs::metadata(socket).is_ok_and(|meta| meta.file_type().is_socket())
}

/// The stand-in running, registered with the kubelet, publishing the node's 4 EFAs with
/// DRANET's attributes.
fn install_driver(cluster: &mut Cluster) -> Result<()> {
    cluster.host.request("dra_standin_up", &[])?;
    wait_until("the DRA stand-in's pod Ready", secs(60), || {
        standin_pods(cluster).is_ok_and(|pods| pods.first().is_some_and(Pod::serves))
    })
    .map_err(|err| anyhow!("{err}: {}", standin_state(cluster)))?;
    registered_and_published(cluster, secs(30)).map(drop)
}

/// The stand-in's pods and its last log lines, for a failure's reason.
fn standin_state(cluster: &Cluster) -> String {
    let pods = standin_pods(cluster).unwrap_or_default();
    let mut said: Vec<String> = pods
        .iter()
        .map(|pod| format!("{} {}", pod.metadata.name, pod.status.phase))
        .collect();
    if let Some(pod) = pods.first() {
        let log = cluster
            .kube
            .run(&["logs", "-n", STANDIN_NAMESPACE, &pod.metadata.name])
            .unwrap_or_else(|err| format!("{err:#}"));
        let last: Vec<&str> = log.lines().rev().take(2).collect();
        said.extend(last.into_iter().rev().map(str::to_owned));
    }
    said.join("|")
}

/// The driver's socket in `plugins_registry` within 30 s, then a ResourceSlice of the node with
/// exactly its 4 EFAs, named by ibdev, with DRANET's attributes, within `slice_within`; how long
/// the slice took.
fn registered_and_published(cluster: &mut Cluster, slice_within: Duration) -> Result<Duration> {
    let socket = dra_socket(cluster)?;
    wait_until(
        &format!("the driver registered ({})", socket.display()),
        secs(30),
        || socket_is_there(&socket),
    )
    .map_err(|err| anyhow!("{err}: {}", standin_state(cluster)))?;
    let start = Instant::now();
    wait_until("a ResourceSlice with 4 EFAs", slice_within, || {
        published(cluster).is_ok_and(|devices| devices.len() == 4)
    })
    .map_err(|err| anyhow!("{err}: {}", standin_state(cluster)))?;
    let took = start.elapsed();
    let got = published(cluster)?;
    let want: BTreeSet<String> = efas_of(cluster, fleet_node(NODE)?)?
        .iter()
        .map(|efa| {
            let root = efa.parents.first().map_or("-", String::as_str);
            format!(
                "{} {} {} {root} {}",
                efa.ibdev, efa.bdf, efa.ibdev, efa.numa
            )
        })
        .collect();
    ensure!(
        got == want,
        "the ResourceSlice has [{}], want [{}]",
        joined(&got, "|"),
        joined(&want, "|")
    );
    Ok(took)
}

#[derive(Deserialize)]
struct ResourceSlice {
    spec: SliceSpec,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SliceSpec {
    #[serde(default)]
    driver: String,
    #[serde(default)]
    node_name: String,
    #[serde(default)]
    devices: Vec<SliceDevice>,
}

#[derive(Deserialize)]
struct SliceDevice {
    name: String,
    /// Each attribute's one value under its type (`string`, `int`, ...).
    #[serde(default)]
    attributes: BTreeMap<String, BTreeMap<String, Value>>,
}

impl SliceDevice {
    /// `name pciAddress rdmaDevice pcieRoot numaNode`, `-` for an attribute it lacks.
    fn line(&self) -> String {
        let attribute = |key: &str| match self
            .attributes
            .get(key)
            .and_then(|typed| typed.values().next())
        {
            Some(Value::String(text)) => text.clone(),
            Some(other) => other.to_string(),
            None => "-".to_owned(),
        };
        // The driver's own attributes, qualified or (as 1.38's kubeletplugin helper wants them)
        // not: the driver's name is implied.
        let own = |name: &str| {
            let qualified = attribute(&format!("{DRIVER}/{name}"));
            if qualified == "-" {
                attribute(name)
            } else {
                qualified
            }
        };
        format!(
            "{} {} {} {} {}",
            self.name,
            own("pciAddress"),
            own("rdmaDevice"),
            attribute("resource.kubernetes.io/pcieRoot"),
            attribute("resource.kubernetes.io/numaNode")
        )
    }
}

/// The EFAs the driver publishes for the node, one [`SliceDevice::line`] each.
fn published(cluster: &Cluster) -> Result<BTreeSet<String>> {
    let slices: List<ResourceSlice> = cluster.kube.get(&["get", "resourceslices"])?;
    Ok(slices
        .items
        .iter()
        .filter(|slice| slice.spec.driver == DRIVER && slice.spec.node_name == NODE)
        .flat_map(|slice| &slice.spec.devices)
        .map(SliceDevice::line)
        .collect())
}

/// The stand-in's DaemonSet deleted, and its pod and socket gone within 60 s.
fn uninstall_driver(cluster: &mut Cluster) -> Result<()> {
    cluster.host.request("dra_standin_down", &[])?;
    driver_gone(cluster)
}

fn driver_gone(cluster: &mut Cluster) -> Result<()> {
    let socket = dra_socket(cluster)?;
    wait_until(
        &format!(
            "the stand-in's pod and {} gone after its deletion",
            socket.display()
        ),
        secs(60),
        || standin_pods(cluster).is_ok_and(|pods| pods.is_empty()) && !socket_is_there(&socket),
    )
}

// ---------------------------------------------------------------- the plugin and its guard

/// This chart with `nodeScope.mode=labelled` on the labelled node, rolled out as docs/migration.md's
/// step 3 checks it, serving 4 EFAs.
fn install_labelled(cluster: &mut Cluster) -> Result<()> {
    cluster
        .kube
        .run(&["apply", "-f", DEVICE_CLASS])
        .context("the API server rejected the DeviceClass")?;
    cluster.kube.label_node(NODE, SCOPE_LABEL, Some("true"))?;
    cluster.host.request(
        "helm_install",
        &[OURS_RELEASE, "--set", "nodeScope.mode=labelled"],
    )?;
    cluster
        .kube
        .plugin_rolled_out(secs(120))
        .context("the plugin's rollout")?;
    let allocatable = || allocatable(cluster);
    wait_until(
        "allocatable at 4 after the install",
        NODE_STATUS_PERIOD + secs(30),
        || allocatable() == "4",
    )
    .map_err(|err| anyhow!("{err}: allocatable '{}'", allocatable()))
}

/// The node's allocatable EFAs as written, empty when it lists none.
fn allocatable(cluster: &Cluster) -> String {
    count_text(cluster.kube.allocatable(NODE, RESOURCE))
}

/// The node's EFAs offered or not, as written, empty when it lists none.
fn capacity(cluster: &Cluster) -> String {
    count_text(cluster.kube.capacity(NODE, RESOURCE))
}

fn count_text(count: Result<Option<u64>>) -> String {
    count
        .ok()
        .flatten()
        .map_or_else(String::new, |count| count.to_string())
}

/// The plugin pod that serves the node.
fn plugin_pod(cluster: &Cluster) -> Result<Pod> {
    cluster.kube.serving_plugin(NODE)
}

/// The values of `family`'s series in the plugin pod's metrics, labelled or not (the conflict
/// gauge names its driver while it is 1), one a line.
fn metric(pod: &Pod, family: &str) -> String {
    let metrics = pod.plugin_http("/metrics").unwrap_or_default();
    metrics
        .lines()
        .filter(|line| line.split(['{', ' ']).next() == Some(family))
        .filter_map(|line| line.split_whitespace().last())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The guard has tripped: allocatable 0, capacity 4, the conflict gauge 1 and `held` EFAs
/// counted as unseen by the driver.
fn guard_tripped(cluster: &Cluster, held: u32) -> Result<()> {
    let pod = plugin_pod(cluster)?;
    wait_until(
        "allocatable 0 with dra.net registered",
        NODE_STATUS_PERIOD + secs(30),
        || allocatable(cluster) == "0",
    )
    .map_err(|_| {
        anyhow!(
            "allocatable is '{}' with dra.net registered, want 0",
            allocatable(cluster)
        )
    })?;
    let capacity = capacity(cluster);
    ensure!(
        capacity == "4",
        "capacity is '{capacity}' with dra.net registered, want 4"
    );
    let held = held.to_string();
    wait_until(&format!("{CONFLICT} 1"), secs(20), || {
        metric(&pod, CONFLICT) == "1"
    })
    .and_then(|()| {
        wait_until(&format!("{HELD_DEVICES} {held}"), secs(20), || {
            metric(&pod, HELD_DEVICES) == held
        })
    })
    .map_err(|_| {
        anyhow!(
            "{CONFLICT} '{}', _held_devices '{}', want 1 and {held}",
            metric(&pod, CONFLICT),
            metric(&pod, HELD_DEVICES)
        )
    })
}

/// No plugin pod left on any node within 60 s of the node's label going.
fn plugin_left(cluster: &Cluster) -> Result<()> {
    cluster.kube.label_node(NODE, SCOPE_LABEL, None)?;
    wait_until("the plugin pod gone", secs(60), || {
        cluster
            .kube
            .all_plugin_pods()
            .is_ok_and(|pods| pods.is_empty())
    })
    .map_err(|_| anyhow!("plugin pod still on the node 60s after its label went"))
}

// ---------------------------------------------------------------- pods and claims

/// A pod like P1's (one EFA, no pinning) made; the API server accepted it.
fn make_pod(cluster: &Cluster, name: &str, count: u32) -> Result<()> {
    cluster
        .kube
        .apply(&pod(name, count, "Never", Placement::Anywhere))
        .with_context(|| format!("pod {name} not accepted"))
}

fn phase(cluster: &Cluster, name: &str) -> String {
    cluster
        .kube
        .pod(name)
        .ok()
        .flatten()
        .map(|pod| pod.status.phase)
        .unwrap_or_default()
}

/// The claim the scheduler made for pod `name`'s extended resource, empty if none.
fn extended_claim(cluster: &Cluster, name: &str) -> String {
    cluster
        .kube
        .pod(name)
        .ok()
        .flatten()
        .and_then(|pod| pod.extended_claim().map(str::to_owned))
        .unwrap_or_default()
}

fn cordon_and_drain(cluster: &Cluster) -> Result<()> {
    cluster.kube.run(&["cordon", NODE]).context("cordon")?;
    cluster
        .kube
        .run(&[
            "drain",
            NODE,
            "--ignore-daemonsets",
            "--force",
            "--timeout=60s",
        ])
        .context("drain")
        .map(drop)
}

fn uncordon(cluster: &Cluster) -> Result<()> {
    cluster.kube.run(&["uncordon", NODE]).context("uncordon")?;
    Ok(())
}

#[derive(Deserialize)]
struct ResourceClaim {
    metadata: ClaimMetadata,
    #[serde(default)]
    status: ClaimStatus,
}

#[derive(Deserialize)]
struct ClaimMetadata {
    uid: String,
}

#[derive(Default, Deserialize)]
struct ClaimStatus {
    #[serde(default)]
    allocation: Option<Allocation>,
}

#[derive(Deserialize)]
struct Allocation {
    devices: AllocatedDevices,
}

#[derive(Deserialize)]
struct AllocatedDevices {
    #[serde(default)]
    results: Vec<AllocatedDevice>,
}

#[derive(Deserialize)]
struct AllocatedDevice {
    driver: String,
    device: String,
}

impl ResourceClaim {
    fn results(&self) -> &[AllocatedDevice] {
        self.status
            .allocation
            .as_ref()
            .map_or(&[], |allocation| &allocation.devices.results)
    }
}

fn claim(cluster: &Cluster, name: &str) -> Result<ResourceClaim> {
    cluster
        .kube
        .get(&["get", "resourceclaim", "-n", "default", name])
}

/// The CDI spec the stand-in wrote for a claim, as the host sees it.
fn claim_spec(cluster: &mut Cluster, claim: &ResourceClaim) -> Result<PathBuf> {
    let path = format!("{CDI_DIR}/{DRIVER}-efa-{}.json", claim.metadata.uid);
    cluster.host_path(NODE, &path)
}

/// A pod that runs through DRA: the claim the scheduler made for it and the EFA it got.
struct ThroughDra {
    claim: String,
    device: String,
    spec: PathBuf,
}

/// Pod `name` runs through DRA: its `extendedResourceClaimStatus` names a claim allocated by
/// `dra.net`, and its container sees exactly that EFA's uverbs node.
fn through_dra(cluster: &mut Cluster, name: &str) -> Result<ThroughDra> {
    let kube = &cluster.kube;
    let running = wait_for(&format!("pod {name} Running"), secs(60), || {
        Ok(kube.pod(name)?.filter(|pod| pod.status.phase == "Running"))
    })
    .map_err(|err| anyhow!("{err}: {} {}", phase(cluster, name), kube.events_of(name)))?;
    let Some(claim_name) = running.extended_claim() else {
        let ids = cluster
            .checkpoint(NODE)?
            .allocated(&running.metadata.uid, RESOURCE);
        bail!(
            "pod {name} has no status.extendedResourceClaimStatus; the checkpoint gives it [{}]",
            ids.join(" ")
        );
    };
    let claim = claim(cluster, claim_name)?;
    let device = match claim.results() {
        [one] if one.driver == DRIVER => one.device.clone(),
        results => bail!(
            "claim {claim_name} is allocated [{}], want one {DRIVER} device",
            results
                .iter()
                .map(|result| format!("{}/{}", result.driver, result.device))
                .collect::<Vec<_>>()
                .join(" ")
        ),
    };
    let got = listing_entries(&listing(cluster, name)?);
    let want = uverbs_entries(cluster, NODE, std::slice::from_ref(&device))?;
    ensure!(
        got == want,
        "pod {name} sees [{}] in /dev/infiniband, want [{}] of its claim's {device}",
        joined(&got, ";"),
        joined(&want, ";")
    );
    Ok(ThroughDra {
        claim: claim_name.to_owned(),
        spec: claim_spec(cluster, &claim)?,
        device,
    })
}

fn spec_gone(spec: &Path, after: &str) -> Result<()> {
    wait_until(&format!("{} gone", spec.display()), secs(30), || {
        !spec.exists()
    })
    .map_err(|_| anyhow!("{} still there after {after}", spec.display()))
}

// ---------------------------------------------------------------- the cases' bodies

fn handed_off(cluster: &mut Cluster) -> Result<Detail> {
    install_labelled(cluster)?;
    let p1 = start_pod(cluster, P1, 1, Placement::Anywhere)?;
    ensure!(
        extended_claim(cluster, P1).is_empty(),
        "{P1} went through DRA while the plugin served"
    );
    cordon_and_drain(cluster)?;
    install_driver(cluster)?;
    guard_tripped(cluster, 0)?;
    uncordon(cluster)?;
    make_pod(cluster, P2, 1)?;
    let p2 = through_dra(cluster, P2)?;
    ensure!(
        fs::metadata(&p2.spec).is_ok_and(|meta| meta.len() > 0),
        "no CDI spec {} for {P2}'s claim",
        p2.spec.display()
    );
    plugin_left(cluster)?;
    sleep(NODE_STATUS_PERIOD);
    let want = uverbs_entries(cluster, NODE, std::slice::from_ref(&p2.device))?;
    let still = phase(cluster, P2) == "Running"
        && cluster
            .kube
            .log(P2)
            .is_ok_and(|log| listing_entries(&log) == want);
    ensure!(
        still,
        "{P2} is {} after the plugin left",
        phase(cluster, P2)
    );
    cluster
        .kube
        .delete_pods(&[P2])
        .with_context(|| format!("cannot delete {P2}"))?;
    spec_gone(&p2.spec, &format!("{P2} went"))?;
    Ok(format!(
        "P1 through the plugin [{}]; guard: allocatable 0, capacity 4, dra_conflict 1, held_devices 0; P2 through DRA, claim {} on {}, sees only its uverbs node; plugin gone: P2 Running, allocatable '{}' capacity '{}'; unprepare removed the CDI spec",
        p1.ids.join(" "),
        p2.claim,
        p2.device,
        allocatable(cluster),
        capacity(cluster)
    ))
}

fn handed_off_while_held(cluster: &mut Cluster) -> Result<Detail> {
    install_labelled(cluster)?;
    let p1 = start_pod(cluster, P1, 1, Placement::Anywhere)?;
    let p1_id = p1.ids.first().context("P1 holds no EFA")?.clone();
    let p1_node = uverbs_entries(cluster, NODE, std::slice::from_ref(&p1_id))?;
    install_driver(cluster)?;
    guard_tripped(cluster, 1)?;
    let plugin = plugin_pod(cluster)?;
    // Long enough for a second warning to show: the plugin warns once per pod and conflict.
    sleep(secs(12));
    let log = cluster
        .kube
        .plugin_log(&plugin.metadata.name, false)
        .unwrap_or_default();
    let naming_p1 = format!("\"pod\":\"{P1}\"");
    let warned = log
        .lines()
        .filter(|line| {
            line.contains(HELD_WARNING) && line.contains(&naming_p1) && line.contains(&p1_id)
        })
        .count();
    ensure!(
        warned == 1,
        "{warned} warnings naming {P1} and {p1_id} in {}'s log, want 1",
        plugin.metadata.name
    );
    make_pod(cluster, P2, 1)?;
    let p2 = through_dra(cluster, P2)?;
    // With 3 more through DRA, all 4 EFAs are DRA's: one is P1's.
    make_pod(cluster, P3, 3)?;
    let kube = &cluster.kube;
    wait_until(&format!("{P3} Running"), secs(60), || {
        phase(cluster, P3) == "Running"
    })
    .map_err(|_| anyhow!("{P3} (3 EFAs) not Running: {}", kube.events_of(P3)))?;
    let p3_devices = match extended_claim(cluster, P3) {
        claimed if claimed.is_empty() => Vec::new(),
        claimed => claim(cluster, &claimed)?
            .results()
            .iter()
            .map(|result| result.device.clone())
            .collect(),
    };
    let mut seen = listing_entries(&listing(cluster, P3)?);
    seen.extend(listing_entries(&cluster.kube.log(P2)?));
    let shared: BTreeSet<String> = p1_node.intersection(&seen).cloned().collect();
    ensure!(
        shared == p1_node,
        "no DRA pod sees P1's {}; P2 has {}, P3 has {}",
        joined(&p1_node, ";"),
        p2.device,
        p3_devices.join(" ")
    );
    let whose = if p2.device == p1_id {
        "P1's EFA"
    } else {
        "not P1's"
    };
    Ok(format!(
        "P1 holds {p1_id} through the plugin; guard: allocatable 0, capacity 4, held_devices 1, {warned} warning naming P1; the scheduler gave P2 (same spec) {} ({whose}), P3 (3 EFAs) {}: P1's EFA is in two pods",
        p2.device,
        p3_devices.join(" ")
    ))
}

fn handed_back(cluster: &mut Cluster) -> Result<Detail> {
    install_labelled(cluster)?;
    install_driver(cluster)?;
    guard_tripped(cluster, 0)?;
    make_pod(cluster, P2, 1)?;
    let p2 = through_dra(cluster, P2)?;
    cordon_and_drain(cluster).context("cordon or drain failed")?;
    spec_gone(&p2.spec, &format!("{P2} was drained"))?;
    uninstall_driver(cluster)?;
    let conflict = || plugin_pod(cluster).map(|pod| metric(&pod, CONFLICT));
    wait_until(
        "allocatable 4 after the driver left",
        NODE_STATUS_PERIOD + secs(30),
        || allocatable(cluster) == "4",
    )
    .and_then(|()| {
        wait_until("dra_conflict 0 after the driver left", secs(20), || {
            conflict().is_ok_and(|value| value == "0")
        })
    })
    .map_err(|_| {
        anyhow!(
            "allocatable '{}', dra_conflict '{}' after the driver left, want 4 and 0",
            allocatable(cluster),
            conflict().unwrap_or_default()
        )
    })?;
    uncordon(cluster)?;
    let p3 = start_pod(cluster, P3, 1, Placement::Anywhere)?;
    let claimed = extended_claim(cluster, P3);
    ensure!(
        claimed.is_empty(),
        "{P3} went through DRA ({claimed}) with the plugin serving again"
    );
    Ok(format!(
        "P2 through DRA on {}; drained, driver removed: dra_conflict 0, allocatable 4; P3 (same spec) through the plugin [{}], no extendedResourceClaimStatus",
        p2.device,
        p3.ids.join(" ")
    ))
}

fn stays_pending(cluster: &mut Cluster) -> Result<Detail> {
    install_labelled(cluster)?;
    install_driver(cluster)?;
    guard_tripped(cluster, 0)?;
    let class: Value = cluster
        .kube
        .get(&["get", "deviceclass", DEVICE_CLASS_NAME])?;
    let mapped = class["spec"]["extendedResourceName"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    make_pod(cluster, P2, 1)?;
    let kube = &cluster.kube;
    let insufficient = format!("Insufficient {RESOURCE}");
    let failed_scheduling = || {
        kube.events_of(P2)
            .split('|')
            .any(|event| event.starts_with("FailedScheduling: ") && event.contains(&insufficient))
    };
    wait_until(
        &format!("FailedScheduling naming {insufficient}"),
        secs(60),
        failed_scheduling,
    )
    .map_err(|err| anyhow!("{err}: {} {}", phase(cluster, P2), kube.events_of(P2)))?;
    sleep(secs(10));
    let (phase, claimed) = (phase(cluster, P2), extended_claim(cluster, P2));
    ensure!(
        phase == "Pending" && claimed.is_empty(),
        "{P2} is {phase} with claim '{claimed}', want Pending without one"
    );
    let events = kube.events_of(P2);
    let tail_start = events.len().saturating_sub(160);
    let tail_start = (tail_start..=events.len())
        .find(|&at| events.is_char_boundary(at))
        .unwrap_or(events.len());
    let mapped = if mapped.is_empty() {
        "(dropped: gate off)".to_owned()
    } else {
        mapped
    };
    Ok(format!(
        "Kubernetes {}: guard: allocatable 0, capacity 4; the DeviceClass's extendedResourceName reads back '{mapped}'; the pod stays Pending: {}",
        cluster.kube_version,
        &events[tail_start..]
    ))
}

fn restarted_after_handoff(cluster: &mut Cluster) -> Result<Detail> {
    install_labelled(cluster)?;
    start_pod(cluster, P1, 1, Placement::Anywhere)?;
    cordon_and_drain(cluster)?;
    install_driver(cluster)?;
    guard_tripped(cluster, 0)?;
    plugin_left(cluster)?;
    let kubelet_log = cluster.run.join(format!("logs/kubelet-{NODE}.log"));
    let mark = fs::read_to_string(&kubelet_log).unwrap_or_default().len();
    cluster
        .host
        .request("restart_kubelet", &[NODE])
        .with_context(|| format!("{NODE} not Ready after its kubelet restarted"))?;
    let republished = registered_and_published(cluster, republish_within(&cluster.kube_version))
        .context("the DRA stand-in did not register and publish again after the kubelet restart")?;
    uncordon(cluster)?;
    make_pod(cluster, P2, 1)?;
    let kube = &cluster.kube;
    let settled = |pod: &Pod| {
        matches!(pod.status.phase.as_str(), "Running" | "Failed")
            || pod
                .waiting()
                .is_some_and(|waiting| waiting.reason.contains("Error"))
    };
    let p2 = wait_for(&format!("{P2} Running or refused"), secs(60), || {
        Ok(kube.pod(P2)?.filter(settled))
    })
    .map_err(|err| anyhow!("{err}: {}", kube.events_of(P2)))?;
    let through = if p2.status.phase == "Running" {
        through_dra(cluster, P2).ok()
    } else {
        None
    };
    let outcome = match through {
        Some(p2) => format!("P2 Running through DRA on {}", p2.device),
        None => {
            let p2 = cluster.kube.pod(P2)?.unwrap_or(p2);
            let waiting = p2.waiting().map_or("", |waiting| waiting.message.as_str());
            let outcome = format!(
                "P2 {} {}: {}{waiting}",
                p2.status.phase, p2.status.reason, p2.status.message
            );
            if runs_at(Some(RESTART_FIXED), None, &cluster.kube_version) {
                let log = fs::read_to_string(&kubelet_log).unwrap_or_default();
                let said: Vec<String> = log
                    .get(mark..)
                    .unwrap_or_default()
                    .lines()
                    .filter(|line| line.contains(P2))
                    .take(2)
                    .map(|line| line.chars().take(200).collect())
                    .collect();
                bail!("{outcome}; the kubelet's log: {}", said.join("|"));
            }
            outcome
        }
    };
    Ok(format!(
        "kubelet {} restarted after the hand-over: ResourceSlice back {:.1}s after the node was Ready; {outcome}",
        cluster.kube_version,
        republished.as_secs_f64()
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_slice_device_is_read_with_dranets_attributes_qualified_or_not() {
        let slice: ResourceSlice = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "spec": {
                "driver": "dra.net", "nodeName": "efa-a",
                "pool": {"name": "efa-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [{
                    "name": "rdmap16s27",
                    "attributes": {
                        "dra.net/pciAddress": {"string": "0000:10:1b.0"},
                        "dra.net/rdmaDevice": {"string": "rdmap16s27"},
                        "dra.net/rdma": {"bool": true},
                        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:10"},
                        "resource.kubernetes.io/numaNode": {"int": 0}
                    }
                }, {
                    "name": "rdmap32s27",
                    "attributes": {
                        "pciAddress": {"string": "0000:20:1b.0"},
                        "rdmaDevice": {"string": "rdmap32s27"}
                    }
                }, {"name": "bare"}]
            }
        }))
        .unwrap();
        let lines: Vec<String> = slice.spec.devices.iter().map(SliceDevice::line).collect();
        assert_eq!(
            lines,
            [
                "rdmap16s27 0000:10:1b.0 rdmap16s27 pci0000:10 0",
                "rdmap32s27 0000:20:1b.0 rdmap32s27 - -",
                "bare - - - -"
            ]
        );
    }

    #[test]
    fn a_claims_results_and_a_pods_extended_claim_are_read() {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "dra-p2-extended-resources-x", "uid": "u1"},
            "status": {"allocation": {"devices": {"results": [
                {"request": "container-0-request-0", "driver": "dra.net", "pool": "efa-a", "device": "rdmap32s27"}
            ]}}}
        }))
        .unwrap();
        let results: Vec<String> = claim
            .results()
            .iter()
            .map(|result| format!("{}/{}", result.driver, result.device))
            .collect();
        assert_eq!(results, ["dra.net/rdmap32s27"]);
        let pending: ResourceClaim =
            serde_json::from_value(json!({"metadata": {"uid": "u2"}})).unwrap();
        assert!(pending.results().is_empty());

        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "dra-p2", "uid": "p"},
            "status": {
                "phase": "Pending",
                "extendedResourceClaimStatus": {
                    "requestMappings": [],
                    "resourceClaimName": "dra-p2-extended-resources-x"
                },
                "containerStatuses": [{"name": "probe", "state": {"waiting": {
                    "reason": "CreateContainerError", "message": "no such device"
                }}}]
            }
        }))
        .unwrap();
        assert_eq!(pod.extended_claim(), Some("dra-p2-extended-resources-x"));
        let waiting = pod.waiting().unwrap();
        assert_eq!(
            (waiting.reason.as_str(), waiting.message.as_str()),
            ("CreateContainerError", "no such device")
        );
    }
}
