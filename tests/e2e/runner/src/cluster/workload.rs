//! The workloads the cluster cases make: one
//! container, "probe" (busybox), asking for some EFAs, listing `/dev/infiniband` (and any further
//! paths), printing `FI_PROVIDER` (last, so that the listing is whole) and then sleeping as the
//! container's process.

use serde_json::{Value, json};

use crate::node::RESOURCE;

const HOSTNAME: &str = "kubernetes.io/hostname";

/// Where a workload's pods may run.
#[derive(Clone, Copy)]
pub enum Placement<'a> {
    /// Wherever the scheduler finds room.
    Anywhere,
    /// On this node only, through the scheduler (`nodeSelector`).
    Node(&'a str),
    /// On this node by preference (node affinity), which a drain overrides.
    Prefer(&'a str),
    /// Bound to this node past the scheduler (`nodeName`), as a pod bound before a reboot.
    Bound(&'a str),
}

/// How long a pod's container sleeps unless told otherwise: past any case.
const LONG_SLEEP: u64 = 100_000;
/// How long a [`short_job`]'s container sleeps: long enough for its allocation to be read.
const JOB_SLEEP: u64 = 5;

/// The probe's script: lists `/dev/infiniband` and `also`, prints `FI_PROVIDER`, then becomes
/// `sleep SECONDS`.
fn probe_script(also: &[&str], sleep: u64) -> String {
    let listing = std::iter::once("/dev/infiniband")
        .chain(also.iter().copied())
        .map(|path| format!("ls -l {path}"))
        .collect::<Vec<_>>()
        .join("; ");
    format!("{listing}; echo FI_PROVIDER=${{FI_PROVIDER:-unset}}; exec sleep {sleep}")
}

fn pod_spec(count: u32, restart: &str, placement: Placement) -> Value {
    probe_spec(count, restart, placement, &probe_script(&[], LONG_SLEEP))
}

fn probe_spec(count: u32, restart: &str, placement: Placement, script: &str) -> Value {
    let mut spec = json!({
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": "probe",
            "image": "localhost/busybox:1",
            "imagePullPolicy": "Never",
            "command": ["sh", "-c", script],
            "resources": {"limits": {RESOURCE: count}},
        }],
    });
    match placement {
        Placement::Anywhere => {}
        Placement::Node(node) => spec["nodeSelector"] = json!({HOSTNAME: node}),
        Placement::Prefer(node) => {
            spec["affinity"] = json!({"nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [{
                    "weight": 100,
                    "preference": {"matchExpressions": [
                        {"key": HOSTNAME, "operator": "In", "values": [node]}
                    ]},
                }],
            }});
        }
        Placement::Bound(node) => spec["nodeName"] = json!(node),
    }
    spec
}

/// A bare pod in `default` asking for `count` EFAs; its container restarts per `restart`
/// (`Never`, `Always`).
pub fn pod(name: &str, count: u32, restart: &str, placement: Placement) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": pod_spec(count, restart, placement),
    })
}

/// A bare pod in `default` asking for `count` EFAs whose container restarts per `restart` and
/// whose process is `sleep SECONDS`, which names it on the host.
pub fn pod_sleeping(name: &str, count: u32, restart: &str, seconds: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": probe_spec(count, restart, Placement::Anywhere, &probe_script(&[], seconds)),
    })
}

/// A pod asking for `count` EFAs, which may run on `node` only and is never restarted.
pub fn pod_on(name: &str, count: u32, node: &str) -> Value {
    pod(name, count, "Never", Placement::Node(node))
}

/// A Job of one pod asking for `count` EFAs, restarted on failure; its pods carry
/// `job-name=NAME`.
pub fn job(name: &str, count: u32, placement: Placement) -> Value {
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"backoffLimit": 6, "template": {"spec": pod_spec(count, "OnFailure", placement)}},
    })
}

/// A Job of one pod asking for `count` EFAs wherever the scheduler finds room, whose container
/// also lists `also`, sleeps a few seconds and completes; never retried.
pub fn short_job(name: &str, count: u32, also: &[&str]) -> Value {
    once_job(name, count, &probe_script(also, JOB_SLEEP))
}

/// A Job of one pod asking for `count` EFAs wherever the scheduler finds room, whose container
/// completes after `seconds`; never retried.
pub fn job_sleeping(name: &str, count: u32, seconds: u64) -> Value {
    once_job(name, count, &probe_script(&[], seconds))
}

fn once_job(name: &str, count: u32, script: &str) -> Value {
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"backoffLimit": 0, "template": {
            "spec": probe_spec(count, "Never", Placement::Anywhere, script),
        }},
    })
}

/// `object`, a Pod or a Job, labelled `key=value`; a Job's pods too.
pub fn labelled(mut object: Value, key: &str, value: &str) -> Value {
    object["metadata"]["labels"][key] = json!(value);
    if object["kind"] == "Job" {
        object["spec"]["template"]["metadata"]["labels"][key] = json!(value);
    }
    object
}

/// A Deployment of one pod asking for `count` EFAs; its pods carry `app=NAME`.
pub fn deployment(name: &str, count: u32, placement: Placement) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": pod_spec(count, "Always", placement),
            },
        },
    })
}
