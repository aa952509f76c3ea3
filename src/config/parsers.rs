//! The parsers of the settings table: each turns a setting's text, from whichever source, into
//! its value or one line saying what is wrong with it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;
use clap::builder::PossibleValue;
use serde::Serialize;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;

use super::resource_name::is_dns_subdomain;
use crate::allocation::sharing::{Sharing, parse_replicas};
use crate::proto::deviceplugin::{KUBELET_SOCKET, PLUGIN_SOCKET};

/// A path that must be given: an empty one would resolve against the working directory
/// (`--cdi-spec-dir ''` wrote the spec there) or never work (`--device-plugin-dir ''`).
pub(super) fn parse_path(text: &str) -> Result<PathBuf, String> {
    if text.trim().is_empty() {
        return Err("must not be empty: give a path".to_owned());
    }
    Ok(PathBuf::from(text))
}

pub(super) fn parse_optional_path(text: &str) -> Result<Option<PathBuf>, String> {
    Ok(Some(text.trim())
        .filter(|t| !t.is_empty())
        .map(PathBuf::from))
}

/// A log level or filter directives, e.g. `info,efa_device_plugin=debug`: read as the logger
/// reads them, so a bad one is refused with the other settings, naming where it came from.
#[derive(Serialize, Clone, PartialEq, Eq)]
#[serde(transparent)]
pub struct LogLevel(String);

impl LogLevel {
    /// Each directive must name its level. The logger reads a bare word that is no level as a
    /// target to log at every level, and an empty text as no directive at all: `warnn` or an
    /// empty variable would start a plugin that logs nothing.
    ///
    /// The logger keeps the spaces around a directive, so ` info` is a target named " info"
    /// and the plugin logs nothing. Lists elsewhere in the settings may be written with spaces
    /// after their commas, so the directives are trimmed here, once, and the trimmed text is
    /// what is stored, shown by `config` and read by the logger. A space left inside one would
    /// still be read as part of a name, so it is refused.
    pub(super) fn parse(text: &str) -> Result<Self, String> {
        let invalid = |why: String| format!("invalid log level {text:?}: {why}");
        // Split as the logger splits them.
        let directives: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .collect();
        if let Some(spaced) = directives.iter().find(|d| d.contains(char::is_whitespace)) {
            return Err(invalid(format!(
                "{spaced:?} has a space inside, which the logger would read as part of a target \
                 or level (write e.g. efa_device_plugin=debug)"
            )));
        }
        let directives_text = directives.join(",");
        EnvFilter::try_new(&directives_text).map_err(|err| invalid(err.to_string()))?;
        let unnamed = if directives.is_empty() {
            Some(text)
        } else {
            directives.into_iter().find(|d| !names_a_level(d))
        };
        if let Some(directive) = unnamed {
            return Err(invalid(format!(
                "{directive:?} names no level (use error, warn, info, debug, trace or off, or \
                 TARGET=LEVEL directives, e.g. warn,efa_device_plugin=debug)"
            )));
        }
        Ok(LogLevel(directives_text))
    }

    /// The logger's filter; [`LogLevel::parse`] has read these directives already, so none is
    /// dropped.
    pub fn filter(&self) -> EnvFilter {
        EnvFilter::new(&self.0)
    }
}

impl std::fmt::Debug for LogLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Whether a directive ends in its level: `info`, or `efa_device_plugin=debug` (the last `=`,
/// as a span's field may hold one). The logger reads an empty level as trace, so it names none.
fn names_a_level(directive: &str) -> bool {
    let level = directive
        .rsplit_once('=')
        .map_or(directive, |(_, level)| level);
    !level.is_empty() && level.parse::<LevelFilter>().is_ok()
}

pub(super) fn parse_sharing(text: &str) -> Result<Sharing, String> {
    parse_replicas(text).map(Sharing::replicas)
}

pub(super) fn choices<E: ValueEnum>() -> Vec<PossibleValue> {
    E::value_variants()
        .iter()
        .filter_map(ValueEnum::to_possible_value)
        .collect()
}

/// One of an enum's words, e.g. `text` or `json`.
pub(super) fn parse_choice<E: ValueEnum>(text: &str) -> Result<E, String> {
    E::from_str(text, false).map_err(|_| {
        let choices = choices::<E>();
        let names: Vec<&str> = choices.iter().map(PossibleValue::get_name).collect();
        format!("invalid value {text:?}: use {}", names.join(" or "))
    })
}

/// The shortest rescan interval: a full pass over a 256-EFA node takes a few milliseconds, so
/// anything shorter would keep a core busy rescanning.
pub(super) const MIN_RESCAN_INTERVAL: Duration = Duration::from_millis(100);

/// The longest rescan interval. It is also the pause before a failed file write is retried
/// and a changed one healed, and the DRA guard's fallback look: an hour is already late for
/// each. Far longer ones overflow the runtime's clock (`200000000000y` panicked at the first
/// probe).
pub(super) const MAX_RESCAN_INTERVAL: Duration = Duration::from_secs(3600);

/// Parses a duration such as `500ms` or `2s`; below [`MIN_RESCAN_INTERVAL`] is refused because
/// it would spin, above [`MAX_RESCAN_INTERVAL`] because nothing would be noticed.
pub(super) fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|err| format!("invalid duration {text:?}: {err} (use e.g. 500ms, 2s, 1m)"))?;
    let bound = |what: &str, limit: Duration| {
        Err(format!(
            "invalid duration {text:?}: must be at {what} {}",
            humantime::format_duration(limit)
        ))
    };
    if d < MIN_RESCAN_INTERVAL {
        return bound("least", MIN_RESCAN_INTERVAL);
    }
    if d > MAX_RESCAN_INTERVAL {
        return bound("most", MAX_RESCAN_INTERVAL);
    }
    Ok(d)
}

