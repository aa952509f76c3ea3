//! gRPC over Unix sockets: the only transport the kubelet speaks to device plugins.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use std::convert::Infallible;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::server::NamedService;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::{Service, service_fn};

use crate::backoff::Backoff;

/// Opens a channel to the gRPC server on `path`. The `:authority` is `localhost`, as the
/// kubelet sends it.
pub async fn dial(path: &Path) -> Result<Channel, tonic::transport::Error> {
    dial_patiently(path, Duration::ZERO).await
}

/// [`dial`], but a refused connect is retried for up to `patience`, after 1 ms and then at
/// growing intervals up to [`REFUSED_RETRY`]: a server's socket file appears at `bind()`, a
/// moment before it listens, and whoever reacts to the file's creation connects into that gap.
pub(crate) async fn dial_patiently(
    path: &Path,
    patience: Duration,
) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(service_fn(move |_: Uri| {
            let path = path.clone();
            let deadline = Instant::now() + patience;
            async move {
                let mut retry = Backoff::new(Duration::from_millis(1), REFUSED_RETRY);
                loop {
                    match UnixStream::connect(&path).await {
                        Err(err)
                            if err.kind() == io::ErrorKind::ConnectionRefused
                                && Instant::now() < deadline =>
                        {
                            tokio::time::sleep(retry.next_pause()).await;
                        }
                        connected => return connected.map(TokioIo::new),
                    }
                }
            }
        }))
        .await
}

/// The longest pause between [`dial_patiently`]'s retries of a refused connect.
pub(crate) const REFUSED_RETRY: Duration = Duration::from_millis(10);

/// Binds a listening socket at `path`, replacing a stale socket file left by an earlier run.
/// The socket file is 0600 whatever the umask: only its owner (and root) may connect.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    listen(bind_unlistened(path)?)
}

/// Binds a socket at `path` that does not listen yet, so connects to it are refused, as they
/// are between a server's `bind()` and `listen()`. [`listen`] completes it.
pub(crate) fn bind_unlistened(path: &Path) -> io::Result<OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr};
    use nix::sys::stat::{Mode, fchmod};
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    let socket = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    // Linux creates the file with the socket inode's mode less the umask. Narrowing the inode
    // before bind() makes the file 0600 from its first instant, without touching the
    // process-wide umask that other threads' files depend on.
    fchmod(&socket, Mode::S_IRUSR | Mode::S_IWUSR)?;
    nix::sys::socket::bind(socket.as_raw_fd(), &UnixAddr::new(path)?)?;
    Ok(socket)
}

/// Starts listening on a socket from [`bind_unlistened`].
pub(crate) fn listen(socket: OwnedFd) -> io::Result<UnixListener> {
    nix::sys::socket::listen(&socket, nix::sys::socket::Backlog::MAXCONN)?;
    UnixListener::from_std(std::os::unix::net::UnixListener::from(socket))
}

/// Which accepted connection a request came over, in every request's extensions: the kubelet
/// makes all its calls to a plugin over the one connection it dials in `Register`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionId(pub(crate) u64);

/// An accepted connection with its [`ConnectionId`].
struct Numbered {
    stream: UnixStream,
    id: ConnectionId,
}

impl Connected for Numbered {
    type ConnectInfo = ConnectionId;

    fn connect_info(&self) -> ConnectionId {
        self.id
    }
}

impl AsyncRead for Numbered {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Numbered {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Serves one gRPC service on `listener` until `stop` is cancelled; the task yields the server's
/// own error, if any. Each request carries its connection's [`ConnectionId`].
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
    let mut accepted = 0;
    let numbered = UnixListenerStream::new(listener).map(move |connection| {
        accepted += 1;
        connection.map(|stream| Numbered {
            stream,
            id: ConnectionId(accepted),
        })
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(numbered, stop.cancelled_owned()),
    )
}

/// Identity of a directory entry: a deleted and re-created socket differs even when the
/// filesystem hands out the same inode number again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

pub(crate) fn identity(path: &Path) -> Option<FileIdentity> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).ok()?;
    Some(FileIdentity {
        ino: meta.ino(),
        ctime: meta.ctime(),
        ctime_nsec: meta.ctime_nsec(),
    })
}
