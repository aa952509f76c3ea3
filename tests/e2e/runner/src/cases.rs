//! The case table: every case declared once, with its ID, its label (the text of its line), its
//! suite (by the fixture it runs on) and the Kubernetes versions it runs at. docs/testing.md
//! lists the same cases (checked both ways by the tests below).

use std::fs;
use std::thread::sleep;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Result, anyhow, bail};

use crate::cluster::{
    Cluster, arm64, cdi, dra, fleet, gdrdrv, health as cluster_health, holder, install, migration,
    node_mode, reboots, scrapes, workloads,
};
use crate::kubelet::modified_since;
use crate::node::{HOLDER, Node, RESOURCE, ensure};
use crate::plugin::{DOUBLE_BOOKED, Stopped, allocation_series, sample};
use crate::pods::{Restart, joined, listing_entries};
use crate::topology::{Topology, cases as topology};
use crate::wait::{secs, wait_until};

/// What a passing case reports after the colon of its `ok` line; empty for none.
pub type Detail = String;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// `tests/e2e/kubelet.sh`: the standalone kubelet on a fake p4d.
    Kubelet,
    /// `tests/e2e/topology.sh`: the standalone kubelet on two NUMA nodes, next to a GPU plugin.
    Topology,
    /// `tests/e2e/cluster.sh`: the cluster and its fleet, which the suite's bash brought up.
    Cluster,
}

/// A case's body, on the fixture of its suite.
#[derive(Clone, Copy)]
pub enum Run {
    Kubelet(fn(&mut Node) -> Result<Detail>),
    Topology(fn(&mut Topology) -> Result<Detail>),
    Cluster(fn(&mut Cluster) -> Result<Detail>),
}

/// What a suite's cases run on: the host it brought up.
pub trait Fixture {
    /// The body of a case of this suite; `None` for another suite's case.
    fn body(run: Run) -> Option<fn(&mut Self) -> Result<Detail>>;
    /// What a failed case leaves to read, one line each.
    fn diagnostics(&self) -> Vec<String>;
    /// Stops the daemons the fixture started; failures are noted, as the tally stands either way.
    fn stop(&mut self);
}

impl Fixture for Node {
    fn body(run: Run) -> Option<fn(&mut Node) -> Result<Detail>> {
        match run {
            Run::Kubelet(body) => Some(body),
            Run::Topology(_) | Run::Cluster(_) => None,
        }
    }

    fn diagnostics(&self) -> Vec<String> {
        Node::diagnostics(self)
    }

    fn stop(&mut self) {
        // The plugin first, as the kubelet would otherwise see it go.
        if let Err(err) = self.plugin.stop(secs(10)) {
            crate::note(&format!("stopping the plugin: {err:#}"));
        }
        if let Err(err) = self.kubelet.stop() {
            crate::note(&format!("stopping the kubelet: {err:#}"));
        }
    }
}

impl Fixture for Topology {
    fn body(run: Run) -> Option<fn(&mut Topology) -> Result<Detail>> {
        match run {
            Run::Topology(body) => Some(body),
            Run::Kubelet(_) | Run::Cluster(_) => None,
        }
    }

    fn diagnostics(&self) -> Vec<String> {
        Topology::diagnostics(self)
    }

    fn stop(&mut self) {
        Topology::stop(self);
    }
}

impl Fixture for Cluster {
    fn body(run: Run) -> Option<fn(&mut Cluster) -> Result<Detail>> {
        match run {
            Run::Cluster(body) => Some(body),
            Run::Kubelet(_) | Run::Topology(_) => None,
        }
    }

    fn diagnostics(&self) -> Vec<String> {
        Cluster::diagnostics(self)
    }

    /// The cluster is the suite's to stop.
    fn stop(&mut self) {}
}

/// Whether a case that runs from Kubernetes `since` (`v1.36`; `None`: every version) and
/// before `before` (`None`: every later version) runs at `version` (`v1.34.4`). A bound or a
/// version that does not parse holds every version.
pub fn runs_at(since: Option<&str>, before: Option<&str>, version: &str) -> bool {
    let Some(minor) = minor_of(version) else {
        return true;
    };
    since.and_then(minor_of).is_none_or(|first| minor >= first)
        && before.and_then(minor_of).is_none_or(|end| minor < end)
}

fn minor_of(version: &str) -> Option<u32> {
    version
        .trim_start_matches('v')
        .split('.')
        .nth(1)?
        .parse()
        .ok()
}

pub struct Case {
    /// Unique within its suite but for the topology suite's variants: T5, T6 and T7 are one
    /// case each under several policies or scopes, told apart by their labels.
    pub id: &'static str,
    pub label: &'static str,
    /// The first Kubernetes version it runs at; `None`: every version the suite runs at.
    pub since: Option<&'static str>,
    /// The first Kubernetes version it no longer runs at; `None`: every version from `since`.
    pub before: Option<&'static str>,
    pub run: Run,
}

/// A topology case: its label starts with its ID, and it runs at every version.
const fn topology_case(
    id: &'static str,
    label: &'static str,
    run: fn(&mut Topology) -> Result<Detail>,
) -> Case {
    Case {
        id,
        label,
        since: None,
        before: None,
        run: Run::Topology(run),
    }
}

