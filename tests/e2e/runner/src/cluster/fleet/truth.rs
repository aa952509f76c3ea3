//! The ground truth of who holds which EFA, read beneath the plugin and the kubelet: each
//! workload container's processes found in the node's pod cgroups, and the uverbs nodes inside
//! the container's `/dev/infiniband`, by device number. The soak (S1) and the burst (S2) hold
//! it against the kubelet's PodResources and the plugin's double-booking detector.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Result;
use efa_device_plugin::discovery::DevNum;
use nix::sys::stat::{major, minor};

use super::node_efas;
use crate::cluster::Cluster;
use crate::cluster::kube::Pod;
use crate::cluster::pod_resources::list;
use crate::node::RESOURCE;

/// The cgroup v1 hierarchy the kubelets' pod cgroups are found in: every container has its
/// processes listed there.
const PIDS_HIERARCHY: &str = "/sys/fs/cgroup/pids";
/// A container younger than this, or of a terminating pod, is left out of the comparison with
/// PodResources: either side may still be catching up.
const SETTLE: Duration = Duration::from_secs(5);

/// One node as the ground truth reads it.
pub struct NodeView {
    pub name: String,
    /// The kubelet's `cgroupRoot` (`/` for the first node).
    pub cgroup_root: String,
    /// The kubelet's PodResources socket, as the host sees it.
    pub pod_resources: PathBuf,
    /// Each ID the plugin may give out on the node (ibdev name and PCI address) to its uverbs
    /// node's number.
    pub devices: BTreeMap<String, DevNum>,
}

/// How the ground truth reads each of `nodes`: its cgroup root (the suite's), where the host
/// sees its PodResources socket, and its EFAs as testkit lays out its shape, checked against
/// its tree.
pub fn views(cluster: &mut Cluster, nodes: &[&str]) -> Result<Vec<NodeView>> {
    nodes
        .iter()
        .map(|&name| {
            let devices = node_efas(cluster, name)?
                .into_iter()
                .flat_map(|efa| [(efa.ibdev, efa.dev), (efa.bdf, efa.dev)])
                .collect();
            Ok(NodeView {
                name: name.to_owned(),
                cgroup_root: cluster.host.request("cgroup_root", &[name])?,
                pod_resources: cluster.pod_resources(name)?,
                devices,
            })
        })
        .collect()
}

/// What the ground truth found wrong.
#[derive(Debug, PartialEq, Eq)]
pub enum Finding {
    /// One device inside running containers of two pods or more (`namespace/name`).
    Double {
        node: String,
        dev: DevNum,
        pods: Vec<String>,
    },
    /// PodResources and the inside of a container disagree.
    Differs {
        node: String,
        container: String,
        inside: BTreeSet<DevNum>,
        said: BTreeSet<String>,
    },
    /// The node's PodResources did not answer.
    Unlisted { node: String, error: String },
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::Double { node, dev, pods } => {
                write!(f, "double {node} {dev} {}", pods.join(" "))
            }
            Finding::Differs {
                node,
                container,
                inside,
                said,
            } => write!(
                f,
                "differs {node} {container} inside [{}] podresources [{}]",
                joined(inside),
                joined(said)
            ),
            Finding::Unlisted { node, error } => write!(f, "podresources-failed {node}: {error}"),
        }
    }
}

impl Finding {
    /// Whether a kubelet that just started may still be catching up on it.
    pub fn may_settle(&self) -> bool {
        !matches!(self, Finding::Double { .. })
    }
}

fn joined<T: fmt::Display>(items: &BTreeSet<T>) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The ground truth at one moment, over every node read.
#[derive(Default)]
pub struct Truth {
    pub findings: Vec<Finding>,
    /// Workload containers found running.
    pub containers: usize,
    /// Devices inside containers of two pods or more.
    pub doubles: usize,
}

/// A workload container as the API names it.
struct Named {
    /// `namespace/pod`.
    pod: String,
    container: String,
    running_for: Duration,
    terminating: bool,
}

/// Reads the ground truth of `nodes` for the workload pods `pods` (the API names each
/// container found; the plugin pods, which see every node's devices, are not among them).
pub fn read(nodes: &[NodeView], pods: &[Pod]) -> Truth {
    let named = names(pods, SystemTime::now());
    let mut truth = Truth::default();
    for node in nodes {
        let said = match list(&node.pod_resources) {
            Ok(answer) => Some(said_by(&answer)),
            Err(err) => {
                truth.findings.push(Finding::Unlisted {
                    node: node.name.clone(),
                    error: format!("{err:#}"),
                });
                None
            }
        };
        let root = Path::new(PIDS_HIERARCHY)
            .join(node.cgroup_root.trim_start_matches('/'))
            .join("kubepods");
        let inside: Vec<(&Named, BTreeSet<DevNum>)> = containers(&root)
            .into_iter()
            .filter_map(|found| {
                let name = named.get(&found.id)?;
                Some((name, uverbs_inside(found.pid)))
            })
            .collect();
        truth.containers += inside.len();
        compare(node, said.as_ref(), &inside, &mut truth);
    }
    truth
}

