//! The HTTP endpoint: `/metrics`, `/healthz` and `/readyz`, on plain HTTP/1.1.
//!
//! hyper alone serves three fixed paths; a router framework would add more to the binary than
//! the endpoint has code.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{Either, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::fds::MAX_CONNECTIONS;
use super::metrics::{self, Metrics, ScrapeBody};
use crate::health::ScanStats;
use crate::state::{PluginStatus, StatusReader};

/// A client that has not sent a whole request head this long after connecting, or after its
/// last answer on a kept-alive connection, is dropped: idle or stuck clients cannot hold a
/// connection slot for long.
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// Every connection ends by then, whatever it is doing: a request is answered in milliseconds,
/// and a client trickling its request or reading its answer slowly gives the slot back.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);

/// hyper's smallest read buffer: request heads of the three paths fit many times over.
const READ_BUFFER: usize = 8192;

pub struct Endpoint {
    pub metrics: Metrics,
    pub status: StatusReader,
    /// Cancelled once the plugin's serving loop has ended.
    pub stopped: CancellationToken,
    pub scans: Arc<ScanStats>,
}

/// Why the plugin is not ready, if it is not: the kubelet must hold a registration and an open
/// ListAndWatch stream, or it cannot see the devices. A competing plugin is named, as the likely
/// reason the kubelet holds no stream of ours.
pub(crate) fn readiness(status: &PluginStatus) -> Result<(), String> {
    let why = if !status.registered {
        "not registered with the kubelet"
    } else if status.open_streams == 0 {
        "registered, but the kubelet has no ListAndWatch stream open"
    } else {
        return Ok(());
    };
    Err(match &status.competitor {
        Some(socket) => format!(
            "{why}: the competing device plugin {socket} serves the resource; uninstall one of them"
        ),
        None => why.to_owned(),
    })
}

/// A fixed text, or a scrape written as it is sent.
type Answer = Either<Full<Bytes>, ScrapeBody>;

impl Endpoint {
    async fn respond(&self, request: &Request<Incoming>) -> Response<Answer> {
        match request.uri().path() {
            "/metrics" => {
                let body = Either::Right(self.metrics.scrape().await);
                reply(StatusCode::OK, metrics::CONTENT_TYPE, body)
            }
            "/healthz" if self.stopped.is_cancelled() => {
                plain(StatusCode::SERVICE_UNAVAILABLE, "the plugin is stopping")
            }
            "/healthz" => match self.scans.liveness() {
                Ok(()) => plain(StatusCode::OK, "ok"),
                Err(reason) => plain(StatusCode::SERVICE_UNAVAILABLE, &reason),
            },
            "/readyz" => match readiness(&self.status.current()) {
                Ok(()) => plain(StatusCode::OK, "ok"),
                Err(reason) => plain(StatusCode::SERVICE_UNAVAILABLE, &reason),
            },
            _ => plain(
                StatusCode::NOT_FOUND,
                "not found; try /metrics, /healthz or /readyz",
            ),
        }
    }
}

fn plain(status: StatusCode, text: &str) -> Response<Answer> {
    let body = Either::Left(Full::new(Bytes::from(format!("{text}\n"))));
    reply(status, "text/plain; charset=utf-8", body)
}

fn reply(status: StatusCode, content_type: &'static str, body: Answer) -> Response<Answer> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, content_type.parse().expect("static header"));
    response
}

/// Serves until `shutdown`; open connections are dropped then.
pub async fn serve(listener: TcpListener, endpoint: Arc<Endpoint>, shutdown: CancellationToken) {
    let mut connections = JoinSet::new();
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            Some(ended) = connections.join_next(), if !connections.is_empty() => {
                if let Err(err) = ended {
                    tracing::error!(error = %err, "a metrics connection failed");
                }
            }
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(err) => {
                        // Out of descriptors, most likely: wait instead of spinning on it.
                        tracing::debug!(error = %err, "accepting a metrics connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                // Over the cap the stream is dropped here, closing it at once.
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    continue;
                };
                let endpoint = endpoint.clone();
                connections.spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let endpoint = endpoint.clone();
                        async move { Ok::<_, Infallible>(endpoint.respond(&request).await) }
                    });
                    let connection = http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(HEADER_TIMEOUT)
                        .max_buf_size(READ_BUFFER)
                        .serve_connection(TokioIo::new(stream), service);
                    let _ = tokio::time::timeout(CONNECTION_DEADLINE, connection).await;
                    drop(slot);
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_registered_with_a_stream_open() {
        let mut status = PluginStatus::default();
        assert_eq!(
            readiness(&status),
            Err("not registered with the kubelet".to_owned())
        );
        status.competitor = Some("aws-efa-device-plugin.sock".into());
        assert!(
            readiness(&status)
                .unwrap_err()
                .contains("competing device plugin aws-efa-device-plugin.sock")
        );
        status.competitor = None;
        status.registered = true;
        assert!(readiness(&status).unwrap_err().contains("ListAndWatch"));
        status.open_streams = 1;
        assert_eq!(readiness(&status), Ok(()));
        status.registered = false;
        assert!(readiness(&status).is_err());
    }
}
