//! `efa-device-plugin list`: the node's EFAs as the plugin judges them, for `kubectl exec`.

use std::fmt;
use std::io::Write;

use serde::Serialize;

use crate::cdi::{Kind, device_name};
use crate::config::{OutputFormat, Settings};
use crate::conflict;
use crate::health;
use crate::state::{Conflict, DeviceRecord, Health};

#[derive(Serialize)]
struct Row<'a> {
    id: &'a str,
    ibdev: &'a str,
    pci_address: &'a str,
    uverbs: &'a str,
    numa_node: Option<u32>,
    health: Health,
    /// What kind of failure makes it Unhealthy (a `Failure` label), null while Healthy.
    cause: Option<&'static str>,
    /// Why it is Unhealthy, in words; null while Healthy.
    reason: Option<&'a str>,
    /// The fully-qualified CDI names the device has (one per replica when shared), whichever
    /// strategy is configured; empty when the resource name is no valid CDI kind.
    cdi_devices: Vec<String>,
}

/// The CDI names of the EFA `id` under `settings`.
fn cdi_names(settings: &Settings, kind: Option<&Kind>, id: &str) -> Vec<String> {
    kind.map_or_else(Vec::new, |kind| {
        settings
            .sharing
            .advertised(id)
            .map(|id| kind.qualified(&device_name(&id)))
            .collect()
    })
}

/// One table cell for the names: the one name, or the first and last replica.
fn cdi_cell(names: &[String]) -> String {
    match names {
        [] => "-".to_owned(),
        [one] => one.clone(),
        [first, .., last] => format!("{first} .. {last}"),
    }
}

/// Prints the node's EFAs to `out` as the running plugin would judge them. What the plugin
/// would log about them (entries skipped, a registered DRA driver) goes to `warn`, one line
/// each, so `out` stays the listing alone.
pub fn print(
    settings: &Settings,
    format: OutputFormat,
    out: &mut dyn Write,
    warn: &mut dyn Write,
) -> anyhow::Result<()> {
    let records = judged(settings, warn)?;
    let kind = settings.resource_name.cdi_kind().ok();
    match format {
        OutputFormat::Json => write_json(settings, kind, &records, out),
        OutputFormat::Table => write_table(settings, kind, &records, out),
    }
}

/// The node's EFAs as the running plugin judges them: each by its own verdict, and all
/// withheld while an EFA DRA driver is registered.
fn judged(settings: &Settings, warn: &mut dyn Write) -> anyhow::Result<Vec<DeviceRecord>> {
    let judge = settings.judge();
    let observed = health::observe(&settings.sysfs_root, settings.device_id_strategy, &judge);
    if let Some(failed) = observed.failed {
        anyhow::bail!("{}", failed.message);
    }
    for problem in &observed.problems {
        say(warn, format_args!("warning: skipped {problem}"));
    }
    for problem in &observed.numa_unreadable {
        say(warn, format_args!("warning: no NUMA node for {problem}"));
    }
    if observed.netns_exclusive {
        say(warn, format_args!("error: {}", health::NETNS_EXCLUSIVE));
    }
    Ok(match registered_driver(settings, warn) {
        None => observed.records,
        Some(conflict) => observed
            .records
            .iter()
            .map(|record| conflict.withhold(record))
            .collect(),
    })
}

/// The conflict the running plugin's guard would find: an EFA DRA driver registered on the
/// node, unless coexistence is allowed.
fn registered_driver(settings: &Settings, warn: &mut dyn Write) -> Option<Conflict> {
    if settings.allow_dra_coexistence {
        return None;
    }
    let registry = &settings.plugins_registry_dir;
    let (driver, socket) = conflict::find_driver(registry, &settings.dra_drivers)
        .unwrap_or_else(|err| {
            say(
                warn,
                format_args!(
                    "warning: cannot list {}, so whether a DRA driver is registered is unknown: {err}",
                    registry.display()
                ),
            );
            None
        })?;
    let reason = conflict::describe(&driver, &socket, settings.resource_name.as_str());
    say(warn, format_args!("warning: {reason}"));
    Some(Conflict { driver, reason })
}

