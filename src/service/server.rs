//! The generation's gRPC server. ListAndWatch is answered here, over a body of our own, from
//! one encoded frame per snapshot that every stream shares; the other methods go to the
//! generated server for [`PluginService`].

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use hyper::body::Frame;
use prost::bytes::{BufMut, Bytes, BytesMut};
use tokio_stream::Stream;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;

use super::{PluginService, StreamHooks, advertised, encoded_len};
use crate::allocation::sharing::Sharing;
use crate::proto::deviceplugin::device_plugin_server::{DevicePluginServer, SERVICE_NAME};
use crate::state::Inventory;
use crate::uds::ConnectionId;

/// Counts a stream as open while alive, and reports how the kubelet's stream ended.
struct StreamGuard {
    hooks: Arc<StreamHooks>,
    stop: CancellationToken,
    kubelets: bool,
}

impl StreamGuard {
    fn new(
        hooks: Arc<StreamHooks>,
        stop: CancellationToken,
        connection: Option<ConnectionId>,
    ) -> Self {
        hooks.open.send_modify(|n| *n += 1);
        let kubelets = hooks.claim_kubelet_stream(connection);
        StreamGuard {
            hooks,
            stop,
            kubelets,
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.hooks.open.send_modify(|n| *n -= 1);
        if self.kubelets && !self.stop.is_cancelled() {
            self.hooks.ended_by_kubelet.notify_one();
        }
    }
}

/// The device list of `inventory` as one gRPC message frame: the compression flag, the length,
/// then the `ListAndWatchResponse` itself.
fn encode_frame(inventory: &Inventory, sharing: Sharing) -> Bytes {
    let len = encoded_len(advertised(inventory, sharing));
    let mut frame = BytesMut::with_capacity(GRPC_HEADER + len);
    frame.put_u8(0);
    // The kubelet's limit is far below 4 GiB, which start-up checks.
    frame.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    for device in advertised(inventory, sharing) {
        prost::encoding::message::encode(1, &device, &mut frame);
    }
    frame.freeze()
}

/// A gRPC message's prefix: a compression flag and a 4-byte length.
const GRPC_HEADER: usize = 5;

/// ListAndWatch streams served at once, not counting the kubelet's, which is always accepted.
/// The kubelet opens one per registration; the rest leaves room for a debugging tool or two,
/// while a client opening streams in a loop gets [`Status::resource_exhausted`] instead of
/// the plugin's memory.
const MAX_STREAMS: usize = 8;

const LIST_AND_WATCH: &str = "/v1beta1.DevicePlugin/ListAndWatch";

/// The device list of the latest snapshot, encoded once for every stream of the generation.
struct Lists {
    sharing: Sharing,
    latest: Mutex<Option<(Arc<Inventory>, Bytes)>>,
}

impl Lists {
    /// The frame for `inventory`. A snapshot whose list did not change keeps the frame it had,
    /// so a stream can tell by identity alone that it has nothing new to send.
    fn frame(&self, inventory: &Arc<Inventory>) -> Bytes {
        let mut latest = self.latest.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seen, frame)) = latest.as_ref()
            && Arc::ptr_eq(seen, inventory)
        {
            return frame.clone();
        }
        let mut frame = encode_frame(inventory, self.sharing);
        if let Some((_, unchanged)) = latest.take().filter(|(_, old)| *old == frame) {
            frame = unchanged;
        }
        *latest = Some((inventory.clone(), frame.clone()));
        frame
    }
}

/// The generation's gRPC service: ListAndWatch answered here, from frames shared by every
/// stream (each holds a reference, not a copy, however many are open or slow to read), the
/// other methods by the generated server.
#[derive(Clone)]
pub(crate) struct PluginServer {
    service: Arc<PluginService>,
    lists: Arc<Lists>,
    grpc: DevicePluginServer<PluginService>,
}

