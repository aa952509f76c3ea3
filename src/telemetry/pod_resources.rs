//! Which pod holds which EFA, from the kubelet's PodResources API, to label traffic with its pod.
//!
//! Asked once per scrape with a short deadline: a slow or absent kubelet costs the scrape its
//! pod labels, never the scrape itself.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use crate::allocation::sharing;
use crate::proto::podresources::{
    ListPodResourcesRequest, ListPodResourcesResponse,
    pod_resources_lister_client::PodResourcesListerClient,
};
use crate::uds;

/// How long a scrape waits for the kubelet's answer.
pub(crate) const LIST_TIMEOUT: Duration = Duration::from_secs(1);

/// A container that holds a device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

/// Device id → the containers holding it, sorted.
pub(crate) type Holders = BTreeMap<String, Vec<Holder>>;

pub struct PodResources {
    socket: PathBuf,
    resource_name: String,
    /// Whether the last lookup worked, so a failure is logged when it starts, not per scrape.
    last_ok: Mutex<Option<bool>>,
}

impl PodResources {
    pub fn new(socket: PathBuf, resource_name: String) -> Self {
        PodResources {
            socket,
            resource_name,
            last_ok: Mutex::new(None),
        }
    }

    /// The current holders of this resource's devices; empty when the kubelet cannot tell.
    pub async fn holders(&self) -> Holders {
        // Without the socket (not mounted, or no kubelet) attribution is simply off.
        if !self.socket.exists() {
            return Holders::new();
        }
        let listed = tokio::time::timeout(LIST_TIMEOUT, self.list()).await;
        let outcome = match listed {
            Ok(Ok(response)) => Ok(holders_of(&response, &self.resource_name)),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(format!("no answer within {LIST_TIMEOUT:?}")),
        };
        let mut last_ok = self.last_ok.lock().unwrap_or_else(|p| p.into_inner());
        match outcome {
            Ok(holders) => {
                if *last_ok == Some(false) {
                    tracing::info!(socket = %self.socket.display(), "pod attribution works again");
                }
                *last_ok = Some(true);
                holders
            }
            Err(err) => {
                if *last_ok != Some(false) {
                    tracing::warn!(
                        socket = %self.socket.display(),
                        error = %err,
                        "cannot list pod resources; EFA counters carry no pod labels"
                    );
                }
                *last_ok = Some(false);
                Holders::new()
            }
        }
    }

    async fn list(&self) -> Result<ListPodResourcesResponse, String> {
        let channel = uds::dial(&self.socket)
            .await
            .map_err(|err| format!("connecting: {err}"))?;
        PodResourcesListerClient::new(channel)
            .list(ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| format!("List: {}", status.message()))
    }
}

/// Maps device ids of `resource_name` to their holders; every replica of a shared device
/// counts for the device.
pub(crate) fn holders_of(response: &ListPodResourcesResponse, resource_name: &str) -> Holders {
    let mut holders = Holders::new();
    for pod in &response.pod_resources {
        for container in &pod.containers {
            let ids = container
                .devices
                .iter()
                .filter(|d| d.resource_name == resource_name)
                .flat_map(|d| &d.device_ids);
            for id in ids {
                let device = sharing::device_of(id);
                holders.entry(device.to_owned()).or_default().push(Holder {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                });
            }
        }
    }
    for list in holders.values_mut() {
        list.sort();
        list.dedup();
    }
    holders
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::pod_resources_stub::pod;

    const EFA: &str = "vpc.amazonaws.com/efa";

    #[test]
    fn maps_our_devices_and_shared_ids_to_their_holders() {
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ml", "trainer-0", "main", EFA, &["0000:10:1b.0"]),
                pod(
                    "ml",
                    "gpu-only",
                    "main",
                    "nvidia.com/gpu",
                    &["0000:90:1b.0"],
                ),
                pod("ml", "sidecar", "probe", EFA, &["0000:20:1b.0::1"]),
                pod("ml", "other", "probe", EFA, &["0000:20:1b.0::0"]),
            ],
        };
        let holders = holders_of(&response, EFA);
        assert_eq!(holders.len(), 2, "{holders:?}");
        assert_eq!(
            holders["0000:10:1b.0"],
            [Holder {
                namespace: "ml".into(),
                pod: "trainer-0".into(),
                container: "main".into()
            }]
        );
        let shared: Vec<&str> = holders["0000:20:1b.0"]
            .iter()
            .map(|h| h.pod.as_str())
            .collect();
        assert_eq!(shared, ["other", "sidecar"]);
    }
}