/// The first version whose scheduler hands an extended resource to DRA by default
/// (`DRAExtendedResource`, beta in 1.36, GA in 1.37).
const DRA_EXTENDED_RESOURCE: &str = "v1.36";

pub const CASES: &[Case] = &[
    Case {
        id: "K1",
        label: "registration: plugin registers; checkpoint lists 4 IDs",
        since: None,
        before: None,
        run: Run::Kubelet(registration),
    },
    Case {
        id: "K2",
        label: "allocation: pod limited to 2 sees exactly its 2 uverbs nodes",
        since: None,
        before: None,
        run: Run::Kubelet(allocation),
    },
    Case {
        id: "K3",
        label: "over-ask: pod asking for 5 is rejected at admission",
        since: None,
        before: None,
        run: Run::Kubelet(over_ask),
    },
    Case {
        id: "K4",
        label: "kubelet restart: the plugin re-registers; new pod runs",
        since: None,
        before: None,
        run: Run::Kubelet(kubelet_restart),
    },
    Case {
        id: "K5",
        label: "plugin restart: IDs and running pod are intact; new pod runs",
        since: None,
        before: None,
        run: Run::Kubelet(plugin_restart),
    },
    Case {
        id: "K6",
        label: "device loss: missing device node makes 4 unschedulable; restored node admits 4",
        since: None,
        before: None,
        run: Run::Kubelet(device_loss),
    },
    Case {
        id: "K7",
        label: "no false double booking: completed pod then a new pod on its EFAs, restarted container",
        since: None,
        before: None,
        run: Run::Kubelet(no_false_double_booking),
    },
    Case {
        id: "K9",
        label: "admin queue closed: a held and a free EFA leave allocatable, the holder runs on; counters back at 0 admit 4",
        since: None,
        before: None,
        run: Run::Kubelet(admin_queue_closed),
    },
    Case {
        id: "K8",
        label: "reboots: node mode (the unit's start, READY=1, then the kubelet) refuses no pod; the plugin after the kubelet is measured",
        since: None,
        before: None,
        run: Run::Kubelet(crate::reboot::node_mode_survives_reboots),
    },
    // The topology suite, grouped by policy so the kubelet restarts once per group.
    topology_case(
        "T0",
        "T0 single-numa-node: kubelet hints include node 1 alone; 1 EFA offered node 0 only",
        topology::hints_see_two_nodes,
    ),
    topology_case(
        "T1",
        "T1 single-numa-node: GPU-0 held; 1 GPU + 1 EFA -> GPU-1 + our NUMA-1 pick, x3",
        topology::efa_follows_the_free_gpu,
    ),
    topology_case(
        "T2",
        "T2 single-numa-node: GPU-0 held; 1 GPU + 2 EFA -> both NUMA-1 EFAs",
        topology::both_efas_of_the_gpu_node,
    ),
    topology_case(
        "T3",
        "T3 single-numa-node: 3 EFA -> TopologyAffinityError",
        topology::three_efas_fit_no_node,
    ),
    topology_case(
        "T6",
        "T6 single-numa-node: GPU-0 + a NUMA-1 EFA held; 1 GPU + 2 EFA -> rejected",
        topology::single_numa_node_rejects_misaligned,
    ),
    topology_case(
        "T7",
        "T7 single-numa-node, container scope: net gets a NUMA-0 EFA",
        topology::container_scope_aligns_net_alone,
    ),
    topology_case(
        "T2b",
        "T2b single-numa-node, p5en: GPU-0 held; 1 GPU + 2 EFA -> one NUMA-1 switch",
        topology::p5en_pair_behind_one_switch,
    ),
    topology_case(
        "T10",
        "T10 single-numa-node, p5en: init 1 EFA, app 2 -> the init's EFA + its switch sibling",
        topology::init_efa_reused_with_its_sibling,
    ),
    topology_case(
        "T9",
        "T9 single-numa-node, g5 (no NUMA): 1 GPU + 2 EFA admitted",
        topology::no_numa_node_admitted,
    ),
    topology_case(
        "T7",
        "T7 single-numa-node, pod scope: net gets a NUMA-1 EFA",
        topology::pod_scope_aligns_net_with_gpu,
    ),
    topology_case(
        "T4",
        "T4 restricted: 3 EFA run on both nodes",
        topology::restricted_spans_both_nodes,
    ),
    topology_case(
        "T5",
        "T5 restricted: 1 GPU + 3 EFA on an empty node -> rejected",
        topology::restricted_rejects_gpu_with_three_efas,
    ),
    topology_case(
        "T6",
        "T6 restricted: GPU-0 + a NUMA-1 EFA held; 1 GPU + 2 EFA -> rejected",
        topology::restricted_rejects_misaligned,
    ),
    topology_case(
        "T8",
        "T8 restricted: 5 EFA -> TopologyAffinityError, not UnexpectedAdmissionError",
        topology::too_many_efas_is_a_locality_error,
    ),
    topology_case(
        "T5",
        "T5 best-effort: 1 GPU + 3 EFA on an empty node -> admitted",
        topology::best_effort_admits_gpu_with_three_efas,
    ),
    topology_case(
        "T6",
        "T6 best-effort: GPU-0 + a NUMA-1 EFA held; 1 GPU + 2 EFA -> admitted misaligned",
        topology::best_effort_admits_misaligned,
    ),
    topology_case(
        "T11",
        "T11 single-numa-node, static CPU manager: Guaranteed 1 CPU + 1 EFA -> CPU 1 + a NUMA-1 EFA",
        topology::static_cpu_manager_picks_node_1,
    ),
    // The single-node cases on efa-a, then the arm64 image's, in the order the suite's bash ran
    // them; the Prometheus cases run between 7 and 8, the migration cases between 11 and 16.
    Case {
        id: "1",
        label: "(1) kustomize install: Ready over the pod IP, shipped securityContext, allocatable 4",
        since: None,
        before: None,
        run: Run::Cluster(install::kustomize),
    },
    Case {
        id: "2",
        label: "(2) Job limited to 2 is scheduled, sees exactly its 2 uverbs nodes, completes",
        since: None,
        before: None,
        run: Run::Cluster(workloads::job),
    },
    Case {
        id: "3",
        label: "(3) pod asking for 5 stays Pending with Insufficient vpc.amazonaws.com/efa",
        since: None,
        before: None,
        run: Run::Cluster(workloads::over_ask),
    },
    Case {
        id: "4",
        label: "(4) kubectl exec list in the plugin pod prints 4 devices",
        since: None,
        before: None,
        run: Run::Cluster(workloads::operator_cli),
    },
    Case {
        id: "5",
        label: "(5) metrics over the pod IP: 4 healthy, efa_device_allocation names the holder of its 2 EFAs",
        since: None,
        before: None,
        run: Run::Cluster(holder::metrics),
    },
    Case {
        id: "6",
        label: "(6) rollout restart: new pod Ready, holder keeps its devices, allocatable 4",
        since: None,
        before: None,
        run: Run::Cluster(holder::rolling_update),
    },
    Case {
        id: "7",
        label: "(7) device loss: allocatable 3 within the status period + 2s, then 4",
        since: None,
        before: None,
        run: Run::Cluster(holder::device_loss),
    },
    // The Prometheus cases, between the single-node cases 7 and 8.
    Case {
        id: "P1",
        label: "(P1) Prometheus discovers the plugin pod by its prometheus.io/* annotations; target up",
        since: None,
        before: None,
        run: Run::Cluster(scrapes::target),
    },
    Case {
        id: "P2",
        label: "(P2) Prometheus has every metric family the README lists",
        since: None,
        before: None,
        run: Run::Cluster(scrapes::families_present),
    },
    Case {
        id: "P3",
        label: "(P3) Prometheus: the holder's counters carry its namespace, pod and container",
        since: None,
        before: None,
        run: Run::Cluster(scrapes::holder_labels),
    },
    Case {
        id: "P4",
        label: "(P4) device loss: EfaDeviceUnhealthy fires, every dashboard query has data, the alert resolves",
        since: None,
        before: None,
        run: Run::Cluster(scrapes::alert_lifecycle),
    },
    Case {
        id: "P5",
        label: "(P5) every PromQL example in the README returns a result",
        since: None,
        before: None,
        run: Run::Cluster(scrapes::readme_examples),
    },
    Case {
        id: "P6",
        label: "(P6) EfaReceiveDrops, EfaRdmaReadErrors, EfaRdmaWriteErrors fire on raised counters, naming the holder",
        since: None,
        before: None,
        run: Run::Cluster(scrapes::counter_alerts),
    },
    Case {
        id: "8",
        label: "(8) node without EFA: plugin Ready, allocatable 0 or absent",
        since: None,
        before: None,
        run: Run::Cluster(install::no_efa),
    },
    Case {
        id: "9",
        label: "(9) helm: server-side accepted, install, Job, upgrade rolls, uninstall clean",
        since: None,
        before: None,
        run: Run::Cluster(install::helm),
    },
    Case {
        id: "10",
        label: "(10) CDI mode: Job sees exactly its 2 uverbs nodes through CDI, with FI_PROVIDER=efa",
        since: None,
        before: None,
        run: Run::Cluster(cdi::job),
    },
    Case {
        id: "11",
        label: "(11) CDI mode: with the plugin gone, a holder's killed container restarts with its EFA",
        since: None,
        before: None,
        run: Run::Cluster(cdi::spec_outlives_the_plugin),
    },
    Case {
        id: "12",
        label: "(12) Migration, documented order: AWS plugin out, this chart in; holder intact, new pod gets the free EFAs",
        since: None,
        before: None,
        run: Run::Cluster(migration::documented_order),
    },
    Case {
        id: "13",
        label: "(13) Migration, this plugin first: 60s beside the AWS plugin without a fight, then it leaves",
        since: None,
        before: None,
        run: Run::Cluster(migration::ours_first),
    },
    Case {
        id: "14",
        label: "(14) Migration with device-id-strategy: pci: foreign IDs counted, new pods get the free EFAs 3 times",
        since: None,
        before: None,
        run: Run::Cluster(migration::pci),
    },
    Case {
        id: "15",
        label: "(15) CloudWatch's lookup: PodResources names the holder of each ibdev",
        since: None,
        before: None,
        run: Run::Cluster(migration::cloudwatch),
    },
    Case {
        id: "16",
        label: "(16) extra-device-nodes: a Job sees /dev/gdrdrv next to exactly its 2 uverbs nodes",
        since: None,
        before: None,
        run: Run::Cluster(gdrdrv::extra_device_nodes),
    },
    // The DRA handoff on efa-a alone, before the fleet: with DRAExtendedResource (on by default
    // from 1.36) the scheduler hands the resource to DRA, without it nothing serves it.
    Case {
        id: "D1",
        label: "(D1) DRA handoff, documented order: cordon, drain, driver in; same spec through DRA; plugin leaves by label",
        since: Some(DRA_EXTENDED_RESOURCE),
        before: None,
        run: Run::Cluster(dra::handoff),
    },
    Case {
        id: "D2",
        label: "(D2) DRA handoff unsafe: driver in while P1 holds an EFA; warning, held_devices, whom DRA gives P1's EFA",
        since: Some(DRA_EXTENDED_RESOURCE),
        before: None,
        run: Run::Cluster(dra::unsafe_handoff),
    },
    Case {
        id: "D3",
        label: "(D3) DRA hand back: drain, driver out; guard clears, same spec through the plugin",
        since: Some(DRA_EXTENDED_RESOURCE),
        before: None,
        run: Run::Cluster(dra::hand_back),
    },
    Case {
        id: "D5",
        label: "(D5) DRA handoff, then a kubelet restart: does the same spec's new pod start through DRA (PR #141426)",
        since: Some(DRA_EXTENDED_RESOURCE),
        before: None,
        run: Run::Cluster(dra::restart_handoff),
    },
    Case {
        id: "D4",
        label: "(D4) no DRAExtendedResource: with the DRA driver present the same pod stays Pending",
        since: None,
        before: Some(DRA_EXTENDED_RESOURCE),
        run: Run::Cluster(dra::no_bridge),
    },
    Case {
        id: "A1",
        label: "(A1) arm64 image: kustomize install, the plugin runs as arm64, Ready, allocatable 4",
        since: None,
        before: None,
        run: Run::Cluster(arm64::install),
    },
    Case {
        id: "A2",
        label: "(A2) arm64 plugin: Job limited to 2 is scheduled, sees exactly its 2 uverbs nodes, completes",
        since: None,
        before: None,
        run: Run::Cluster(arm64::job),
    },
    Case {
        id: "A3",
        label: "(A3) arm64 plugin: kubectl exec list in the plugin pod prints 4 devices",
        since: None,
        before: None,
        run: Run::Cluster(arm64::operator_cli),
    },
    Case {
        id: "A4",
        label: "(A4) arm64 plugin: metrics over the pod IP, efa_device_allocation names the holder",
        since: None,
        before: None,
        run: Run::Cluster(arm64::metrics),
    },
    // The fleet's cases, in the order the suite's bash ran them, before the runner's others.
    Case {
        id: "F5",
        label: "(F5) a node that joins late: node Ready to plugin, allocatable and a waiting pod Running, this plugin and the AWS stand-in",
        since: None,
        before: None,
        run: Run::Cluster(fleet::late_join),
    },
    Case {
        id: "F6",
        label: "(F6) efa-a rebooted: kubelet start to Register, and what became of the pods holding EFAs there",
        since: None,
        before: None,
        run: Run::Cluster(fleet::efa_a_rebooted),
    },
    Case {
        id: "F1",
        label: "(F1) one plugin per node: chart defaults, Ready on all 3 nodes, each node's own IDs and count",
        since: None,
        before: None,
        run: Run::Cluster(fleet::one_plugin_per_node),
    },
    Case {
        id: "F2",
        label: "(F2) labelled mode, chart and kustomize: plugin pods only on labelled nodes; a label added starts one, removed stops it",
        since: None,
        before: None,
        run: Run::Cluster(fleet::labelled_scope),
    },
    Case {
        id: "F3",
        label: "(F3) placement: 5 lands on efa-b, 17 stays Pending though the fleet has 20, pods of 4 fill efa-a with one",
        since: None,
        before: None,
        run: Run::Cluster(fleet::placement),
    },
    Case {
        id: "F4",
        label: "(F4) rollout across nodes: never two nodes without a plugin, allocatable back, holders keep their devices",
        since: None,
        before: None,
        run: Run::Cluster(fleet::rollout),
    },
    Case {
        id: "F7",
        label: "(F7) isolation: efa-a's kubelet restarted and plugin killed; efa-b's allocatable, holder and registrations unchanged",
        since: None,
        before: None,
        run: Run::Cluster(fleet::isolation),
    },
    Case {
        id: "F8",
        label: "(F8) one Prometheus, every node's plugin: each names its own node's holders; the README's queries per pod and per node",
        since: None,
        before: None,
        run: Run::Cluster(fleet::one_prometheus),
    },
    Case {
        id: "F9",
        label: "(F9) drain efa-a: the Deployment's replacement runs on efa-b with its EFAs; uncordoned, efa-a back to 4",
        since: None,
        before: None,
        run: Run::Cluster(fleet::drain),
    },
    Case {
        id: "E1",
        label: "(E1) admin queue closed on efa-b: a held and a free EFA leave allocatable, the holder runs on Unhealthy, EfaAdminCommandTimeouts names it; probed again, one comes back; cmds_err alone only alerts",
        since: None,
        before: None,
        run: Run::Cluster(cluster_health::admin_queue_closed),
    },
    Case {
        id: "F10",
        label: "(F10) node mode survives reboots: efa-a power-cycled with 4 pods bound each time, node mode before the kubelet refuses none; the DaemonSet is measured beside it",
        since: None,
        before: None,
        run: Run::Cluster(reboots::node_mode_survives_reboots),
    },
    Case {
        id: "F11",
        label: "(F11) one plugin per node: node mode on labelled efa-a, no DaemonSet pod there; unlabelled, the DaemonSet's pod comes second and never registers, allocations stay single",
        since: None,
        before: None,
        run: Run::Cluster(node_mode::one_plugin_per_node),
    },
    Case {
        id: "S1",
        label: "(S1) soak: workload churn and seeded day-two events on the fleet in cdi mode; no double booking, PodResources matches the inside",
        since: None,
        before: None,
        run: Run::Cluster(fleet::soak),
    },
    Case {
        id: "S2",
        label: "(S2) admission burst with PodResources listed hard (kubernetes PR #137534): the detector warns of every double booking the ground truth sees",
        since: None,
        before: None,
        run: Run::Cluster(fleet::burst),
    },
];