/// `host:port`, or empty for no endpoint. Only an IP literal: resolving a name would make start-up
/// depend on DNS.
pub(super) fn parse_metrics_address(text: &str) -> Result<Option<SocketAddr>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| {
        format!("invalid address {text:?}: use IP:PORT, e.g. 0.0.0.0:9465, or \"\" to disable")
    })
}

/// The longest DRA driver name the Kubernetes API accepts (`DriverNameMaxLength`, as for CSI).
const MAX_DRIVER_NAME: usize = 63;

/// The suffix of the socket a DRA driver registers with in `plugins_registry`.
const REGISTRATION_SOCKET: &str = "-reg.sock";

/// Comma-separated driver names, e.g. `dra.net,efa.example.com`. The guard finds a driver by
/// its registration socket, `<driver>-reg.sock`, comparing names exactly, and the API allows
/// only lowercase DNS subdomains: any other name (`DRA.NET`, `dra.net.`, or the socket's own
/// name) would never match, and the guard would be off without saying so. An empty list is
/// judged with `--allow-dra-coexistence`, in [`super::settings_from`].
pub(super) fn parse_driver_names(text: &str) -> Result<Vec<String>, String> {
    let names = comma_list(text);
    for name in &names {
        let problem = if name.ends_with(REGISTRATION_SOCKET) {
            "that is a registration socket's name (<driver>-reg.sock); give the driver's name, \
             e.g. dra.net"
        } else if name.len() > MAX_DRIVER_NAME || !is_dns_subdomain(name) {
            "a DRA driver's name is a lowercase DNS subdomain of at most 63 characters, e.g. \
             dra.net; the guard matches it exactly against the registration sockets"
        } else {
            continue;
        };
        return Err(format!("invalid driver name {name:?}: {problem}"));
    }
    Ok(names)
}

/// The non-empty, trimmed items of a comma-separated list.
fn comma_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Comma-separated file names inside the device-plugin dir, e.g. `aws-efa-device-plugin.sock`.
/// Neither the kubelet's socket nor this plugin's own is another plugin: listed, the plugin
/// would take the kubelet (always accepting) or itself for a competitor and stand down for good
/// once the kubelet ends its stream.
pub(super) fn parse_socket_names(text: &str) -> Result<Vec<String>, String> {
    let names = comma_list(text);
    for name in &names {
        let problem = if name.contains('/') || name == "." || name == ".." {
            "a file name in the device-plugin dir, without '/'"
        } else if name == KUBELET_SOCKET {
            "that is the kubelet's registration socket, not a competing plugin's"
        } else if name == PLUGIN_SOCKET {
            "that is this plugin's own socket, not a competing plugin's"
        } else {
            continue;
        };
        return Err(format!("invalid socket name {name:?}: {problem}"));
    }
    Ok(names)
}

/// Where device nodes live, on the host as in a container: `--extra-device-nodes` names nodes
/// below it, found on the host under `--dev-root`.
const DEVICE_DIR: &str = "/dev/";

/// Comma-separated device node paths below /dev, e.g. `/dev/gdrdrv`. Each is the path in the
/// container and, below `--dev-root`, on the host. `/dev/infiniband` is refused: its nodes are
/// the EFAs', handed out one by one, and any other there makes libfabric's EFA provider fail.
pub(super) fn parse_device_nodes(text: &str) -> Result<Vec<String>, String> {
    let nodes = comma_list(text);
    for node in &nodes {
        let below = node.strip_prefix(DEVICE_DIR).unwrap_or_default();
        let parts: Vec<&str> = below.split('/').collect();
        if below.is_empty()
            || parts
                .iter()
                .any(|p| p.is_empty() || *p == "." || *p == "..")
        {
            return Err(format!(
                "invalid device node {node:?}: give a path below {DEVICE_DIR}, e.g. /dev/gdrdrv"
            ));
        }
        if parts[0] == "infiniband" {
            return Err(format!(
                "invalid device node {node:?}: the plugin hands out /dev/infiniband's nodes per EFA"
            ));
        }
    }
    Ok(nodes)
}

