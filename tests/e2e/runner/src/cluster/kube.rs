//! The API server through `kubectl -o json`, read into the few fields the cases look at.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::http;
use crate::plugin::METRICS_PORT;
use crate::pods::listing_entries;
use crate::wait::{secs, wait_for};

/// Where the chart and the manifests run the plugin, and the label they give its pods.
const PLUGIN_NAMESPACE: &str = "kube-system";
const PLUGIN_DAEMONSET: &str = "efa-device-plugin";
const PLUGIN_LABEL: (&str, &str) = ("app.kubernetes.io/name", "efa-device-plugin");

/// The label selector of the plugin's pods.
pub fn plugin_selector() -> String {
    format!("{}={}", PLUGIN_LABEL.0, PLUGIN_LABEL.1)
}

pub struct Kube {
    pub kubectl: PathBuf,
    pub kubeconfig: PathBuf,
}

#[derive(Debug, Deserialize)]
pub struct Pod {
    pub metadata: Metadata,
    #[serde(default)]
    pub spec: PodSpec,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Metadata {
    pub name: String,
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// RFC 3339 to the second: orders objects by their making.
    #[serde(default)]
    pub creation_timestamp: String,
    /// Set once the object is being deleted: a terminating pod serves nothing more.
    #[serde(default)]
    pub deletion_timestamp: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    /// Empty until the scheduler binds the pod.
    #[serde(default)]
    pub node_name: String,
    /// As the API server keeps it: compared whole with the shipped manifests'.
    #[serde(default)]
    pub security_context: Option<Value>,
    #[serde(default)]
    pub containers: Vec<Container>,
    #[serde(default)]
    pub volumes: Vec<Volume>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    pub name: String,
    #[serde(default)]
    pub security_context: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    #[serde(default)]
    pub host_path: Option<HostPath>,
}

#[derive(Debug, Deserialize)]
pub struct HostPath {
    pub path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default)]
    pub phase: String,
    /// Why a pod failed: `UnexpectedAdmissionError` for one the kubelet refused.
    #[serde(default)]
    pub reason: String,
    #[serde(default, rename = "podIP")]
    pub pod_ip: String,
    /// Why, in words, next to `reason`.
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub container_statuses: Vec<ContainerStatus>,
    /// KEP-5004: the claim the scheduler made for the pod's extended resources, when it handed
    /// them to DRA.
    #[serde(default)]
    pub extended_resource_claim_status: Option<ExtendedResourceClaimStatus>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtendedResourceClaimStatus {
    pub resource_claim_name: String,
}

