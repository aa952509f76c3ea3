//! The pods the cluster cases make, as `lib/workload.py` makes them for the bash cases: one
//! container, "probe" (busybox), asking for some EFAs, listing `/dev/infiniband`, printing
//! `FI_PROVIDER` and then sleeping as the container's process.

use serde_json::{Value, json};

use crate::node::RESOURCE;

const HOSTNAME: &str = "kubernetes.io/hostname";

/// A pod in `default` asking for `count` EFAs, which may run on `node` only.
pub fn pod_on(name: &str, count: u32, node: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeSelector": {HOSTNAME: node},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "probe",
                "image": "localhost/busybox:1",
                "imagePullPolicy": "Never",
                "command": ["sh", "-c",
                    "ls -l /dev/infiniband; echo FI_PROVIDER=${FI_PROVIDER:-unset}; exec sleep 100000"],
                "resources": {"limits": {RESOURCE: count}},
            }],
        },
    })
}
