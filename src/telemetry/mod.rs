//! What the plugin tells operators: logs (here), Prometheus metrics and probes.
//!
//! Logging is text or one JSON object per line, and quiet while nothing changes.

pub mod counters;
pub mod families;
pub mod fds;
pub mod http;
pub mod metrics;

use std::io::{self, IsTerminal, Write};

use clap::ValueEnum;
use serde::Serialize;
use tracing_subscriber::EnvFilter;

/// How log lines are written: `--log-format`.
#[derive(ValueEnum, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber, logging at `level`. `RUST_LOG` is no concern of it: the
/// settings read it, with `--log-level`, and have judged what `level` holds.
pub(crate) fn init_logging(format: LogFormat, level: EnvFilter) -> anyhow::Result<()> {
    // Colour codes only for a person at a terminal; in a container log they are noise.
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(level)
        .with_writer(move || Escaping {
            out: std::io::stderr(),
            keep_escape: ansi,
        })
        .with_ansi(ansi)
        .with_target(false)
        // On a write error (EPIPE from a closed stderr pipe) the subscriber would report it
        // with `eprintln!`, which panics on the same broken pipe, and the release build aborts
        // on a panic. A line that cannot be written is lost; the plugin goes on.
        .log_internal_errors(false);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    installed.map_err(|err| anyhow::anyhow!("installing the logger: {err}"))
}

/// Writes each log line with its control characters escaped (`\x0a`), so a name read from the
/// node, such as an ibdev with a newline in it, cannot forge a log line. The formatter hands
/// over one whole line per write, ending in its own newline, which is kept.
struct Escaping<W> {
    out: W,
    /// ESC starts the colour codes the formatter adds at a terminal.
    keep_escape: bool,
}

impl<W: Write> Write for Escaping<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let (line, end) = match buf.strip_suffix(b"\n") {
            Some(line) => (line, &b"\n"[..]),
            None => (buf, &b""[..]),
        };
        let mut escaped = Vec::with_capacity(buf.len());
        for &byte in line {
            let control = byte.is_ascii_control() && byte != b'\t';
            if control && !(self.keep_escape && byte == 0x1b) {
                write!(escaped, "\\x{byte:02x}")?;
            } else {
                escaped.push(byte);
            }
        }
        escaped.extend_from_slice(end);
        self.out.write_all(&escaped)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_cannot_start_a_new_log_line() {
        let mut line = Escaping {
            out: Vec::new(),
            keep_escape: false,
        };
        line.write_all(b"INFO device found ibdev=efa_0\nERROR forged\r\x1b[2K\tx\n")
            .unwrap();
        assert_eq!(
            String::from_utf8(line.out).unwrap(),
            "INFO device found ibdev=efa_0\\x0aERROR forged\\x0d\\x1b[2K\tx\n"
        );
    }
}