fn done() -> Result<Detail> {
    Ok(Detail::new())
}

fn registration(node: &mut Node) -> Result<Detail> {
    node.ensure_plugin()?;
    let registrations = node.registrations();
    ensure(registrations == 1, || {
        format!("kubelet logged {registrations} registrations of {RESOURCE}, want 1")
    })?;
    done()
}

fn allocation(node: &mut Node) -> Result<Detail> {
    // The pod is the holder the restart cases reuse; room for it first.
    node.ensure_plugin()?;
    node.pods.remove_all_but(&[HOLDER])?;
    node.run_pod(HOLDER, 2)?;
    done()
}

fn over_ask(node: &mut Node) -> Result<Detail> {
    node.ensure_plugin()?;
    node.rejected_pod("over-ask", 5)?;
    done()
}

fn kubelet_restart(node: &mut Node) -> Result<Detail> {
    // The holder keeps running across the restart, and leaves room for 2.
    node.ensure_holder()?;
    node.pods.remove_all_but(&[HOLDER])?;
    node.kubelet.stop()?;
    node.kubelet
        .start()
        .map_err(|err| anyhow!("after restart: {err}"))?;
    // The restarted kubelet deleted the plugin's socket; the plugin has to notice the new
    // kubelet.sock and register again.
    let all = node.all_ids();
    wait_until("registered again", secs(60), || node.registered_since(0, &all)).map_err(|_| {
        anyhow!(
            "plugin did not register with the restarted kubelet within 60s (registrations: {}, checkpoint: [{}], dir: [{}]); plugin log: {}",
            node.registrations(),
            node.registered().join(" "),
            dir_entries(&node.device_plugin_dir),
            crate::daemon::tail(&node.plugin.log(), 3)
        )
    })?;
    node.run_pod("after-kubelet-restart", 2)?;
    done()
}

