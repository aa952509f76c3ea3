//! The kubelet's PodResources `List`, through the crate's own client over the kubelet's socket.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use efa_device_plugin::proto::podresources::pod_resources_lister_client::PodResourcesListerClient;
use efa_device_plugin::proto::podresources::{ListPodResourcesRequest, ListPodResourcesResponse};
use efa_device_plugin::uds;

/// How long one `List` may take before the kubelet counts as not answering.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// Every pod's resources, as the kubelet serving `socket` answers one `List`.
pub fn list(socket: &Path) -> Result<ListPodResourcesResponse> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start a runtime for PodResources")?;
    let what = || format!("PodResources List on {}", socket.display());
    runtime.block_on(async {
        let channel = uds::dial(socket).await.with_context(what)?;
        let mut client = PodResourcesListerClient::new(channel);
        let answer = tokio::time::timeout(LIST_TIMEOUT, client.list(ListPodResourcesRequest {}))
            .await
            .with_context(|| format!("{}: no answer within 10s", what()))?
            .with_context(what)?;
        Ok(answer.into_inner())
    })
}

/// Calls `List` on `socket` `rate` times a second, on one connection, until `stop` is set: how
/// many calls there were, and how many failed. Each `List` makes the kubelet run
/// `UpdateAllocatedDevices`, the trigger of kubernetes PR #137534.
pub fn list_repeatedly(socket: &Path, rate: u32, stop: &AtomicBool) -> Result<(u64, u64)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start a runtime for PodResources")?;
    runtime.block_on(async {
        let channel = uds::dial(socket)
            .await
            .with_context(|| format!("PodResources on {}", socket.display()))?;
        let mut client = PodResourcesListerClient::new(channel);
        let mut tick = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
        // As a ticker does: a call that took long does not make the next ones come faster.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let (mut lists, mut failed) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            lists += 1;
            let answer =
                tokio::time::timeout(LIST_TIMEOUT, client.list(ListPodResourcesRequest {})).await;
            if !matches!(answer, Ok(Ok(_))) {
                failed += 1;
            }
        }
        Ok((lists, failed))
    })
}

/// `namespace/pod/container` of the container that holds device `id` of `resource`, if one
/// does.
pub fn holder(resources: &ListPodResourcesResponse, resource: &str, id: &str) -> Option<String> {
    resources.pod_resources.iter().find_map(|pod| {
        pod.containers.iter().find_map(|container| {
            container
                .devices
                .iter()
                .any(|devices| {
                    devices.resource_name == resource && devices.device_ids.iter().any(|d| d == id)
                })
                .then(|| format!("{}/{}/{}", pod.namespace, pod.name, container.name))
        })
    })
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::thread;

    use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};

    use super::*;

    #[test]
    fn list_asks_the_kubelet_over_its_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        let (served, serving) = mpsc::channel();
        let at = socket.clone();
        // The stand-in kubelet serves on a runtime of its own until the test process ends.
        thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let efa = "vpc.amazonaws.com/efa";
                let _stub = PodResourcesStub::start(
                    &at,
                    vec![pod("default", "mig-h", "probe", efa, &["rdmap16s27"])],
                )
                .unwrap();
                served.send(()).unwrap();
                std::future::pending::<()>().await;
            });
        });
        serving.recv().unwrap();
        let answer = list(&socket).unwrap();
        assert_eq!(
            holder(&answer, "vpc.amazonaws.com/efa", "rdmap16s27").as_deref(),
            Some("default/mig-h/probe")
        );
    }

    #[test]
    fn a_device_is_held_by_the_container_that_lists_it_under_its_resource() {
        let efa = "vpc.amazonaws.com/efa";
        let answer = ListPodResourcesResponse {
            pod_resources: vec![
                pod("default", "gpu", "cuda", "nvidia.com/gpu", &["rdmap32s27"]),
                pod("default", "mig-h", "probe", efa, &["rdmap16s27"]),
            ],
        };
        assert_eq!(
            holder(&answer, efa, "rdmap16s27").as_deref(),
            Some("default/mig-h/probe")
        );
        assert_eq!(holder(&answer, efa, "rdmap32s27"), None);
    }
}
