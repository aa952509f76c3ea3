//! What the plugin tells operators: logs (here), Prometheus metrics and probes.
//!
//! Logging is text or one JSON object per line, and quiet while nothing changes.

pub mod counters;
pub mod fds;
pub mod http;
pub mod metrics;
pub mod pod_resources;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. `RUST_LOG`, when set, overrides `level`.
pub fn init_logging(format: LogFormat, level: &str) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => {
            EnvFilter::try_new(directives).map_err(|err| anyhow::anyhow!("RUST_LOG: {err}"))?
        }
        _ => EnvFilter::try_new(level).map_err(|err| anyhow::anyhow!("--log-level: {err}"))?,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal; in a container log they are noise.
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    installed.map_err(|err| anyhow::anyhow!("installing the logger: {err}"))
}
