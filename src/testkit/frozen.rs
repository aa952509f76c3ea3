//! A plugin that froze: its socket still listens but it never accepts, so once its backlog is
//! full a blocking connect hangs and a non-blocking one fails with `EAGAIN`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, connect, listen, socket,
};

/// Listens at `path` and fills the backlog; the socket stays frozen while this is alive.
pub struct FrozenSocket {
    _listener: OwnedFd,
    _queued: Vec<OwnedFd>,
}

fn unix_socket() -> io::Result<OwnedFd> {
    Ok(socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

impl FrozenSocket {
    pub fn bind(path: &Path) -> io::Result<Self> {
        let listener = unix_socket()?;
        let address = UnixAddr::new(path)?;
        bind(listener.as_raw_fd(), &address)?;
        // The smallest backlog: Linux then queues one connection before refusing the next.
        listen(&listener, Backlog::new(0)?)?;
        let mut queued = Vec::new();
        loop {
            let client = unix_socket()?;
            match connect(client.as_raw_fd(), &address) {
                Ok(()) => queued.push(client),
                Err(Errno::EAGAIN) => break,
                Err(err) => return Err(err.into()),
            }
        }
        Ok(FrozenSocket {
            _listener: listener,
            _queued: queued,
        })
    }
}
