//! `efa-device-plugin list`: the node's EFAs as the plugin judges them, for `kubectl exec`.

use std::io::Write;

use serde::Serialize;

use crate::config::{OutputFormat, Settings};
use crate::health;
use crate::state::Health;

#[derive(Serialize)]
struct Row<'a> {
    id: &'a str,
    ibdev: &'a str,
    uverbs: &'a str,
    numa_node: Option<u32>,
    health: Health,
}

pub fn print(settings: &Settings, format: OutputFormat, out: &mut dyn Write) -> anyhow::Result<()> {
    let observed = health::observe(
        &settings.sysfs_root,
        &settings.dev_root,
        settings.test_only_regular_file_nodes,
    );
    if let Some(failed) = observed.failed {
        anyhow::bail!("{}", failed.message);
    }
    for problem in &observed.problems {
        eprintln!("warning: skipped {problem}");
    }
    for problem in &observed.numa_unreadable {
        eprintln!("warning: no NUMA node for {problem}");
    }
    let records = observed.records;
    match format {
        OutputFormat::Json => {
            let rows: Vec<Row> = records
                .iter()
                .map(|r| Row {
                    id: &r.efa.id,
                    ibdev: &r.efa.ibdev,
                    uverbs: &r.efa.uverbs,
                    numa_node: r.efa.numa_node,
                    health: r.verdict.health,
                })
                .collect();
            serde_json::to_writer_pretty(&mut *out, &rows)?;
            writeln!(out)?;
        }
        OutputFormat::Table => {
            writeln!(
                out,
                "{:<14} {:<14} {:<9} {:>4} {:<9} {:<13} REASON",
                "ID", "IBDEV", "UVERBS", "NUMA", "HEALTH", "PCI"
            )?;
            for r in &records {
                let numa = r.efa.numa_node.map_or("-".to_owned(), |n| n.to_string());
                writeln!(
                    out,
                    "{:<14} {:<14} {:<9} {:>4} {:<9} {:<13} {}",
                    r.efa.id,
                    r.efa.ibdev,
                    r.efa.uverbs,
                    numa,
                    r.verdict.health.to_string(),
                    format!("{}:{}", r.efa.vendor, r.efa.device),
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
        }
    }
    Ok(())
}
