//! Decides each device's health and keeps the device state current.
//!
//! EFA port state is hard-coded ACTIVE by the driver, so it carries no signal. What does: the
//! device is still in sysfs, still bound to `efa`, and its uverbs node is present in the dev root
//! with the major:minor sysfs gives. Health is recomputed from scratch on every pass, so a device
//! that recovers turns Healthy again; nothing is unhealthy forever.

use std::collections::BTreeSet;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::discovery::{self, DevNum, Efa};
use crate::fswatch::DirWatch;
use crate::state::{Change, DeviceRecord, DeviceState, Verdict};

/// Where a device's node lives on the host: `<dev-root>/infiniband/<uverbs>`.
pub fn node_path(dev_root: &Path, uverbs: &str) -> PathBuf {
    dev_root.join("infiniband").join(uverbs)
}

/// Judges one device that the scan found (so it is in sysfs and bound to `efa`).
pub fn assess(efa: &Efa, dev_root: &Path) -> Verdict {
    let path = node_path(dev_root, &efa.uverbs);
    let meta = match std::fs::metadata(&path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return Verdict::unhealthy(format!("{} is missing", path.display()));
        }
        Err(err) => return Verdict::unhealthy(format!("{}: {err}", path.display())),
    };
    if meta.file_type().is_char_device() {
        let rdev = meta.rdev();
        let found = DevNum {
            major: nix::sys::stat::major(rdev) as u32,
            minor: nix::sys::stat::minor(rdev) as u32,
        };
        if found != efa.dev {
            return Verdict::unhealthy(format!(
                "{} is {found}, sysfs says {}",
                path.display(),
                efa.dev
            ));
        }
    }
    Verdict::healthy()
}

/// One full observation: scan sysfs, judge each device.
pub fn observe(sysfs_root: &Path, dev_root: &Path) -> (Vec<DeviceRecord>, Vec<discovery::Problem>) {
    let scan = discovery::scan(sysfs_root);
    let records = scan
        .devices
        .into_iter()
        .map(|efa| {
            let verdict = assess(&efa, dev_root);
            DeviceRecord { efa, verdict }
        })
        .collect();
    (records, scan.problems)
}

/// Keeps [`DeviceState`] current: rescans every `interval`, and at once when an entry of
/// `<dev-root>/infiniband` changes.
pub struct Monitor {
    sysfs_root: PathBuf,
    dev_root: PathBuf,
    interval: Duration,
    state: DeviceState,
    /// Scan problems already logged, so each is logged once while it lasts.
    known_problems: BTreeSet<String>,
}

/// Coalesces a burst of node events (an `rm` of several nodes) into one rescan.
const SETTLE: Duration = Duration::from_millis(20);

impl Monitor {
    pub fn new(
        sysfs_root: PathBuf,
        dev_root: PathBuf,
        interval: Duration,
        state: DeviceState,
    ) -> Self {
        Monitor {
            sysfs_root,
            dev_root,
            interval,
            state,
            known_problems: BTreeSet::new(),
        }
    }

    /// Runs one observation, publishes it and logs what changed.
    pub async fn refresh(&mut self) {
        let (sysfs_root, dev_root) = (self.sysfs_root.clone(), self.dev_root.clone());
        let observed = tokio::task::spawn_blocking(move || observe(&sysfs_root, &dev_root)).await;
        let Ok((records, problems)) = observed else {
            return;
        };
        let current: BTreeSet<String> = problems.iter().map(ToString::to_string).collect();
        for problem in current.difference(&self.known_problems) {
            tracing::warn!(problem = %problem, "skipping an EFA entry sysfs does not describe fully");
        }
        self.known_problems = current;
        for change in &self.state.apply(records) {
            log_change(change);
        }
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        let nodes_dir = self.dev_root.join("infiniband");
        let mut watch: Option<DirWatch> = None;
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + self.interval, self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if watch.is_none() {
                // The directory appears only once the driver created a node; until then the
                // periodic rescan covers it and each pass tries to watch again.
                watch = DirWatch::new(&nodes_dir).ok();
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
                () = next_events(&mut watch) => tokio::time::sleep(SETTLE).await,
            }
            self.refresh().await;
        }
    }
}

/// Resolves on any change of the watched node directory; drops a dead watch so the next pass
/// sets it up again.
async fn next_events(watch: &mut Option<DirWatch>) {
    match watch {
        Some(w) => {
            if w.next().await.is_err() {
                *watch = None;
            }
        }
        None => std::future::pending().await,
    }
}

fn log_change(change: &Change) {
    match change {
        Change::Added(record) => tracing::info!(
            device = %record.efa.id,
            ibdev = %record.efa.ibdev,
            uverbs = %record.efa.uverbs,
            numa_node = ?record.efa.numa_node,
            health = %record.verdict.health,
            reason = record.verdict.reason.as_deref().unwrap_or(""),
            "device found"
        ),
        Change::Health { before, after } if after.is_healthy() => tracing::info!(
            device = %after.efa.id,
            ibdev = %after.efa.ibdev,
            was = before.reason.as_deref().unwrap_or(""),
            "device healthy again"
        ),
        Change::Health { after, .. } => tracing::warn!(
            device = %after.efa.id,
            ibdev = %after.efa.ibdev,
            reason = after.verdict.reason.as_deref().unwrap_or(""),
            "device unhealthy"
        ),
    }
}
