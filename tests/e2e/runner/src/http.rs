//! A plain HTTP GET, as the bash suites used curl: the kubelet's read-only port and the plugin's
//! metrics, on loopback or at a pod's IP.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

const TIMEOUT: Duration = Duration::from_secs(5);

/// The body of `GET path` on `127.0.0.1:port`, if the answer is 200. HTTP/1.0, so the server
/// closes the connection after a body that is never chunked.
pub fn get(port: u16, path: &str) -> Result<String> {
    get_at(IpAddr::V4(Ipv4Addr::LOCALHOST), port, path)
}

/// [`get`] on `ip:port`.
pub fn get_at(ip: IpAddr, port: u16, path: &str) -> Result<String> {
    let (status, body) = exchange(ip, port, path)?;
    if code(&status) != "200" {
        bail!("GET {}{path}: {status}", SocketAddr::new(ip, port));
    }
    Ok(body)
}

/// The status code of the answer to `GET path` on `ip:port` (`200`, `503`).
pub fn status_at(ip: IpAddr, port: u16, path: &str) -> Result<String> {
    let (status, _) = exchange(ip, port, path)?;
    Ok(code(&status).to_owned())
}

fn code(status: &str) -> &str {
    status.split_whitespace().nth(1).unwrap_or_default()
}

/// The status line and the body of the answer to `GET path` on `ip:port`.
fn exchange(ip: IpAddr, port: u16, path: &str) -> Result<(String, String)> {
    let addr = SocketAddr::new(ip, port);
    let mut stream =
        TcpStream::connect_timeout(&addr, TIMEOUT).with_context(|| format!("connect to {addr}"))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .with_context(|| format!("read the answer to GET {addr}{path}"))?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {addr}{path}: no end of headers"))?;
    let status = head.lines().next().unwrap_or_default();
    Ok((status.to_owned(), body.to_owned()))
}