/// Where `node`, one of `--extra-device-nodes`, is on the host when its /dev is at `dev_root`.
pub fn device_node_under(dev_root: &Path, node: &str) -> PathBuf {
    dev_root.join(node.strip_prefix(DEVICE_DIR).unwrap_or(node))
}

pub(super) fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("invalid value {text:?}: use true or false")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_level_must_name_a_level_in_every_directive() {
        for text in [
            "info",
            "WARN",
            "off",
            "warn,efa_device_plugin=debug",
            "efa_device_plugin=trace",
            "efa_device_plugin::health=debug,h2=off",
            "warn,efa_device_plugin[scan{id=efa_0}]=trace",
        ] {
            assert!(LogLevel::parse(text).is_ok(), "{text}");
        }
        for (text, unnamed) in [
            // A mistyped level is read as a target: nothing at all would be logged.
            ("warnn", "warnn"),
            ("foo", "foo"),
            ("info,debugg", "debugg"),
            ("efa_device_plugin=", "efa_device_plugin="),
            ("efa_device_plugin[scan]", "efa_device_plugin[scan]"),
            ("", ""),
        ] {
            let err = LogLevel::parse(text).unwrap_err();
            assert!(
                err.starts_with(&format!(
                    "invalid log level {text:?}: {unnamed:?} names no level (use error, warn"
                )),
                "{text}: {err}"
            );
        }
    }

    /// The logger keeps the spaces around a directive: ` info` was a target named " info", and
    /// the plugin logged nothing at all.
    #[test]
    fn a_log_level_is_stored_as_the_logger_reads_it_trimmed_once() {
        for (text, stored) in [
            (" info", "info"),
            ("info ", "info"),
            (
                "\twarn , efa_device_plugin=debug ,",
                "warn,efa_device_plugin=debug",
            ),
        ] {
            assert_eq!(LogLevel::parse(text).map(|l| l.0), Ok(stored.to_owned()));
        }
        for (text, spaced) in [
            ("efa_device_plugin =debug", "efa_device_plugin =debug"),
            ("warn,efa_device_plugin= debug", "efa_device_plugin= debug"),
            ("info debug", "info debug"),
        ] {
            let err = LogLevel::parse(text).unwrap_err();
            assert!(
                err.starts_with(&format!(
                    "invalid log level {text:?}: {spaced:?} has a space inside"
                )),
                "{text}: {err}"
            );
        }
        assert!(
            LogLevel::parse(" , ")
                .unwrap_err()
                .contains("names no level")
        );
    }

    /// The guard compares names exactly with the registration sockets' (`<driver>-reg.sock`):
    /// `DRA.NET`, `dra.net.` or the socket's own name never matched, and the guard was off.
    #[test]
    fn driver_names_are_names_the_guard_can_match() {
        let longest = format!("{}.io", "a".repeat(60));
        for good in [
            "dra.net",
            "dra.networking.k8s.aws",
            "efa-dra.example.com",
            &longest,
        ] {
            assert_eq!(parse_driver_names(good), Ok(vec![good.to_owned()]));
        }
        assert_eq!(
            parse_driver_names(" dra.net, efa.example.com ,"),
            Ok(vec!["dra.net".to_owned(), "efa.example.com".to_owned()])
        );
        let too_long = format!("{}.io", "a".repeat(61));
        for bad in [
            "DRA.NET",
            "dra.net.",
            ".dra.net",
            "dra..net",
            "dra_net",
            "dra.net/efa",
            "-dra.net",
            too_long.as_str(),
        ] {
            let err = parse_driver_names(bad).unwrap_err();
            assert_eq!(
                err,
                format!(
                    "invalid driver name {bad:?}: a DRA driver's name is a lowercase DNS \
                     subdomain of at most 63 characters, e.g. dra.net; the guard matches it \
                     exactly against the registration sockets"
                )
            );
        }
        for socket in ["dra.net-reg.sock", "dra.net-6b1c0e2f-reg.sock"] {
            let err = parse_driver_names(socket).unwrap_err();
            assert!(
                err.contains("that is a registration socket's name"),
                "{socket}: {err}"
            );
        }
        // Empty is judged with --allow-dra-coexistence, which the parser cannot see.
        assert_eq!(parse_driver_names(""), Ok(vec![]));
    }

    #[test]
    fn intervals_parse_like_the_docs_say() {
        assert_eq!(parse_interval("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_interval("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_interval("0s").is_err());
        assert!(parse_interval("1ns").is_err());
        assert!(parse_interval("99ms").is_err());
        assert_eq!(parse_interval("100ms"), Ok(MIN_RESCAN_INTERVAL));
        assert!(parse_interval("fast").is_err());
        assert!(parse_interval("").is_err());
        assert_eq!(parse_interval("1h"), Ok(MAX_RESCAN_INTERVAL));
        for huge in ["61m", "200000000000y", "500000000000y"] {
            let err = parse_interval(huge).unwrap_err();
            assert!(err.contains("at most 1h"), "{huge}: {err}");
        }
    }
}
