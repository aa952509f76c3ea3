//! `efa-device-plugin settings`: the settings table as the binary holds it, for a person (a
//! table) and for the checks that keep its copies true (JSON): the README's table and the
//! deploy tier's path list.

use std::io::Write;

use clap::ValueEnum;
use serde::Serialize;

use super::setting::{CONFIG, help_text};
use super::table::DECLARED;

/// How `list` and `settings` print their rows.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    Table,
    Json,
}

/// One setting as `settings` prints it.
#[derive(Serialize)]
struct SettingRow {
    /// The long flag, without its dashes.
    flag: &'static str,
    env: &'static str,
    /// The dotted key in the config file; `None` when the file may not set it.
    file_key: Option<&'static str>,
    /// `None` when there is none, or it is empty: the feature is off.
    default: Option<&'static str>,
    /// Whether the value names a file or directory, which a deployment must mount.
    path: bool,
    help: String,
}

/// `--config` first, then the settings in their table's order.
fn rows() -> Vec<SettingRow> {
    let config = SettingRow {
        flag: CONFIG.flag,
        env: CONFIG.env,
        file_key: None,
        default: None,
        path: true,
        help: CONFIG.help.to_owned(),
    };
    let settings = DECLARED
        .each()
        .into_iter()
        .map(|(setting, doc)| SettingRow {
            flag: setting.flag(),
            env: setting.env(),
            file_key: setting.file_key(),
            default: setting.default_text(),
            path: setting.is_path(),
            help: help_text(doc),
        });
    std::iter::once(config).chain(settings).collect()
}

/// As JSON (an array of rows), or as a table for a terminal.
pub fn print_settings(format: OutputFormat, out: &mut dyn Write) -> anyhow::Result<()> {
    let rows = rows();
    if format == OutputFormat::Json {
        serde_json::to_writer_pretty(&mut *out, &rows)?;
        writeln!(out)?;
        return Ok(());
    }
    let cell = |text: Option<&str>| text.unwrap_or("-").to_owned();
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|row| {
            [
                format!("--{}", row.flag),
                row.env.to_owned(),
                cell(row.file_key),
                cell(row.default),
                if row.path { "yes" } else { "no" }.to_owned(),
            ]
        })
        .collect();
    let header = ["FLAG", "ENV", "FILE KEY", "DEFAULT", "PATH"].map(str::to_owned);
    let mut widths = header.clone().map(|title| title.len());
    for row in &cells {
        for (width, text) in widths.iter_mut().zip(row) {
            *width = (*width).max(text.len());
        }
    }
    let line = |out: &mut dyn Write, cells: &[String; 5], help: &str| {
        for (width, text) in widths.iter().zip(cells) {
            write!(out, "{text:<width$} ")?;
        }
        writeln!(out, "{help}")
    };
    line(out, &header, "HELP")?;
    for (cells, row) in cells.iter().zip(&rows) {
        line(out, cells, &row.help)?;
    }
    Ok(())
}