/// The findings of one node: devices inside two pods' containers, and containers whose inside
/// PodResources (`said`, when it answered) does not match.
fn compare(
    node: &NodeView,
    said: Option<&BTreeMap<String, BTreeSet<String>>>,
    inside: &[(&Named, BTreeSet<DevNum>)],
    truth: &mut Truth,
) {
    let mut holders: BTreeMap<DevNum, BTreeSet<&str>> = BTreeMap::new();
    for (name, devs) in inside {
        for dev in devs {
            holders.entry(*dev).or_default().insert(&name.pod);
        }
        let Some(said) = said else { continue };
        if name.terminating || name.running_for < SETTLE {
            continue;
        }
        let key = format!("{}/{}", name.pod, name.container);
        let ids = said.get(&key).cloned().unwrap_or_default();
        let want: BTreeSet<DevNum> = ids
            .iter()
            .filter_map(|id| node.devices.get(id).copied())
            .collect();
        if &want != devs || want.len() != ids.len() {
            truth.findings.push(Finding::Differs {
                node: node.name.clone(),
                container: key,
                inside: devs.clone(),
                said: ids,
            });
        }
    }
    for (dev, pods) in holders {
        if pods.len() > 1 {
            truth.doubles += 1;
            truth.findings.push(Finding::Double {
                node: node.name.clone(),
                dev,
                pods: pods.into_iter().map(str::to_owned).collect(),
            });
        }
    }
}

/// Each workload container the API shows, by its container ID.
fn names(pods: &[Pod], now: SystemTime) -> BTreeMap<String, Named> {
    let mut named = BTreeMap::new();
    for pod in pods {
        for status in &pod.status.container_statuses {
            let Some(id) = status.container_id.split("//").last() else {
                continue;
            };
            let running_for = status
                .started_at()
                .and_then(|started| now.duration_since(started).ok())
                .unwrap_or_default();
            named.insert(
                id.to_owned(),
                Named {
                    pod: format!("default/{}", pod.metadata.name),
                    container: status.name.clone(),
                    running_for,
                    terminating: pod.metadata.deletion_timestamp.is_some(),
                },
            );
        }
    }
    named
}

/// What PodResources says each container (`namespace/pod/container`) holds of the EFAs.
fn said_by(
    answer: &efa_device_plugin::proto::podresources::ListPodResourcesResponse,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut said = BTreeMap::new();
    for pod in &answer.pod_resources {
        for container in &pod.containers {
            let ids: BTreeSet<String> = container
                .devices
                .iter()
                .filter(|devices| devices.resource_name == RESOURCE)
                .flat_map(|devices| devices.device_ids.iter().cloned())
                .collect();
            if !ids.is_empty() {
                said.insert(
                    format!("{}/{}/{}", pod.namespace, pod.name, container.name),
                    ids,
                );
            }
        }
    }
    said
}

/// A container cgroup with a process in it.
#[derive(Debug, PartialEq, Eq)]
struct Found {
    /// The cgroup's name: the container's ID.
    id: String,
    /// Its first process.
    pid: u32,
}

/// Every container cgroup under `kubepods` (a pod's cgroup, `pod<uid>`, holds one per
/// container) with a process in it.
fn containers(kubepods: &Path) -> Vec<Found> {
    let mut found = Vec::new();
    let mut dirs = vec![kubepods.to_owned()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        let in_pod = dir
            .file_name()
            .is_some_and(|name| name.to_string_lossy().starts_with("pod"));
        for entry in entries.flatten() {
            let path = entry.path();
            if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                continue;
            }
            if in_pod {
                let first = fs::read_to_string(path.join("cgroup.procs"))
                    .ok()
                    .and_then(|procs| procs.split_whitespace().next()?.parse().ok());
                if let Some(pid) = first {
                    found.push(Found {
                        id: entry.file_name().to_string_lossy().into_owned(),
                        pid,
                    });
                }
            }
            dirs.push(path);
        }
    }
    found
}

/// The device numbers of the uverbs nodes in the `/dev/infiniband` of process `pid`'s root.
fn uverbs_inside(pid: u32) -> BTreeSet<DevNum> {
    uverbs_in(
        &Path::new("/proc")
            .join(pid.to_string())
            .join("root/dev/infiniband"),
    )
}