fn dir_entries(dir: &std::path::Path) -> String {
    let mut names: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names.join(" ")
}

fn plugin_restart(node: &mut Node) -> Result<Detail> {
    let holder = node.ensure_holder()?;
    node.pods.remove_all_but(&[HOLDER])?;
    let ids_before = node.registered();
    let holder_entries = node.expected_entries(&holder.ids)?;
    let log = node.plugin.log();
    match node.plugin.stop(secs(10))? {
        None => bail!("plugin was not running"),
        Some(Stopped::Already(status)) => bail!(
            "plugin had already exited with {status}: {}",
            crate::daemon::tail(&log, 3)
        ),
        Some(Stopped::OnSignal(status)) => ensure(status.success(), || {
            format!(
                "plugin exited with {status} on SIGTERM: {}",
                crate::daemon::tail(&log, 3)
            )
        })?,
    }
    let socket = node
        .device_plugin_dir
        .join(efa_device_plugin::proto::deviceplugin::PLUGIN_SOCKET);
    ensure(!socket.exists(), || {
        format!("plugin left {} behind on SIGTERM", socket.display())
    })?;
    let registrations_before = node.registrations();
    let restarted = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    node.plugin.start()?;
    wait_until("registered again", secs(30), || {
        node.registered_since(registrations_before, &ids_before)
    })
    .map_err(|_| {
        anyhow!(
            "after plugin restart: registrations {} (before {registrations_before}), checkpoint [{}], want [{}]",
            node.registrations(),
            node.registered().join(" "),
            ids_before.join(" ")
        )
    })?;
    let status = node.pods.status(HOLDER);
    ensure(status.phase() == "Running", || {
        format!("pod holder no longer Running after plugin restart: {status}")
    })?;
    // The container rewrites "now" every second; wait for a rewrite that started after the
    // restart.
    let now = node.pods.out(HOLDER).join("now");
    wait_until("holder refreshed", secs(10), || {
        modified_since(&now, restarted)
    })
    .map_err(|_| anyhow!("pod holder stopped refreshing its listing after plugin restart"))?;
    let listing = listing_entries(&fs::read_to_string(&now)?);
    ensure(listing == holder_entries, || {
        format!(
            "pod holder now sees [{}], had [{}]",
            joined(&listing, ";"),
            joined(&holder_entries, ";")
        )
    })?;
    node.run_pod("after-plugin-restart", 2)?;
    done()
}

