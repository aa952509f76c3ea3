//! An in-process stand-in for the kubelet's PodResources endpoint, over a real Unix socket, for
//! the tests of pod attribution. Only `List` is served: it is all the plugin asks.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Response, Status};

use crate::proto::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
    pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer},
};
use crate::uds;

/// A pod with one container holding `ids` of `resource`.
pub fn pod(
    namespace: &str,
    name: &str,
    container: &str,
    resource: &str,
    ids: &[&str],
) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: namespace.into(),
        containers: vec![ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids.iter().map(|id| (*id).to_owned()).collect(),
                topology: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

pub struct PodResourcesStub {
    pods: Arc<Mutex<Vec<PodResources>>>,
    lists: Arc<AtomicUsize>,
    stall: Arc<AtomicBool>,
    refuse: Arc<Mutex<Option<Code>>>,
    stop: CancellationToken,
}

impl PodResourcesStub {
    /// Serves `pods` on `socket`. Call inside a tokio runtime.
    pub fn start(socket: &Path, pods: Vec<PodResources>) -> std::io::Result<Self> {
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let listener = uds::bind(socket)?;
        let pods = Arc::new(Mutex::new(pods));
        let lists = Arc::new(AtomicUsize::new(0));
        let stall = Arc::new(AtomicBool::new(false));
        let refuse = Arc::new(Mutex::new(None));
        let stop = CancellationToken::new();
        let service = Lister {
            pods: pods.clone(),
            lists: lists.clone(),
            stall: stall.clone(),
            refuse: refuse.clone(),
        };
        uds::spawn_server(
            listener,
            PodResourcesListerServer::new(service),
            stop.clone(),
        );
        Ok(PodResourcesStub {
            pods,
            lists,
            stall,
            refuse,
            stop,
        })
    }

    /// From now on `List` answers `pods`, as the kubelet's answer changes when pods come and go.
    pub fn serve(&self, pods: Vec<PodResources>) {
        *self.pods.lock().unwrap_or_else(|e| e.into_inner()) = pods;
    }

    /// How many `List` calls have been answered.
    pub fn lists(&self) -> usize {
        self.lists.load(Ordering::SeqCst)
    }

    /// From now on `List` hangs, as an overloaded kubelet's would.
    pub fn stall(&self) {
        self.stall.store(true, Ordering::SeqCst);
    }

    /// From now on `List` fails with `code`, as the kubelet's rate limiter answers
    /// (`RESOURCE_EXHAUSTED`, "rejected by rate limit") when asked too often.
    pub fn refuse(&self, code: Code) {
        *self.refuse.lock().unwrap() = Some(code);
    }

    /// From now on `List` answers at once again.
    pub fn recover(&self) {
        self.stall.store(false, Ordering::SeqCst);
        *self.refuse.lock().unwrap() = None;
    }
}

impl Drop for PodResourcesStub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

struct Lister {
    pods: Arc<Mutex<Vec<PodResources>>>,
    lists: Arc<AtomicUsize>,
    stall: Arc<AtomicBool>,
    refuse: Arc<Mutex<Option<Code>>>,
}

#[tonic::async_trait]
impl PodResourcesLister for Lister {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        if let Some(code) = *self.refuse.lock().unwrap() {
            return Err(Status::new(code, "rejected by rate limit"));
        }
        if self.stall.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        let pod_resources = self.pods.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.lists.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("the plugin only lists"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("the plugin only lists"))
    }
}