impl NamedService for PluginServer {
    const NAME: &'static str = SERVICE_NAME;
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send + 'static>>;

impl tower::Service<http::Request<Body>> for PluginServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> ResponseFuture {
        if request.uri().path() != LIST_AND_WATCH {
            return self.grpc.call(request);
        }
        let opened = self.open_stream(request.extensions().get::<ConnectionId>().copied());
        Box::pin(async move {
            // The request is an `Empty`; read it to its end, as a unary server would, before
            // answering.
            let _ = http_body_util::BodyExt::collect(http_body_util::Limited::new(
                request.into_body(),
                1024,
            ))
            .await;
            Ok(match opened {
                Ok(list) => {
                    let mut response = http::Response::new(Body::new(list));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/grpc"),
                    );
                    response
                }
                Err(status) => status.into_http(),
            })
        })
    }
}

impl PluginServer {
    pub(crate) fn new(service: PluginService) -> PluginServer {
        let service = Arc::new(service);
        PluginServer {
            lists: Arc::new(Lists {
                sharing: service.allocator.sharing(),
                latest: Mutex::default(),
            }),
            grpc: DevicePluginServer::from_arc(service.clone()),
            service,
        }
    }

    fn open_stream(&self, connection: Option<ConnectionId>) -> Result<ListBody, Status> {
        let service = &self.service;
        let hooks = &service.hooks;
        let others = hooks
            .open
            .borrow()
            .saturating_sub(usize::from(*hooks.kubelet_stream.borrow()));
        let guard = StreamGuard::new(hooks.clone(), service.stop.clone(), connection);
        if !guard.kubelets && others >= MAX_STREAMS {
            return Err(Status::resource_exhausted(format!(
                "at most {MAX_STREAMS} ListAndWatch streams are served at once; close one first"
            )));
        }
        Ok(ListBody {
            devices: WatchStream::new(service.devices.subscribe()),
            lists: self.lists.clone(),
            sent: None,
            stopped: Box::pin(service.stop.clone().cancelled_owned()),
            ended: false,
            _guard: guard,
        })
    }
}

/// One ListAndWatch stream: the full list at once and after every change, until the generation
/// stops (then `OK`) or the client goes (then hyper drops it, and the guard counts it closed).
struct ListBody {
    devices: WatchStream<Arc<Inventory>>,
    lists: Arc<Lists>,
    /// The frame last sent, compared by identity.
    sent: Option<Bytes>,
    stopped: Pin<Box<WaitForCancellationFutureOwned>>,
    ended: bool,
    _guard: StreamGuard,
}

impl hyper::body::Body for ListBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        loop {
            let inventory = match this.stopped.as_mut().poll(cx) {
                Poll::Ready(()) => None,
                Poll::Pending => match Pin::new(&mut this.devices).poll_next(cx) {
                    Poll::Ready(next) => next,
                    Poll::Pending => return Poll::Pending,
                },
            };
            let Some(inventory) = inventory else {
                this.ended = true;
                let mut trailers = http::HeaderMap::new();
                trailers.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("0"));
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            };
            let frame = this.lists.frame(&inventory);
            if this.sent.as_ref().is_some_and(|sent| same(sent, &frame)) {
                continue;
            }
            this.sent = Some(frame.clone());
            return Poll::Ready(Some(Ok(Frame::data(frame))));
        }
    }
}

/// Whether two frames are one and the same, not merely equal.
fn same(a: &Bytes, b: &Bytes) -> bool {
    a.as_ptr() == b.as_ptr() && a.len() == b.len()
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::allocation::sharing::shared;
    use crate::proto::deviceplugin::ListAndWatchResponse;
    use crate::testkit::simulate::{Shape, inventory};

    #[test]
    fn every_stream_gets_the_same_frame_until_the_list_changes() {
        let lists = Lists {
            sharing: shared(4),
            latest: Mutex::default(),
        };
        let first = Arc::new(inventory(Shape::P5));
        let frame = lists.frame(&first);
        assert!(same(&frame, &lists.frame(&first)));
        // A new snapshot with the same list keeps the frame; a changed one gets its own.
        assert!(same(&frame, &lists.frame(&Arc::new(inventory(Shape::P5)))));
        let changed = lists.frame(&Arc::new(inventory(Shape::P4d)));
        assert!(!same(&frame, &changed));
        let decoded = ListAndWatchResponse::decode(&changed[GRPC_HEADER..]).unwrap();
        assert_eq!(decoded.devices.len(), 4 * 4);
        assert_eq!(
            changed.len() - GRPC_HEADER,
            u32::from_be_bytes(changed[1..5].try_into().unwrap()) as usize
        );
    }
}