fn uverbs_in(dir: &Path) -> BTreeSet<DevNum> {
    let Ok(entries) = fs::read_dir(dir) else {
        return BTreeSet::new();
    };
    entries
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("uverbs"))
        .filter_map(|entry| {
            let rdev = fs::metadata(entry.path()).ok()?.rdev();
            Some(DevNum {
                major: major(rdev) as u32,
                minor: minor(rdev) as u32,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use efa_device_plugin::testkit::simulate::{FakeNode, Nodes, Shape};

    use super::*;

    fn dev(minor: u32) -> DevNum {
        DevNum { major: 231, minor }
    }

    fn named(pod: &str, running_for: u64) -> Named {
        Named {
            pod: format!("default/{pod}"),
            container: "probe".to_owned(),
            running_for: Duration::from_secs(running_for),
            terminating: false,
        }
    }

    fn node() -> NodeView {
        NodeView {
            name: "efa-a".to_owned(),
            cgroup_root: "/".to_owned(),
            pod_resources: PathBuf::new(),
            devices: [
                ("rdmap16s27", 192),
                ("rdmap32s27", 193),
                ("rdmap144s27", 194),
            ]
            .into_iter()
            .map(|(id, minor)| (id.to_owned(), dev(minor)))
            .collect(),
        }
    }

    fn said(entries: &[(&str, &[&str])]) -> BTreeMap<String, BTreeSet<String>> {
        entries
            .iter()
            .map(|(key, ids)| {
                (
                    (*key).to_owned(),
                    ids.iter().map(|id| (*id).to_owned()).collect(),
                )
            })
            .collect()
    }

    fn compared(
        inside: &[(&Named, BTreeSet<DevNum>)],
        said: &BTreeMap<String, BTreeSet<String>>,
    ) -> (Truth, Vec<String>) {
        let mut truth = Truth::default();
        compare(&node(), Some(said), inside, &mut truth);
        let lines = truth.findings.iter().map(ToString::to_string).collect();
        (truth, lines)
    }

    #[test]
    fn one_device_inside_two_pods_is_a_double_booking() {
        let (a, b) = (named("a", 60), named("b", 60));
        let inside = [
            (&a, BTreeSet::from([dev(192), dev(193)])),
            (&b, BTreeSet::from([dev(193)])),
        ];
        let said = said(&[
            ("default/a/probe", &["rdmap16s27", "rdmap32s27"]),
            ("default/b/probe", &["rdmap32s27"]),
        ]);
        let (truth, lines) = compared(&inside, &said);
        assert_eq!(truth.doubles, 1);
        assert_eq!(lines, ["double efa-a 231:193 default/a default/b"]);
    }

    #[test]
    fn a_settled_container_whose_inside_podresources_does_not_say_differs() {
        let (held, young) = (named("held", 60), named("young", 1));
        let inside = [
            (&held, BTreeSet::from([dev(192)])),
            (&young, BTreeSet::from([dev(194)])),
        ];
        let said = said(&[("default/held/probe", &["rdmap32s27"])]);
        let (truth, lines) = compared(&inside, &said);
        assert_eq!(truth.doubles, 0);
        assert_eq!(
            lines,
            ["differs efa-a default/held/probe inside [231:192] podresources [rdmap32s27]"]
        );
        assert!(truth.findings[0].may_settle());
    }

    #[test]
    fn an_id_podresources_names_that_the_node_lacks_differs() {
        let held = named("held", 60);
        let inside = [(&held, BTreeSet::from([dev(192)]))];
        let said = said(&[("default/held/probe", &["rdmap16s27", "rdmap99s27"])]);
        assert_eq!(compared(&inside, &said).1.len(), 1);
    }

    #[test]
    fn container_cgroups_with_a_process_are_found_under_each_qos_class() {
        let root = tempfile::tempdir().unwrap();
        let kubepods = root.path().join("kubepods");
        for (dir, procs) in [
            ("podaa-1/c1", "4242\n4243\n"),
            ("besteffort/podbb-2/c2", "77\n"),
            ("burstable/podcc-3/c3", ""),
        ] {
            fs::create_dir_all(kubepods.join(dir)).unwrap();
            fs::write(kubepods.join(dir).join("cgroup.procs"), procs).unwrap();
        }
        let mut found = containers(&kubepods);
        found.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(
            found,
            [
                Found {
                    id: "c1".to_owned(),
                    pid: 4242
                },
                Found {
                    id: "c2".to_owned(),
                    pid: 77
                }
            ]
        );
    }

    #[test]
    fn the_uverbs_nodes_of_a_tree_are_read_by_device_number() {
        let root = tempfile::tempdir().unwrap();
        let node = FakeNode {
            sysfs: root.path().join("sys"),
            dev: root.path().join("dev"),
            nodes: Nodes::CharDevices,
        };
        let efas = node.lay_out(Shape::P4d).unwrap();
        let want: BTreeSet<DevNum> = efas
            .iter()
            .filter(|efa| efa.is_efa())
            .map(|efa| efa.dev)
            .collect();
        assert_eq!(uverbs_in(&root.path().join("dev/infiniband")), want);
    }
}
