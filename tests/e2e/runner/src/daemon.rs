//! A daemon the runner started: its log, its PID file, and how it is stopped.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::note;
use crate::wait::wait_for;

/// A running child process. Its PID is in `pid_file` for as long as it may run, so that the
/// suite's bash cleanup stops it even if the runner itself is killed; dropping it stops it.
pub struct Daemon {
    name: String,
    child: Child,
    pid_file: PathBuf,
}

impl Daemon {
    /// Starts `command` with stdout and stderr in `log`.
    pub fn start(name: &str, mut command: Command, log: &Path, pid_dir: &Path) -> Result<Daemon> {
        let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
        command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let child = command
            .spawn()
            .with_context(|| format!("start {name} ({command:?})"))?;
        fs::create_dir_all(pid_dir)?;
        let pid_file = pid_dir.join(name);
        fs::write(&pid_file, child.id().to_string())?;
        Ok(Daemon {
            name: name.to_owned(),
            child,
            pid_file,
        })
    }

    /// The exit status, if it has exited.
    pub fn exited(&mut self) -> Result<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// SIGTERM, then SIGKILL after `grace`; the exit status.
    pub fn stop(mut self, grace: Duration) -> Result<ExitStatus> {
        self.stop_in_place(grace)
    }

    fn stop_in_place(&mut self, grace: Duration) -> Result<ExitStatus> {
        if self.exited()?.is_none() {
            let pid = Pid::from_raw(self.child.id() as i32);
            let _ = kill(pid, Signal::SIGTERM);
            let stopped = wait_for(&self.name, grace, || Ok(self.child.try_wait()?));
            if stopped.is_err() {
                note(&format!(
                    "{} (pid {pid}) ignored SIGTERM for {}s; killing it",
                    self.name,
                    grace.as_secs()
                ));
                let _ = self.child.kill();
            }
        }
        let status = self.child.wait()?;
        let _ = fs::remove_file(&self.pid_file);
        Ok(status)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.stop_in_place(Duration::from_secs(10));
    }
}

/// The last `n` lines of a log, joined by `|` as the suites' reasons quote them.
pub fn tail(log: &Path, n: usize) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("|")
}
