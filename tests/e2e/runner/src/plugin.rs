//! The plugin under test: the release binary on the fake host, up or stopped.

use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use anyhow::Result;

use crate::daemon::Daemon;
use crate::http;

/// The plugin's metrics port: its default `--metrics-address`.
pub const METRICS_PORT: u16 = 9465;
/// The detector's gauge: device IDs PodResources lists in two or more running pods.
pub const DOUBLE_BOOKED: &str = "efa_device_plugin_double_booked_devices";

pub struct Plugin {
    pub binary: PathBuf,
    pub sysfs: PathBuf,
    pub dev: PathBuf,
    pub device_plugin_dir: PathBuf,
    pub pod_resources_socket: PathBuf,
    pub run: PathBuf,
    /// Flags added to every start.
    pub flags: Vec<String>,
    starts: u32,
    daemon: Option<Daemon>,
}

/// How a running plugin was found when asked to stop.
pub enum Stopped {
    /// It had exited before: with this status.
    Already(ExitStatus),
    /// It exited on SIGTERM (or SIGKILL after the grace period): with this status.
    OnSignal(ExitStatus),
}

impl Plugin {
    pub fn new(
        binary: PathBuf,
        sysfs: PathBuf,
        dev: PathBuf,
        device_plugin_dir: PathBuf,
        pod_resources_socket: PathBuf,
        run: PathBuf,
    ) -> Plugin {
        Plugin {
            binary,
            sysfs,
            dev,
            device_plugin_dir,
            pod_resources_socket,
            run,
            flags: Vec::new(),
            starts: 0,
            daemon: None,
        }
    }

    /// Started if it is not running (never started, stopped, or exited by itself).
    pub fn ensure_up(&mut self) -> Result<()> {
        let running = match &mut self.daemon {
            Some(daemon) => daemon.exited()?.is_none(),
            None => false,
        };
        if !running {
            self.start()?;
        }
        Ok(())
    }

    pub fn start(&mut self) -> Result<()> {
        self.starts += 1;
        let mut command = Command::new(&self.binary);
        command
            .arg("--sysfs-root")
            .arg(&self.sysfs)
            .arg("--dev-root")
            .arg(&self.dev)
            .arg("--device-plugin-dir")
            .arg(&self.device_plugin_dir)
            .arg("--pod-resources-socket")
            .arg(&self.pod_resources_socket)
            .args(["--rescan-interval", "500ms"])
            .args(&self.flags);
        self.daemon = Some(Daemon::start(
            "plugin",
            command,
            &self.log(),
            &self.run.join("pids"),
        )?);
        Ok(())
    }

    /// Stops it with SIGTERM, SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) -> Result<Option<Stopped>> {
        let Some(mut daemon) = self.daemon.take() else {
            return Ok(None);
        };
        if let Some(status) = daemon.exited()? {
            return Ok(Some(Stopped::Already(status)));
        }
        Ok(Some(Stopped::OnSignal(daemon.stop(grace)?)))
    }

    /// The log of the current (last started) plugin.
    pub fn log(&self) -> PathBuf {
        self.run
            .join("logs")
            .join(format!("plugin.{}.log", self.starts))
    }

    /// Its `/metrics` text.
    pub fn metrics(&self) -> Result<String> {
        http::get(METRICS_PORT, "/metrics")
    }
}

/// The value of the unlabelled sample `family` in a metrics text, as it is written.
pub fn sample<'a>(metrics: &'a str, family: &str) -> Option<&'a str> {
    metrics.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        (fields.next() == Some(family)).then(|| fields.next().unwrap_or_default())
    })
}

/// How many `efa_device_allocation` series name `pod`.
pub fn allocation_series(metrics: &str, pod: &str) -> usize {
    let label = format!("pod=\"{pod}\"");
    metrics
        .lines()
        .filter(|line| line.starts_with("efa_device_allocation{") && line.contains(&label))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = "# TYPE efa_device_plugin_double_booked_devices gauge\n\
        efa_device_plugin_double_booked_devices 0\n\
        efa_device_plugin_double_booked_devices_total 3\n\
        efa_device_allocation{device=\"a\",pod=\"job-n\",namespace=\"default\"} 1\n\
        efa_device_allocation{device=\"b\",pod=\"job-n\",namespace=\"default\"} 1\n\
        efa_device_allocation{device=\"c\",pod=\"other-n\",namespace=\"default\"} 1\n";

    #[test]
    fn a_sample_is_read_by_its_exact_family() {
        assert_eq!(
            sample(METRICS, "efa_device_plugin_double_booked_devices"),
            Some("0")
        );
        assert_eq!(sample(METRICS, "efa_device_plugin_missing"), None);
    }

    #[test]
    fn allocation_series_are_counted_per_pod() {
        assert_eq!(allocation_series(METRICS, "job-n"), 2);
        assert_eq!(allocation_series(METRICS, "ob-n"), 0);
    }
}