/// One line to `warn`. A failed write is dropped, as `main` drops its own: a closed stderr
/// must change neither the listing nor the exit status.
fn say(warn: &mut dyn Write, line: fmt::Arguments) {
    let _ = writeln!(warn, "{line}");
}

/// The rows for scripts: one object per EFA, with the keys the README documents.
fn write_json(
    settings: &Settings,
    kind: Option<&Kind>,
    records: &[DeviceRecord],
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let rows: Vec<Row> = records
        .iter()
        .map(|r| Row {
            id: &r.efa.id,
            ibdev: &r.efa.ibdev,
            pci_address: &r.efa.pci_address,
            uverbs: &r.efa.uverbs,
            numa_node: r.efa.numa_node,
            health: r.verdict.health,
            cause: r.verdict.cause.map(|cause| cause.label()),
            reason: r.verdict.reason.as_deref(),
            cdi_devices: cdi_names(settings, kind, &r.efa.id),
        })
        .collect();
    serde_json::to_writer_pretty(&mut *out, &rows)?;
    writeln!(out)?;
    Ok(())
}

/// The rows for people: one line per EFA, and a line saying so when there is none.
fn write_table(
    settings: &Settings,
    kind: Option<&Kind>,
    records: &[DeviceRecord],
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    writeln!(
        out,
        "{:<14} {:<14} {:<13} {:<9} {:>4} {:<9} {:<13} {:<35} REASON",
        "ID", "IBDEV", "PCI ADDRESS", "UVERBS", "NUMA", "HEALTH", "PCI ID", "CDI DEVICE"
    )?;
    for r in records {
        let numa = r.efa.numa_node.map_or("-".to_owned(), |n| n.to_string());
        writeln!(
            out,
            "{:<14} {:<14} {:<13} {:<9} {:>4} {:<9} {:<13} {:<35} {}",
            r.efa.id,
            r.efa.ibdev,
            r.efa.pci_address,
            r.efa.uverbs,
            numa,
            r.verdict.health.to_string(),
            format!("{}:{}", r.efa.vendor, r.efa.device),
            cdi_cell(&cdi_names(settings, kind, &r.efa.id)),
            r.verdict.reason.as_deref().unwrap_or("")
        )?;
    }
    if records.is_empty() {
        writeln!(
            out,
            "(no EFA under {}/class/infiniband)",
            settings.sysfs_root.display()
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::simulate::{FakeNode, Nodes, Shape};

    #[test]
    fn the_listing_goes_to_out_and_what_the_plugin_would_log_to_warn() {
        let dir = tempfile::tempdir().unwrap();
        let (node, _) = FakeNode::build(dir.path(), Shape::P4d, Nodes::Files).unwrap();
        node.set_rdma_netns_mode(Some("N")).unwrap();
        let registry = dir.path().join("plugins_registry");
        std::fs::create_dir(&registry).unwrap();
        let _dranet =
            std::os::unix::net::UnixListener::bind(registry.join("dra.net-reg.sock")).unwrap();
        let settings = Settings {
            sysfs_root: node.sysfs.clone(),
            dev_root: node.dev.clone(),
            plugins_registry_dir: registry,
            ..Settings::default()
        };
        let (mut out, mut warn) = (Vec::new(), Vec::new());
        print(&settings, OutputFormat::Table, &mut out, &mut warn).unwrap();
        let (out, warn) = (
            String::from_utf8(out).unwrap(),
            String::from_utf8(warn).unwrap(),
        );
        let lines: Vec<&str> = warn.lines().collect();
        assert_eq!(lines.len(), 2, "{warn}");
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains("exclusive"),
            "{warn}"
        );
        assert!(
            lines[1].starts_with("warning: DRA driver dra.net is registered"),
            "{warn}"
        );
        assert!(out.starts_with("ID "), "{out}");
        assert!(
            !out.contains("warning:") && !out.contains("error:"),
            "{out}"
        );
        assert_eq!(
            out.matches("DRA driver dra.net is registered").count(),
            4,
            "every EFA withheld for the driver: {out}"
        );
    }
}
