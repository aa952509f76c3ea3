//! The report a long case (the soak, the burst) writes as it goes, to `logs/NAME` in the run
//! dir, and the verdict it ends with: its last line, and a failure naming the first three
//! violations if there were any.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cases::Detail;
use crate::cluster::Cluster;

pub struct Report {
    name: String,
    file: File,
    violations: Vec<String>,
}

impl Report {
    /// A new, empty report `logs/NAME`.
    pub fn create(cluster: &Cluster, name: &str) -> Result<Report> {
        let path: PathBuf = cluster.run.join("logs").join(name);
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .with_context(|| format!("create {}", path.display()))?;
        Ok(Report {
            name: name.to_owned(),
            file,
            violations: Vec::new(),
        })
    }

    /// One line of the report; a report that cannot be written is said once on stderr, and the
    /// case goes on, as its verdict does not depend on the file.
    pub fn note(&mut self, line: &str) {
        if let Err(err) = writeln!(self.file, "{line}") {
            crate::note(&format!("cannot write logs/{}: {err}", self.name));
        }
    }

    /// A violation in `when` (`cycle 3`, `burst`).
    pub fn violation(&mut self, when: &str, what: &str) {
        let line = format!("VIOLATION {when}: {what}");
        self.note(&line);
        self.violations.push(line);
    }

    pub fn violations(&self) -> usize {
        self.violations.len()
    }

    /// `last` as the report's last line and the case's detail; a failure naming the first three
    /// violations if there were any.
    pub fn verdict(mut self, last: &str) -> Result<Detail> {
        self.note(last);
        if !self.violations.is_empty() {
            bail!(
                "{last}: {}",
                self.violations[..self.violations.len().min(3)].join("|")
            );
        }
        Ok(format!("{last} (report: logs/{})", self.name))
    }
}

/// The short commit of the repository under test, for a report's first line.
pub fn commit(cluster: &Cluster) -> String {
    Command::new("git")
        .arg("-C")
        .arg(&cluster.repo)
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map_or_else(
            || "unknown".to_owned(),
            |out| String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        )
}

/// A whole-number setting from the environment, `default` when unset; a value that is not one
/// fails the case, naming the variable.
pub fn setting(name: &str, default: u32) -> Result<u32> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .with_context(|| format!("{name}={value:?} is not a whole number")),
        Err(_) => Ok(default),
    }
}