fn device_loss(node: &mut Node) -> Result<Detail> {
    // All 4 free, so the only thing short is the missing node.
    node.ensure_plugin()?;
    node.pods.remove_all_but(&[])?;
    let three = node.ids_of(&[0, 1, 2]);
    let missing = node.remove_node(3)?;
    wait_until("3 registered", secs(30), || node.registered() == three).map_err(|_| {
        anyhow!(
            "with {} gone, checkpoint still lists [{}] after 30s, want [{}]",
            missing.path().display(),
            node.registered().join(" "),
            three.join(" ")
        )
    })?;
    node.rejected_pod("four-of-three", 4)?;
    missing.restore()?;
    let all = node.all_ids();
    wait_until("4 registered", secs(30), || node.registered() == all).map_err(|_| {
        anyhow!(
            "with uverbs3 restored, checkpoint lists [{}] after 30s, want [{}] ({} healthy again)",
            node.registered().join(" "),
            all.join(" "),
            node.efas[3].ibdev
        )
    })?;
    node.run_pod("four-restored", 4)?;
    done()
}

/// An EFA's admin queue closes as the driver closes it, by its device-level `no_completion_cmds`
/// rising, on an EFA a pod holds and on a free one; a re-created device reads 0 again.
fn admin_queue_closed(node: &mut Node) -> Result<Detail> {
    node.ensure_plugin()?;
    node.pods.remove_all_but(&[])?;
    let held = node.run_pod("aq-holder", 1)?;
    let closed: Vec<_> = node
        .efas
        .iter()
        .filter(|efa| held.contains(&efa.ibdev))
        .chain(
            node.efas
                .iter()
                .filter(|efa| !held.contains(&efa.ibdev))
                .take(1),
        )
        .cloned()
        .collect();
    let set = |value: u64| -> Result<()> {
        for efa in &closed {
            node.fake
                .set_device_counter(efa, "no_completion_cmds", value)?;
        }
        Ok(())
    };
    let open: Vec<String> = {
        let mut ids: Vec<String> = node
            .efas
            .iter()
            .filter(|efa| !closed.iter().any(|c| c.ibdev == efa.ibdev))
            .map(|efa| efa.ibdev.clone())
            .collect();
        ids.sort();
        ids
    };
    let raised = std::time::Instant::now();
    set(1)?;
    wait_until("2 registered", secs(30), || node.registered() == open).map_err(|_| {
        anyhow!(
            "with no_completion_cmds 1 on {} and {}, checkpoint lists [{}] after 30s, want [{}]",
            closed[0].ibdev,
            closed[1].ibdev,
            node.registered().join(" "),
            open.join(" ")
        )
    })?;
    let dropped = raised.elapsed();
    let metrics = node.plugin.metrics()?;
    let unhealthy = sample(
        &metrics,
        "efa_device_plugin_unhealthy_devices{reason=\"admin_queue_closed\"}",
    )
    .unwrap_or_default()
    .to_owned();
    ensure(unhealthy == "2", || {
        format!(
            "efa_device_plugin_unhealthy_devices{{reason=\"admin_queue_closed\"}} is {unhealthy:?}, want 2"
        )
    })?;
    node.rejected_pod("aq-three", 3)?;
    let holder = node.pods.status("aq-holder");
    ensure(holder.phase() == "Running", || {
        format!("the holder of {} is {holder}, want Running", held.join(" "))
    })?;
    set(0)?;
    let all = node.all_ids();
    wait_until("4 registered", secs(30), || node.registered() == all).map_err(|_| {
        anyhow!(
            "with the counters back at 0, checkpoint lists [{}] after 30s, want [{}]",
            node.registered().join(" "),
            all.join(" ")
        )
    })?;
    node.pods.remove("aq-holder")?;
    node.run_pod("aq-four", 4)?;
    Ok(format!(
        "closed {} (held) and {}: out of the checkpoint {:.1}s after the rise, unhealthy_devices{{admin_queue_closed}} 2, the holder Running, 3 refused; both back at 0, 4 admitted",
        closed[0].ibdev,
        closed[1].ibdev,
        dropped.as_secs_f64()
    ))
}