#[derive(Debug, Deserialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub message: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStatus {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub restart_count: u64,
    /// `containerd://ID` once the container exists.
    #[serde(default, rename = "containerID")]
    pub container_id: String,
    /// The image as the pod names it (`localhost/efa-device-plugin:e2e-arm64`).
    #[serde(default)]
    pub image: String,
    #[serde(default)]
    pub state: ContainerState,
    /// KEP-4680: each allocated resource's devices with their health, where the kubelet reports
    /// it.
    #[serde(default)]
    pub allocated_resources_status: Vec<ResourceStatus>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ContainerState {
    /// Set while the container runs.
    #[serde(default)]
    pub running: Option<Value>,
    /// Set while the container is not running: why (`CreateContainerError`, ...) and what the
    /// runtime said.
    #[serde(default)]
    pub waiting: Option<Waiting>,
    /// Set once the container ended: why, and its exit code.
    #[serde(default)]
    pub terminated: Option<Terminated>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Terminated {
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub exit_code: i32,
}

impl ContainerStatus {
    /// When the running container started, as the kubelet reports it.
    pub fn started_at(&self) -> Option<std::time::SystemTime> {
        let started = self.state.running.as_ref()?.get("startedAt")?.as_str()?;
        humantime::parse_rfc3339(started).ok()
    }
}

#[derive(Debug, Deserialize)]
pub struct Waiting {
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
}

#[derive(Debug, Deserialize)]
pub struct ResourceStatus {
    pub name: String,
    #[serde(default)]
    pub resources: Vec<ResourceHealth>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceHealth {
    #[serde(rename = "resourceID")]
    pub resource_id: String,
    #[serde(default)]
    pub health: String,
}

impl Pod {
    /// The health the kubelet reports in the status for device `id` of `resource`, if it does.
    pub fn device_health(&self, resource: &str, id: &str) -> Option<&str> {
        self.status
            .container_statuses
            .iter()
            .flat_map(|container| &container.allocated_resources_status)
            .filter(|status| status.name == resource)
            .flat_map(|status| &status.resources)
            .find(|device| device.resource_id == id)
            .map(|device| device.health.as_str())
    }

    /// The `hostPath` the pod mounts as its volume `name`.
    pub fn host_path_of(&self, volume: &str) -> Option<&str> {
        self.spec
            .volumes
            .iter()
            .find(|v| v.name == volume)
            .and_then(|v| v.host_path.as_ref())
            .map(|host_path| host_path.path.as_str())
    }

    /// The containerd ID of its first container, once there is one.
    pub fn container_id(&self) -> Option<&str> {
        self.status
            .container_statuses
            .first()
            .and_then(|c| c.container_id.strip_prefix("containerd://"))
    }

    pub fn restarts(&self) -> u64 {
        self.status
            .container_statuses
            .iter()
            .map(|c| c.restart_count)
            .sum()
    }

    /// The body of `GET path` on the plugin's HTTP port at this pod's IP (its metrics and
    /// probes), if the answer is 200.
    pub fn plugin_http(&self, path: &str) -> Result<String> {
        http::get_at(self.ip()?, METRICS_PORT, path)
    }

    /// The status code of the answer to `GET path` on the plugin's HTTP port at this pod's IP.
    pub fn plugin_status(&self, path: &str) -> Result<String> {
        http::status_at(self.ip()?, METRICS_PORT, path)
    }

    fn ip(&self) -> Result<IpAddr> {
        self.status
            .pod_ip
            .parse()
            .with_context(|| format!("{}'s IP {:?}", self.metadata.name, self.status.pod_ip))
    }

    /// Labelled as the chart and the manifests label the plugin's pods.
    pub fn is_plugin(&self) -> bool {
        self.metadata.labels.get(PLUGIN_LABEL.0).map(String::as_str) == Some(PLUGIN_LABEL.1)
    }

    /// Ready and not terminating: a plugin pod that serves its node.
    pub fn serves(&self) -> bool {
        self.metadata.deletion_timestamp.is_none()
            && self
                .status
                .conditions
                .iter()
                .any(|condition| condition.kind == "Ready" && condition.status == "True")
    }

    /// The claim the scheduler made for its extended resources through DRA, if it did.
    pub fn extended_claim(&self) -> Option<&str> {
        self.status
            .extended_resource_claim_status
            .as_ref()
            .map(|status| status.resource_claim_name.as_str())
            .filter(|name| !name.is_empty())
    }

    /// Why its first container is not running, if it is not.
    pub fn waiting(&self) -> Option<&Waiting> {
        self.status
            .container_statuses
            .first()
            .and_then(|container| container.state.waiting.as_ref())
    }

    /// Pending because the scheduler finds too few of `resource` on every node.
    pub fn pending_for(&self, resource: &str) -> bool {
        self.status.phase == "Pending"
            && self
                .unschedulable_message()
                .is_some_and(|message| message.contains(&format!("Insufficient {resource}")))
    }

    /// The scheduler's message while it cannot place the pod.
    pub fn unschedulable_message(&self) -> Option<&str> {
        self.status
            .conditions
            .iter()
            .find(|condition| condition.kind == "PodScheduled")
            .map(|condition| condition.message.as_str())
            .filter(|message| !message.is_empty())
    }
}

#[derive(Debug, Deserialize)]
pub struct Node {
    pub metadata: Metadata,
    #[serde(default)]
    pub status: NodeStatus,
}

#[derive(Debug, Default, Deserialize)]
pub struct NodeStatus {
    #[serde(default)]
    pub allocatable: BTreeMap<String, String>,
    #[serde(default)]
    pub capacity: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
pub struct List<T> {
    pub items: Vec<T>,
}

/// An item of a List of several kinds (`kubectl get nodes,pods`).
#[derive(Debug, Deserialize)]
#[serde(tag = "kind")]
pub enum Object {
    Node(Node),
    // Boxed: a pod's statuses make it twice a node's size.
    Pod(Box<Pod>),
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    #[serde(default)]
    last_timestamp: Option<String>,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    message: String,
    involved_object: EventObject,
}

#[derive(Debug, Deserialize)]
struct EventObject {
    #[serde(default)]
    name: String,
}

impl Kube {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.kubectl);
        command.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        command
    }

    /// kubectl's output, or its error output as the error.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let output = self
            .command(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("run kubectl {}", args.join(" ")))?;
        if !output.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// `kubectl apply -f -` of one object or a List.
    pub fn apply(&self, object: &Value) -> Result<()> {
        let mut child = self
            .command(&["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("run kubectl apply")?;
        child
            .stdin
            .take()
            .context("kubectl's stdin")?
            .write_all(object.to_string().as_bytes())?;
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!(
                "kubectl apply: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    }

    /// `kubectl ARGS -o json`, read as `T`.
    pub fn get<T: DeserializeOwned>(&self, args: &[&str]) -> Result<T> {
        let mut args = args.to_vec();
        args.extend(["-o", "json"]);
        let out = self.run(&args)?;
        serde_json::from_str(&out).with_context(|| format!("kubectl {}: not JSON", args.join(" ")))
    }

    /// The pod `name` in `default`, if there is one.
    pub fn pod(&self, name: &str) -> Result<Option<Pod>> {
        let list: List<Pod> = self.get(&[
            "get",
            "pods",
            "-n",
            "default",
            "--field-selector",
            &format!("metadata.name={name}"),
        ])?;
        Ok(list.items.into_iter().next())
    }

    /// Every pod of `default`.
    pub fn pods(&self) -> Result<Vec<Pod>> {
        let list: List<Pod> = self.get(&["get", "pods", "-n", "default"])?;
        Ok(list.items)
    }

    /// The pods of `default` with the label `selector` (`key=value`).
    pub fn pods_labelled(&self, selector: &str) -> Result<Vec<Pod>> {
        let list: List<Pod> = self.get(&["get", "pods", "-n", "default", "-l", selector])?;
        Ok(list.items)
    }

    /// Deletes the objects of `default` named `kind/name`, waiting until they are gone.
    pub fn delete(&self, objects: &[&str]) -> Result<()> {
        let mut args = vec!["delete", "-n", "default", "--ignore-not-found", "--wait"];
        args.extend(objects);
        self.run(&args).map(drop)
    }

    /// The plugin's pods on `node`, by the label the chart and the manifests give them.
    pub fn plugin_pods(&self, node: &str) -> Result<Vec<Pod>> {
        self.system_pods(&plugin_selector(), node)
    }

    /// The pods of the plugins' namespace on `node` with the label `selector` (`key=value`): the
    /// plugin's, or the AWS plugin stand-in's.
    pub fn system_pods(&self, selector: &str, node: &str) -> Result<Vec<Pod>> {
        self.system_pods_where(
            selector,
            &["--field-selector", &format!("spec.nodeName={node}")],
        )
    }

    /// `kubectl rollout status` of the plugin's DaemonSet, as docs/migration.md's step 3 checks
    /// it: every node's pod updated and Ready within `timeout`.
    pub fn plugin_rolled_out(&self, timeout: Duration) -> Result<()> {
        self.run(&[
            "rollout",
            "status",
            "-n",
            PLUGIN_NAMESPACE,
            &format!("daemonset/{PLUGIN_DAEMONSET}"),
            &format!("--timeout={}s", timeout.as_secs()),
        ])
        .map(drop)
    }

    /// The plugin's pods on every node.
    pub fn all_plugin_pods(&self) -> Result<Vec<Pod>> {
        self.system_pods_where(&plugin_selector(), &[])
    }

    /// The pods of the plugins' namespace with the label `selector` that `kubectl get`'s
    /// further `selectors` select.
    fn system_pods_where(&self, selector: &str, selectors: &[&str]) -> Result<Vec<Pod>> {
        let mut args = vec!["get", "pods", "-n", PLUGIN_NAMESPACE, "-l", selector];
        args.extend(selectors);
        let list: List<Pod> = self.get(&args)?;
        Ok(list.items)
    }

    /// The one plugin pod that serves `node`; `None` while there is none, or more than one.
    pub fn serving_plugin_pod(&self, node: &str) -> Result<Option<Pod>> {
        self.serving_pod(&plugin_selector(), node)
    }

    /// The plugin pod that serves `node`; an error while there is none.
    pub fn serving_plugin(&self, node: &str) -> Result<Pod> {
        self.serving_plugin_pod(node)?
            .with_context(|| format!("no Ready plugin pod on {node}"))
    }

    /// The one pod of the plugins' namespace on `node` with the label `selector` that serves
    /// it; `None` while there is none, or more than one.
    pub fn serving_pod(&self, selector: &str, node: &str) -> Result<Option<Pod>> {
        let mut serving: Vec<Pod> = self
            .system_pods(selector, node)?
            .into_iter()
            .filter(Pod::serves)
            .collect();
        Ok((serving.len() == 1).then(|| serving.remove(0)))
    }

    /// Every node, and the plugin's pods, from one call: a sample of the fleet at one moment.
    pub fn nodes_and_plugin_pods(&self) -> Result<Vec<Object>> {
        let list: List<Object> = self.get(&["get", "nodes,pods", "-n", PLUGIN_NAMESPACE])?;
        Ok(list
            .items
            .into_iter()
            .filter(|object| match object {
                Object::Node(_) => true,
                Object::Pod(pod) => pod.is_plugin(),
            })
            .collect())
    }

    /// Whether no plugin pod is left on any node.
    pub fn no_plugin_pods(&self) -> Result<bool> {
        Ok(self.all_plugin_pods()?.is_empty())
    }

    /// The output of `command` run in the plugin pod `name`'s container.
    pub fn plugin_exec(&self, name: &str, command: &[&str]) -> Result<String> {
        let mut args = vec!["exec", "-n", PLUGIN_NAMESPACE, name, "--"];
        args.extend(command);
        self.run(&args)
    }

    /// `kubectl rollout restart` of the plugin's DaemonSet, as the kustomize overlays and the
    /// chart's release of that name call it.
    pub fn restart_plugin_rollout(&self) -> Result<()> {
        self.run(&[
            "rollout",
            "restart",
            "-n",
            PLUGIN_NAMESPACE,
            "daemonset/efa-device-plugin",
        ])
        .map(drop)
    }

    /// `reason: message` of the last 3 events about the plugin's pods, joined by `|`.
    pub fn plugin_events(&self) -> String {
        let events: Result<List<Event>> = self.get(&[
            "get",
            "events",
            "-n",
            PLUGIN_NAMESPACE,
            "--field-selector",
            "involvedObject.kind=Pod",
        ]);
        match events {
            Ok(mut list) => {
                list.items
                    .sort_by(|a, b| a.last_timestamp.cmp(&b.last_timestamp));
                let skip = list.items.len().saturating_sub(3);
                list.items[skip..]
                    .iter()
                    .map(|event| format!("{}: {}", event.reason, event.message))
                    .collect::<Vec<_>>()
                    .join("|")
            }
            Err(err) => format!("(no events: {err:#})"),
        }
    }

    /// The log of pod `name` in `default`.
    pub fn log(&self, name: &str) -> Result<String> {
        self.run(&["logs", "-n", "default", name])
    }

    /// What pod `name`'s container in `default` sees in `/dev/infiniband` now, as
    /// [`listing_entries`] gives a listing.
    pub fn device_nodes(&self, name: &str) -> Result<BTreeSet<String>> {
        let listing = self.run(&[
            "exec",
            "-n",
            "default",
            name,
            "--",
            "ls",
            "-l",
            "/dev/infiniband",
        ])?;
        Ok(listing_entries(&listing))
    }

    /// The log of the plugin pod `name`'s container, or of its previous one.
    pub fn plugin_log(&self, name: &str, previous: bool) -> Result<String> {
        let mut args = vec!["logs", "-n", PLUGIN_NAMESPACE, name];
        if previous {
            args.push("--previous");
        }
        self.run(&args)
    }

    /// Sets (`Some`) or removes (`None`) a label of `node`.
    pub fn label_node(&self, node: &str, key: &str, value: Option<&str>) -> Result<()> {
        let label = match value {
            Some(value) => format!("{key}={value}"),
            None => format!("{key}-"),
        };
        self.run(&["label", "node", node, &label, "--overwrite"])
            .map(drop)
    }

    /// How many of `resource` the node offers; `None` when it lists none.
    pub fn allocatable(&self, node: &str, resource: &str) -> Result<Option<u64>> {
        let node: Node = self.get(&["get", "node", node])?;
        count_of(&node.status.allocatable, resource, "allocatable")
    }

    /// How many of `resource` the node has, offered or not; `None` when it lists none.
    pub fn capacity(&self, node: &str, resource: &str) -> Result<Option<u64>> {
        let node: Node = self.get(&["get", "node", node])?;
        count_of(&node.status.capacity, resource, "capacity")
    }

    /// Applies `pod` and waits until it is Running; on a timeout, the reason carries its events.
    pub fn run_pod(&self, pod: &Value) -> Result<Pod> {
        let name = pod["metadata"]["name"]
            .as_str()
            .context("a pod to run has no metadata.name")?;
        self.apply(pod)?;
        wait_for(&format!("pod {name} Running"), secs(60), || {
            Ok(self.pod(name)?.filter(|pod| pod.status.phase == "Running"))
        })
        .map_err(|err| anyhow!("{err}: {}", self.events_of(name)))
    }

    /// Deletes every pod of `default`, as a case that starts from a clean node needs, waiting
    /// until they are gone, 60 s at most.
    pub fn delete_all_pods(&self) -> Result<()> {
        self.run(&[
            "delete",
            "pods",
            "--all",
            "-n",
            "default",
            "--wait",
            "--timeout=60s",
        ])
        .map(drop)
    }

    /// Deletes the pods of `default` named, waiting until they are gone.
    pub fn delete_pods(&self, names: &[&str]) -> Result<()> {
        let mut args = vec![
            "delete",
            "pod",
            "-n",
            "default",
            "--ignore-not-found",
            "--wait",
        ];
        args.extend(names);
        self.run(&args).map(drop)
    }

    /// Deletes pod `name` of `default` at once, without waiting for its kubelet: one on a node
    /// that is going would otherwise wait for the pod garbage collector.
    pub fn force_delete_pod(&self, name: &str) -> Result<()> {
        self.run(&[
            "delete",
            "pod",
            "-n",
            "default",
            "--ignore-not-found",
            "--grace-period=0",
            "--force",
            name,
        ])
        .map(drop)
    }

    /// `reason: message` of each event about the object `name` in `default`, joined by `|`.
    pub fn events_of(&self, name: &str) -> String {
        let events: Result<List<Event>> = self.get(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector",
            &format!("involvedObject.name={name}"),
        ]);
        match events {
            Ok(list) => list
                .items
                .iter()
                .filter(|event| event.involved_object.name == name)
                .map(|event| format!("{}: {}", event.reason, event.message))
                .collect::<Vec<_>>()
                .join("|"),
            Err(err) => format!("(no events: {err:#})"),
        }
    }
}

/// The count of `resource` in a node's `allocatable` or `capacity` (`which`).
fn count_of(counts: &BTreeMap<String, String>, resource: &str, which: &str) -> Result<Option<u64>> {
    counts
        .get(resource)
        .map(|count| count.parse().with_context(|| format!("{which} {count}")))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_device_health_and_scheduling_message_are_read_from_its_status() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "holder", "uid": "u1"},
            "status": {
                "phase": "Running",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [{
                    "name": "probe", "restartCount": 2,
                    "allocatedResourcesStatus": [{
                        "name": "vpc.amazonaws.com/efa",
                        "resources": [{"resourceID": "rdmap19s0", "health": "Unhealthy"}]
                    }]
                }]
            }
        }))
        .unwrap();
        assert_eq!(
            pod.device_health("vpc.amazonaws.com/efa", "rdmap19s0"),
            Some("Unhealthy")
        );
        assert_eq!(
            pod.device_health("vpc.amazonaws.com/efa", "rdmap20s0"),
            None
        );
        assert_eq!(pod.restarts(), 2);
        assert_eq!(pod.unschedulable_message(), None);
    }
}
