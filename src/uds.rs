//! gRPC over Unix sockets: the only transport the kubelet speaks to device plugins.

use std::io;
use std::path::{Path, PathBuf};

use std::convert::Infallible;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::server::NamedService;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::{Service, service_fn};

/// Opens a channel to the gRPC server on `path`. The `:authority` is `localhost`, as the
/// kubelet sends it.
pub async fn dial(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Binds a listening socket at `path`, replacing a stale socket file left by an earlier run.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    UnixListener::bind(path)
}

/// Serves one gRPC service on `listener` until `stop` is cancelled; the task yields the server's
/// own error, if any.
pub fn spawn_server<S>(
    listener: UnixListener,
    service: S,
    stop: CancellationToken,
) -> JoinHandle<Result<(), tonic::transport::Error>>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                stop.cancelled_owned(),
            ),
    )
}

/// Identity of a directory entry: a deleted and re-created socket differs even when the
/// filesystem hands out the same inode number again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

pub fn identity(path: &Path) -> Option<FileIdentity> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).ok()?;
    Some(FileIdentity {
        ino: meta.ino(),
        ctime: meta.ctime(),
        ctime_nsec: meta.ctime_nsec(),
    })
}