/// Over 3 s (6 polls of PodResources by the plugin) the plugin counts no double-booked EFA;
/// the error names `what`.
fn double_booked_stays_zero(node: &Node, what: &str) -> Result<()> {
    for _ in 0..6 {
        let metrics = node.plugin.metrics().unwrap_or_default();
        let value = sample(&metrics, DOUBLE_BOOKED).unwrap_or_default();
        ensure(value == "0", || {
            let log = fs::read_to_string(node.plugin.log()).unwrap_or_default();
            let booked: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("double-booked"))
                .take(3)
                .collect();
            format!(
                "{what}: {DOUBLE_BOOKED} is '{value}', want 0; plugin log: {}",
                booked.join("|")
            )
        })?;
        sleep(Duration::from_millis(500));
    }
    Ok(())
}

/// The plugin's PodResources view shows static pod `name` holding `count` EFAs, so a gauge at
/// 0 is a reading, not a blind spot.
fn holds_in_view(node: &Node, name: &str, count: usize) -> bool {
    let pod = format!("{name}-{}", node.pods.node);
    node.plugin
        .metrics()
        .is_ok_and(|metrics| allocation_series(&metrics, &pod) == count)
}

fn no_false_double_booking(node: &mut Node) -> Result<Detail> {
    node.ensure_plugin()?;
    node.pods.remove_all_but(&[])?;
    // A Job-like pod takes every EFA and completes; it stays in the kubelet's pods, Succeeded,
    // while a new pod gets the same 4 EFAs.
    node.pods.write(
        "job",
        4,
        Restart::Never,
        Some("ls -l /dev/infiniband >/out/ls 2>&1; sleep 2"),
    )?;
    node.pods.wait_phase("job", "Succeeded", "not Succeeded")?;
    double_booked_stays_zero(node, "completed pod")?;
    node.run_pod("after-job", 4)?;
    wait_until("after-job in view", secs(20), || {
        holds_in_view(node, "after-job", 4)
    })
    .map_err(|_| {
        let series = node
            .plugin
            .metrics()
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("efa_device_allocation{"))
            .count();
        anyhow!("the plugin's view never showed after-job with 4 EFAs: {series} series")
    })?;
    double_booked_stays_zero(node, "completed pod, then a new pod on its EFAs")?;
    // A container that keeps restarting keeps its 2 EFAs, next to a pod on the other 2.
    node.pods.remove_all_but(&[])?;
    node.pods
        .write("restarter", 2, Restart::Always, Some("sleep 1; exit 1"))?;
    node.run_pod("beside", 2)?;
    wait_until("restarter restarted twice", secs(90), || {
        node.pods.status("restarter").restarts() >= 2
    })
    .map_err(|_| {
        let status = node.pods.status("restarter");
        anyhow!(
            "pod restarter restarted {} times in 90s, want 2: {status}",
            status.restarts()
        )
    })?;
    wait_until("restarter in view", secs(20), || {
        holds_in_view(node, "restarter", 2)
    })
    .map_err(|_| anyhow!("the plugin's view never showed restarter with 2 EFAs"))?;
    double_booked_stays_zero(node, "restarted container")?;
    node.pods.remove_all_but(&[])?;
    done()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use super::*;

    fn suite_of(case: &Case) -> Suite {
        match case.run {
            Run::Kubelet(_) => Suite::Kubelet,
            Run::Topology(_) => Suite::Topology,
            Run::Cluster(_) => Suite::Cluster,
        }
    }

    /// A case as docs/testing.md lists it: its ID and its name.
    type Listed = (String, String);

    /// The cases of a suite in docs/testing.md whose IDs start with `prefix` (any, for ""): the
    /// `- K1. name: ...` items and the `1. name: ...` numbered items of the section that starts
    /// with `heading`.
    fn documented(testing: &str, heading: &str, prefix: &str) -> BTreeSet<Listed> {
        let start = testing
            .find(heading)
            .unwrap_or_else(|| panic!("no section {heading} in docs/testing.md"));
        let section = &testing[start + heading.len()..];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        section
            .lines()
            .filter_map(|line| {
                let (id, rest) = line.strip_prefix("- ").unwrap_or(line).split_once(". ")?;
                let numbered = !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit());
                let lettered = id.len() > 1
                    && id.as_bytes()[0].is_ascii_uppercase()
                    && line.starts_with("- ")
                    && id[1..].bytes().all(|b| b.is_ascii_alphanumeric());
                ((numbered || lettered) && id.starts_with(prefix)).then_some((id, rest))
            })
            .map(|(id, rest)| {
                // A row without a name before a colon is listed by its ID alone.
                let name = rest.split_once(':').map_or("", |(name, _)| name);
                (id.to_owned(), name.to_owned())
            })
            .collect()
    }

    /// Each way the documented cases differ from the table's, one line each.
    fn differences(docs: &BTreeSet<Listed>, table: &BTreeSet<Listed>) -> Vec<String> {
        let missing = table
            .difference(docs)
            .map(|(id, name)| format!("case {id} ({name}) is not in docs/testing.md"));
        let extra = docs
            .difference(table)
            .map(|(id, name)| format!("docs/testing.md lists {id} ({name}), which is no case"));
        missing.chain(extra).collect()
    }

    /// A case's name as docs/testing.md gives it: its label up to the colon, without the ID
    /// a topology label starts with.
    fn name<'a>(id: &str, label: &'a str) -> &'a str {
        let label = label
            .strip_prefix(id)
            .or_else(|| label.strip_prefix(&format!("({id})")))
            .and_then(|rest| rest.strip_prefix(' '))
            .unwrap_or(label);
        label.split_once(':').map_or(label, |(name, _)| name)
    }

    fn table(suite: Suite) -> BTreeSet<Listed> {
        CASES
            .iter()
            .filter(|case| suite_of(case) == suite)
            .map(|case| (case.id.to_owned(), name(case.id, case.label).to_owned()))
            .collect()
    }

    fn testing_md() -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../docs/testing.md");
        fs::read_to_string(&path).unwrap()
    }

    #[test]
    fn docs_list_the_kubelet_suites_cases_and_no_other() {
        let docs = documented(&testing_md(), "## End-to-end against a real kubelet", "K");
        let found = differences(&docs, &table(Suite::Kubelet));
        assert!(found.is_empty(), "{}", found.join("\n"));
    }

    #[test]
    fn docs_list_the_topology_suites_cases_and_no_other() {
        let docs = documented(
            &testing_md(),
            "## End-to-end: NUMA alignment by the real Topology Manager",
            "T",
        );
        let found = differences(&docs, &table(Suite::Topology));
        assert!(found.is_empty(), "{}", found.join("\n"));
    }

    #[test]
    fn docs_list_the_cluster_suites_cases_and_no_other() {
        let docs = documented(
            &testing_md(),
            "## End-to-end: what users install, on a real cluster",
            "",
        );
        let found = differences(&docs, &table(Suite::Cluster));
        assert!(found.is_empty(), "{}", found.join("\n"));
    }

    #[test]
    fn a_missing_or_extra_docs_row_is_found() {
        let listed = |id: &str, name: &str| (id.to_owned(), name.to_owned());
        let mut table = BTreeSet::from([listed("K1", "registration")]);
        let docs = BTreeSet::from([listed("K2", "allocation")]);
        assert_eq!(
            differences(&docs, &table),
            [
                "case K1 (registration) is not in docs/testing.md",
                "docs/testing.md lists K2 (allocation), which is no case"
            ]
        );
        table.insert(listed("K2", "over-ask"));
        assert_eq!(
            differences(&docs, &table)[1],
            "case K2 (over-ask) is not in docs/testing.md"
        );
        // A topology case's variants share an ID; each needs its own row.
        let table = BTreeSet::from([listed("T6", "restricted"), listed("T6", "best-effort")]);
        let docs = BTreeSet::from([listed("T6", "restricted")]);
        assert_eq!(
            differences(&docs, &table),
            ["case T6 (best-effort) is not in docs/testing.md"]
        );
    }

    #[test]
    fn numbered_and_lettered_rows_are_listed_and_prose_is_not() {
        let testing = "## Suite\n\n1. first case: what it proves;\n- D1. handoff: more.\n\
                       - the tree gains. Not a case\nSee 2. in prose: no case\n## Next\n- D2. x: y";
        let listed = |id: &str, name: &str| (id.to_owned(), name.to_owned());
        assert_eq!(
            documented(testing, "## Suite", ""),
            BTreeSet::from([listed("1", "first case"), listed("D1", "handoff")])
        );
        assert_eq!(
            documented(testing, "## Suite", "D"),
            BTreeSet::from([listed("D1", "handoff")])
        );
    }

    #[test]
    fn a_name_is_the_label_before_the_colon_without_its_id() {
        assert_eq!(name("K1", "registration: plugin registers"), "registration");
        assert_eq!(
            name(
                "T7",
                "T7 single-numa-node, pod scope: net gets a NUMA-1 EFA"
            ),
            "single-numa-node, pod scope"
        );
        assert_eq!(
            name("E1", "(E1) admin queue closed on efa-b: both leave"),
            "admin queue closed on efa-b"
        );
    }

    #[test]
    fn each_case_is_named_once_and_labels_are_unique() {
        let mut names = BTreeSet::new();
        let mut labels = BTreeSet::new();
        for case in CASES {
            assert!(
                names.insert((case.id, name(case.id, case.label))),
                "{} {} twice",
                case.id,
                case.label
            );
            assert!(labels.insert(case.label), "label {} twice", case.label);
        }
    }

    #[test]
    fn a_topology_label_starts_with_its_id() {
        for case in CASES.iter().filter(|c| suite_of(c) == Suite::Topology) {
            assert!(
                case.label.starts_with(&format!("{} ", case.id)),
                "{}: {}",
                case.id,
                case.label
            );
        }
    }

    #[test]
    fn a_case_since_a_version_runs_from_it_on() {
        assert!(runs_at(Some("v1.36"), None, "v1.36.3"));
        assert!(runs_at(Some("v1.36"), None, "v1.38.0-beta.0"));
        assert!(!runs_at(Some("v1.36"), None, "v1.34.4"));
        assert!(runs_at(None, None, "v1.34.4"));
    }

    #[test]
    fn a_case_before_a_version_runs_up_to_the_one_before_it() {
        assert!(runs_at(None, Some("v1.36"), "v1.34.4"));
        assert!(runs_at(None, Some("v1.36"), "v1.35.0"));
        assert!(!runs_at(None, Some("v1.36"), "v1.36.3"));
        assert!(!runs_at(None, Some("v1.36"), "v1.37.2"));
        assert!(runs_at(Some("v1.35"), Some("v1.37"), "v1.36.3"));
        assert!(!runs_at(Some("v1.35"), Some("v1.37"), "v1.34.4"));
        assert!(runs_at(None, Some("v1.36"), "unparsed"));
    }

    #[test]
    fn the_dra_cases_split_at_dra_extended_resource() {
        let at = |version: &str| -> Vec<&str> {
            CASES
                .iter()
                .filter(|case| case.id.starts_with('D'))
                .filter(|case| runs_at(case.since, case.before, version))
                .map(|case| case.id)
                .collect()
        };
        assert_eq!(at("v1.34.4"), ["D4"]);
        assert_eq!(at("v1.37.2"), ["D1", "D2", "D3", "D5"]);
    }
}
