//! Decides each device's health and keeps the device state current.
//!
//! EFA port state is hard-coded ACTIVE by the driver, so it carries no signal. What does: the
//! device is still in sysfs, still bound to `efa`, its uverbs node is present in the dev root
//! with the major:minor sysfs gives, and the driver has not closed its admin queue
//! ([`admin_queue`]). Health is recomputed from scratch on every pass, so a device that
//! recovers turns Healthy again; nothing is unhealthy forever.

pub(crate) mod admin_queue;

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::allocation::recent::Recent;
use crate::discovery::{self, DevNum, DeviceIdStrategy, Efa, ListingError, Problem, Reads};
use crate::fsread;
use crate::rescan::Rescans;
use crate::state::{
    Change, DeviceRecord, DeviceState, Failure, Health, Held, Holdings, Observation, Reader,
    Verdict,
};
use admin_queue::AdminQueue;

/// The health rules, and the dev root whose nodes they judge. Built once by whoever observes the
/// node, and handed to every pass.
#[derive(Clone, Debug)]
pub struct Judge {
    dev_root: PathBuf,
    /// Whether the [`admin_queue`] rule applies: `--admin-queue-health`.
    admin_queue: bool,
    /// Test-only: see [`Judge::accepting_regular_files`].
    #[cfg(any(test, feature = "testkit"))]
    regular_files: bool,
}

impl Judge {
    /// The product's rules for the nodes in `dev_root`, the admin-queue rule among them.
    pub fn new(dev_root: PathBuf) -> Self {
        Judge {
            dev_root,
            admin_queue: true,
            #[cfg(any(test, feature = "testkit"))]
            regular_files: false,
        }
    }

    /// With `accept`, also judges a regular file at a node path Healthy: the test kit's
    /// simulated nodes are made without `CAP_MKNOD`. Only test builds have this rule.
    #[cfg(any(test, feature = "testkit"))]
    pub fn accepting_regular_files(mut self, accept: bool) -> Self {
        self.regular_files = accept;
        self
    }

    /// With `check` false, leaves the [`admin_queue`] rule out.
    pub fn checking_admin_queue(mut self, check: bool) -> Self {
        self.admin_queue = check;
        self
    }

    pub(crate) fn dev_root(&self) -> &Path {
        &self.dev_root
    }

    /// Judges one device that the scan found (so it is in sysfs and bound to `efa`): only a
    /// character device with sysfs' `major:minor` is Healthy. The node becomes a `host_path`
    /// the runtime hands to containers, and a directory there would give them every node below
    /// it.
    pub(crate) fn verdict(&self, efa: &Efa) -> Verdict {
        let path = efa.node_path(&self.dev_root);
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Verdict::unhealthy(
                    Failure::DeviceNode,
                    format!("{} is missing", path.display()),
                );
            }
            Err(err) => {
                return Verdict::unhealthy(
                    Failure::DeviceNode,
                    format!("{}: {err}", path.display()),
                );
            }
        };
        let kind = meta.file_type();
        if kind.is_char_device() {
            let rdev = meta.rdev();
            let found = DevNum {
                major: nix::sys::stat::major(rdev) as u32,
                minor: nix::sys::stat::minor(rdev) as u32,
            };
            if found != efa.dev {
                return Verdict::unhealthy(
                    Failure::DeviceNode,
                    format!("{} is {found}, sysfs says {}", path.display(), efa.dev),
                );
            }
            return Verdict::healthy();
        }
        #[cfg(any(test, feature = "testkit"))]
        if kind.is_file() && self.regular_files {
            return Verdict::healthy();
        }
        Verdict::unhealthy(
            Failure::DeviceNode,
            format!(
                "{} is {}, not a character device",
                path.display(),
                fsread::describe(kind)
            ),
        )
    }
}

/// One pass over sysfs and the dev root.
#[derive(Debug, Default)]
pub struct Observed {
    pub records: Vec<DeviceRecord>,
    pub problems: Vec<Problem>,
    pub numa_unreadable: Vec<Problem>,
    pub failed: Option<ListingError>,
    /// The RDMA subsystem is in exclusive network-namespace mode: see [`rdma_netns_exclusive`].
    pub netns_exclusive: bool,
}

/// What the plugin logs once, and `list` prints, while the RDMA subsystem is in exclusive mode:
/// the cause of "no EFA" and the two fixes.
pub const NETNS_EXCLUSIVE: &str = "the RDMA subsystem is in exclusive network-namespace mode \
    (ib_core netns_mode=N): a pod without the host network sees no EFA; run `rdma system set \
    netns shared` on the node, or run the pods with hostNetwork: true";

/// Whether `<sysfs>/module/ib_core/parameters/netns_mode` says exclusive (`N`). The kernel
/// writes `Y` for the default shared mode; a missing file (no `ib_core`, or a kernel without
/// the parameter) means shared too, and so does an unreadable one: only a clear `N` is reported.
pub fn rdma_netns_exclusive(sysfs_root: &Path) -> bool {
    let path = sysfs_root.join("module/ib_core/parameters/netns_mode");
    fsread::read_text(&path, fsread::ATTRIBUTE_LIMIT).is_ok_and(|mode| mode.trim() == "N")
}

/// One full observation: scan sysfs, judge each device.
pub fn observe(sysfs_root: &Path, ids: DeviceIdStrategy, judge: &Judge) -> Observed {
    observe_guarded(sysfs_root, ids, judge, &Reads::default())
}

/// How a pass observes the node; a parameter only so a test can stand in for a hung driver.
type Observer = fn(&Path, DeviceIdStrategy, &Judge, &Reads) -> Observed;

fn observe_guarded(
    sysfs_root: &Path,
    ids: DeviceIdStrategy,
    judge: &Judge,
    reads: &Reads,
) -> Observed {
    let scan = discovery::scan_guarded(sysfs_root, ids, reads);
    let class = sysfs_root.join("class/infiniband");
    let records = scan
        .devices
        .into_iter()
        .map(|efa| {
            let mut verdict = judge.verdict(&efa);
            // Under the entry's read guard, so a counter read stuck in the driver costs only
            // this device at the pass's deadline. A device already Unhealthy is not read.
            if verdict.health == Health::Healthy && judge.admin_queue && reads.begin(&efa.ibdev) {
                let queue = AdminQueue::read(&class.join(&efa.ibdev));
                reads.end(&efa.ibdev);
                verdict = queue.verdict().unwrap_or(verdict);
            }
            DeviceRecord { efa, verdict }
        })
        .collect();
    Observed {
        records,
        problems: scan.problems,
        numa_unreadable: scan.numa_unreadable,
        failed: scan.failed,
        netns_exclusive: rdma_netns_exclusive(sysfs_root),
    }
}

/// A pass that has not finished by then is abandoned: the entry it is stuck on turns Unhealthy
/// and the rest keep their verdicts. A scan of 256 EFAs takes milliseconds.
pub(crate) const PASS_DEADLINE: Duration = Duration::from_secs(2);
/// This many failed passes in a row make `/healthz` fail, so the kubelet restarts the plugin.
pub(crate) const FAILED_PASSES: u32 = 3;

/// How the monitor's passes went, for `/healthz` and the metrics.
#[derive(Debug)]
pub struct ScanStats {
    interval: Duration,
    inner: Mutex<StatsInner>,
}

#[derive(Debug)]
struct StatsInner {
    /// Scan errors by reason: an errno name for a failed listing, `deadline`, `numa_node`, `entry`.
    errors: BTreeMap<String, u64>,
    failed_in_a_row: u32,
    last_failure: String,
    last_pass: Instant,
}

impl ScanStats {
    pub fn new(interval: Duration) -> Self {
        ScanStats {
            interval,
            inner: Mutex::new(StatsInner {
                errors: BTreeMap::new(),
                failed_in_a_row: 0,
                last_failure: String::new(),
                last_pass: Instant::now(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StatsInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count(&self, reason: &str, times: usize) {
        if times > 0 {
            *self.lock().errors.entry(reason.to_owned()).or_default() += times as u64;
        }
    }

    /// Records the end of a pass; returns whether it ended a run of failed ones.
    fn finished(&self, failure: Option<String>) -> bool {
        let mut inner = self.lock();
        inner.last_pass = Instant::now();
        let recovered = failure.is_none() && inner.failed_in_a_row > 0;
        match failure {
            Some(why) => {
                inner.failed_in_a_row += 1;
                inner.last_failure = why;
            }
            None => inner.failed_in_a_row = 0,
        }
        recovered
    }

    /// Scan errors so far, by reason.
    pub fn errors(&self) -> BTreeMap<String, u64> {
        self.lock().errors.clone()
    }

    /// Why the monitor is not doing its job, if it is not: its scans keep failing, or no pass
    /// has finished in several intervals.
    pub fn liveness(&self) -> Result<(), String> {
        let inner = self.lock();
        if inner.failed_in_a_row >= FAILED_PASSES {
            return Err(format!(
                "the last {} sysfs scans failed: {}",
                inner.failed_in_a_row, inner.last_failure
            ));
        }
        let since = inner.last_pass.elapsed();
        if since > self.interval * FAILED_PASSES + PASS_DEADLINE {
            return Err(format!(
                "no sysfs scan has finished for {}s (rescan interval {})",
                since.as_secs(),
                humantime::format_duration(self.interval)
            ));
        }
        Ok(())
    }
}

/// Keeps [`DeviceState`] current: rescans every `interval`, and at once when an entry of
/// `<dev-root>/infiniband` changes.
pub(crate) struct Monitor {
    sysfs_root: PathBuf,
    judge: Arc<Judge>,
    interval: Duration,
    ids: DeviceIdStrategy,
    state: DeviceState,
    stats: Arc<ScanStats>,
    reads: Arc<Reads>,
    observer: Observer,
    /// A pass abandoned at its deadline and still running.
    abandoned: Option<JoinHandle<Observed>>,
    /// Problems already logged, so each is logged once while it lasts.
    known_problems: BTreeSet<String>,
    /// The PodResources view: which IDs a renamed EFA must keep.
    holdings: Option<Reader<Arc<Holdings>>>,
    /// The IDs Allocate gave out lately, which the view may not show yet.
    given_lately: Option<Arc<Recent>>,
}

/// Coalesces a burst of node events (an `rm` of several nodes) into one rescan.
const SETTLE: Duration = Duration::from_millis(20);

impl Monitor {
    pub(crate) fn new(
        sysfs_root: PathBuf,
        judge: Judge,
        interval: Duration,
        state: DeviceState,
    ) -> Self {
        Monitor {
            sysfs_root,
            judge: Arc::new(judge),
            interval,
            ids: DeviceIdStrategy::default(),
            state,
            stats: Arc::new(ScanStats::new(interval)),
            reads: Arc::default(),
            observer: observe_guarded,
            abandoned: None,
            known_problems: BTreeSet::new(),
            holdings: None,
            given_lately: None,
        }
    }

    /// Reads which IDs pods hold from `holdings`, and, when Allocate records them,
    /// `given_lately`, so a renamed EFA keeps only a held ID.
    pub(crate) fn with_holdings(
        mut self,
        holdings: Reader<Arc<Holdings>>,
        given_lately: Option<Arc<Recent>>,
    ) -> Self {
        self.holdings = Some(holdings);
        self.given_lately = given_lately;
        self
    }

    /// Names each EFA by `ids` instead of the default strategy.
    pub(crate) fn with_ids(mut self, ids: DeviceIdStrategy) -> Self {
        self.ids = ids;
        self
    }

    pub(crate) fn stats(&self) -> Arc<ScanStats> {
        self.stats.clone()
    }

    /// Runs one observation, publishes it and logs what changed.
    pub(crate) async fn refresh(&mut self) {
        let failure = match self.pass().await {
            Ok(observed) => self.publish(observed),
            Err(stuck) => {
                let why = format!(
                    "a pass did not finish within {}s, stuck reading {}",
                    PASS_DEADLINE.as_secs(),
                    if stuck.is_empty() {
                        "a directory or a device node, not an EFA entry".to_owned()
                    } else {
                        stuck.iter().cloned().collect::<Vec<_>>().join(", ")
                    }
                );
                self.stats.count("deadline", 1);
                let unreadable = stuck
                    .into_iter()
                    .map(|ibdev| {
                        (
                            ibdev,
                            format!(
                                "reading its sysfs attributes took longer than {}s",
                                PASS_DEADLINE.as_secs()
                            ),
                        )
                    })
                    .collect();
                self.apply(Observation {
                    records: Vec::new(),
                    unreadable,
                    complete: false,
                    held: Held::Unknown,
                });
                self.log_once(
                    &why,
                    || tracing::error!(error = %why, "sysfs scan abandoned"),
                );
                Some(why)
            }
        };
        if self.stats.finished(failure) {
            tracing::info!("sysfs scans work again");
        }
    }

    /// Runs a pass on the blocking pool with a deadline; on timeout, the entries it is stuck on.
    async fn pass(&mut self) -> Result<Observed, BTreeSet<String>> {
        if let Some(earlier) = &self.abandoned {
            if !earlier.is_finished() && self.reads.in_flight().is_empty() {
                // Stuck outside the entries (a listing, a node's stat): another thread would
                // only stick there too.
                return Err(BTreeSet::new());
            }
            self.abandoned = None;
        }
        let (sysfs_root, ids, judge, reads, observe) = (
            self.sysfs_root.clone(),
            self.ids,
            self.judge.clone(),
            self.reads.clone(),
            self.observer,
        );
        let mut pass =
            tokio::task::spawn_blocking(move || observe(&sysfs_root, ids, &judge, &reads));
        match tokio::time::timeout(PASS_DEADLINE, &mut pass).await {
            Ok(Ok(observed)) => Ok(observed),
            Ok(Err(panicked)) => Ok(Observed {
                failed: Some(ListingError {
                    code: "panic".into(),
                    message: panicked.to_string(),
                }),
                ..Observed::default()
            }),
            Err(_) => {
                self.abandoned = Some(pass);
                Err(self.reads.in_flight())
            }
        }
    }

    /// Publishes a finished pass; returns why it failed, if it did.
    fn publish(&mut self, observed: Observed) -> Option<String> {
        let Observed {
            records,
            problems,
            numa_unreadable,
            failed,
            netns_exclusive,
        } = observed;
        if let Some(failed) = failed {
            // The last known state stays: a failed listing says nothing about the devices.
            self.stats.count(&failed.code, 1);
            let message = failed.message;
            self.log_once(&message, || {
                tracing::error!(error = %message, "cannot list the RDMA devices; keeping the last known state and retrying")
            });
            return Some(message);
        }
        if self.state.set_netns_exclusive(netns_exclusive) {
            if netns_exclusive {
                tracing::error!("{NETNS_EXCLUSIVE}");
            } else {
                tracing::info!("the RDMA subsystem is in shared network-namespace mode again");
            }
        }
        self.stats.count("entry", problems.len());
        self.stats.count("numa_node", numa_unreadable.len());
        let mut current = BTreeSet::new();
        for problem in &problems {
            let line = problem.to_string();
            if !self.known_problems.contains(&line) {
                tracing::warn!(problem = %line, "skipping an EFA entry sysfs does not describe fully");
            }
            current.insert(line);
        }
        for problem in &numa_unreadable {
            let line = problem.to_string();
            if !self.known_problems.contains(&line) {
                tracing::warn!(problem = %line, "cannot read an EFA's NUMA node; advertising it without topology");
            }
            current.insert(line);
        }
        self.known_problems = current;
        let unreadable = problems.into_iter().map(|p| (p.entry, p.reason)).collect();
        self.apply(Observation {
            records,
            unreadable,
            complete: true,
            held: self.held(),
        });
        None
    }

    /// Which IDs pods hold now; unknown without the PodResources view, so that a renamed EFA
    /// keeps the ID it had rather than risk the kubelet giving it out twice. The view is one
    /// poll old: an ID Allocate gave out since may be held already, so those count too.
    fn held(&self) -> Held {
        let held = self
            .holdings
            .as_ref()
            .map_or(Held::Unknown, |holdings| holdings.borrow().held());
        match (held, &self.given_lately) {
            (Held::Ids(mut ids), Some(given)) => {
                ids.extend(given.efas_given_within(Duration::MAX));
                Held::Ids(ids)
            }
            (held, _) => held,
        }
    }

    fn apply(&self, observation: Observation) {
        for change in &self.state.apply_observation(observation) {
            log_change(change);
        }
    }

    /// Logs a failure when it first appears; it is forgotten once the next pass succeeds.
    fn log_once(&mut self, failure: &str, log: impl FnOnce()) {
        if self.known_problems.len() != 1 || !self.known_problems.contains(failure) {
            log();
        }
        self.known_problems = BTreeSet::from([failure.to_owned()]);
    }

    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        let mut rescans = Rescans::every(self.interval, shutdown)
            .watching(self.judge.dev_root().join("infiniband"))
            .settling(SETTLE);
        while rescans.due().await {
            self.refresh().await;
        }
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
        // Under ibdev IDs, a held old name that stays the ID.
        Change::Renamed { before, after }
            if after.efa.id == before.id && before.id == before.ibdev =>
        {
            tracing::info!(
                device = %after.efa.id,
                ibdev = %after.efa.ibdev,
                was = %before.ibdev,
                "device renamed; advertised under its old ID while a pod holds it"
            )
        }
        Change::Renamed { before, after } => tracing::info!(
            device = %after.efa.id,
            ibdev = %after.efa.ibdev,
            was = %before.id,
            health = %after.verdict.health,
            "device renamed"
        ),
        Change::Health { after, .. } => tracing::warn!(
            device = %after.efa.id,
            ibdev = %after.efa.ibdev,
            reason = after.verdict.reason.as_deref().unwrap_or(""),
            "device unhealthy"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{DeviceReader, Health, Writer};
    use crate::testkit::simulate;

    /// A p4d whose `HUNG` entry never returns from a read until a writer opens the FIFO
    /// `<sysfs>/hang`; the other devices read fine.
    const HUNG: &str = "rdmap32s27";

    fn hung_driver(sysfs: &Path, _: DeviceIdStrategy, _: &Judge, reads: &Reads) -> Observed {
        let records = simulate::inventory(simulate::Shape::P4d)
            .devices()
            .filter(|d| d.efa.ibdev != HUNG)
            .cloned()
            .collect();
        if reads.begin(HUNG) {
            // A FIFO opened without O_NONBLOCK blocks until a writer comes, as a hung read would.
            let _ = std::fs::read(sysfs.join("hang"));
            reads.end(HUNG);
        }
        Observed {
            records,
            problems: vec![Problem {
                entry: HUNG.into(),
                reason: discovery::STILL_READING.into(),
            }],
            ..Observed::default()
        }
    }

    /// Lets a read blocked on the FIFO return, even when the test fails, so the runtime's
    /// shutdown does not wait on it forever.
    struct Release(PathBuf);

    impl Drop for Release {
        fn drop(&mut self) {
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
                .open(&self.0);
        }
    }

    #[tokio::test]
    async fn a_pass_stuck_in_a_read_costs_only_that_device_and_only_one_thread() {
        let sysfs = tempfile::tempdir().unwrap();
        let hang = sysfs.path().join("hang");
        nix::unistd::mkfifo(&hang, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let _release = Release(hang);
        let state = DeviceState::unguarded();
        state.apply(
            simulate::inventory(simulate::Shape::P4d)
                .devices()
                .cloned()
                .collect(),
        );
        let (state, writer) = (state.reader(), state);
        let mut monitor = Monitor::new(
            sysfs.path().to_owned(),
            Judge::new(sysfs.path().to_owned()),
            Duration::from_secs(5),
            writer,
        );
        monitor.observer = hung_driver;

        monitor.refresh().await;
        let health = |state: &DeviceReader| -> Vec<(String, bool)> {
            state
                .current()
                .devices()
                .map(|d| (d.efa.ibdev.clone(), d.is_healthy()))
                .collect()
        };
        let stuck = |state: &DeviceReader| {
            let inventory = state.current();
            let record = inventory.devices().find(|d| d.efa.ibdev == HUNG).unwrap();
            record.verdict.reason.clone().unwrap_or_default()
        };
        assert_eq!(health(&state).iter().filter(|(_, ok)| *ok).count(), 3);
        assert!(
            stuck(&state).contains("took longer than 2s"),
            "{}",
            stuck(&state)
        );
        assert_eq!(monitor.stats.errors().get("deadline"), Some(&1));

        // The next pass does not wait on the stuck entry again: it reports it at once.
        let started = Instant::now();
        monitor.refresh().await;
        assert!(started.elapsed() < PASS_DEADLINE);
        assert_eq!(stuck(&state), discovery::STILL_READING);
        assert_eq!(health(&state).iter().filter(|(_, ok)| *ok).count(), 3);
    }

    static PASSES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    fn counted_pass(_: &Path, _: DeviceIdStrategy, _: &Judge, _: &Reads) -> Observed {
        PASSES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Observed::default()
    }

    /// Lets `monitor.run` go on, on this thread, until it has made `more` further passes.
    async fn passes(more: usize) {
        let target = PASSES.load(std::sync::atomic::Ordering::SeqCst) + more;
        while PASSES.load(std::sync::atomic::Ordering::SeqCst) < target {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn rescans_of_a_node_without_efa_open_no_inotify_instance() {
        let root = tempfile::tempdir().unwrap();
        let mut monitor = Monitor::new(
            root.path().join("sys"),
            Judge::new(root.path().join("dev")),
            Duration::from_millis(1),
            DeviceState::unguarded(),
        );
        monitor.observer = counted_pass;
        let shutdown = CancellationToken::new();
        // The test's runtime has one thread, so the monitor's inotify instances are counted here.
        let run = tokio::spawn(monitor.run(shutdown.clone()));
        let inits = crate::fswatch::inotify_inits();
        passes(100).await;
        assert_eq!(
            crate::fswatch::inotify_inits() - inits,
            0,
            "inotify instances for 100 rescans without <dev-root>/infiniband"
        );

        std::fs::create_dir_all(root.path().join("dev/infiniband")).unwrap();
        passes(100).await;
        assert_eq!(
            crate::fswatch::inotify_inits() - inits,
            1,
            "the dir, once there, is watched by one instance"
        );
        shutdown.cancel();
        run.await.unwrap();
    }

    #[test]
    fn a_regular_file_at_the_node_path_is_healthy_only_to_a_judge_that_accepts_them() {
        let root = tempfile::tempdir().unwrap();
        let (node, _) =
            simulate::FakeNode::build(root.path(), simulate::Shape::P4d, simulate::Nodes::Files)
                .unwrap();
        let verdicts = |judge: &Judge| -> Vec<Option<String>> {
            observe(&node.sysfs, DeviceIdStrategy::default(), judge)
                .records
                .into_iter()
                .map(|record| record.verdict.reason)
                .collect()
        };
        let product = verdicts(&Judge::new(node.dev.clone()));
        assert_eq!(product.len(), 4);
        for reason in &product {
            let reason = reason.as_deref().unwrap_or("healthy");
            assert!(
                reason.ends_with("is a regular file, not a character device"),
                "{reason}"
            );
        }
        assert_eq!(verdicts(&node.judge()), [None, None, None, None]);
        assert_eq!(
            verdicts(&Judge::new(node.dev.clone()).accepting_regular_files(false)),
            product
        );
    }

    #[test]
    fn only_a_clear_n_in_netns_mode_means_exclusive() {
        let root = tempfile::tempdir().unwrap();
        let (node, _) =
            simulate::FakeNode::build(root.path(), simulate::Shape::NoEfa, simulate::Nodes::Files)
                .unwrap();
        assert!(
            !rdma_netns_exclusive(&node.sysfs),
            "Y, the kernel's default"
        );
        node.set_rdma_netns_mode(Some("N")).unwrap();
        assert!(rdma_netns_exclusive(&node.sysfs));
        assert!(observe(&node.sysfs, DeviceIdStrategy::default(), &node.judge()).netns_exclusive);
        node.set_rdma_netns_mode(None).unwrap();
        assert!(!rdma_netns_exclusive(&node.sysfs), "no ib_core: shared");
        let parameter = node.sysfs.join("module/ib_core/parameters/netns_mode");
        nix::unistd::mkfifo(&parameter, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(!rdma_netns_exclusive(&node.sysfs), "a FIFO is no answer");
    }

    /// A p4d node and a monitor of it that has not run yet, with a reader of what it publishes.
    /// Destructure it binding `_root`: left to `..`, the tree would be removed at once.
    struct Monitored {
        _root: tempfile::TempDir,
        node: simulate::FakeNode,
        devices: Vec<simulate::FakeDevice>,
        state: DeviceReader,
        monitor: Monitor,
    }

    fn monitored_p4d() -> Monitored {
        let root = tempfile::tempdir().unwrap();
        let (node, devices) =
            simulate::FakeNode::build(root.path(), simulate::Shape::P4d, simulate::Nodes::Files)
                .unwrap();
        let state = DeviceState::unguarded();
        let (state, writer) = (state.reader(), state);
        let monitor = Monitor::new(
            node.sysfs.clone(),
            node.judge(),
            Duration::from_secs(5),
            writer,
        );
        Monitored {
            _root: root,
            node,
            devices,
            state,
            monitor,
        }
    }

    #[tokio::test]
    async fn the_netns_mode_reaches_the_snapshot_on_each_rescan() {
        let Monitored {
            _root,
            node,
            state,
            mut monitor,
            ..
        } = monitored_p4d();
        monitor.refresh().await;
        assert!(!state.current().netns_exclusive());
        node.set_rdma_netns_mode(Some("N")).unwrap();
        monitor.refresh().await;
        assert!(state.current().netns_exclusive());
        assert_eq!(state.current().healthy_count(), 4, "devices untouched");
        node.set_rdma_netns_mode(Some("Y")).unwrap();
        monitor.refresh().await;
        assert!(!state.current().netns_exclusive());
    }

    /// The rule through a monitor: one warning when the queue closes, none while it stays
    /// closed whatever the count, Healthy again when the device is probed again (counters at 0).
    #[tokio::test]
    async fn an_efa_whose_admin_queue_closes_is_unhealthy_until_its_counter_reads_zero() {
        let Monitored {
            _root,
            node,
            devices,
            state,
            mut monitor,
            ..
        } = monitored_p4d();
        let log = crate::testkit::log::Log::default();
        let _capture = log.capture();
        let failing = &devices[1];
        let verdict = |state: &DeviceReader| {
            let inventory = state.current();
            let record = inventory.devices().find(|d| d.efa.ibdev == failing.ibdev);
            record.unwrap().verdict.clone()
        };
        monitor.refresh().await;
        assert_eq!(state.current().healthy_count(), 4);

        node.set_device_counter(failing, "no_completion_cmds", 1)
            .unwrap();
        monitor.refresh().await;
        assert_eq!(state.current().healthy_count(), 3);
        assert_eq!(verdict(&state).cause, Some(Failure::AdminQueueClosed));
        let reason = verdict(&state).reason.unwrap();
        assert!(reason.contains("no_completion_cmds is 1"), "{reason}");

        node.set_device_counter(failing, "no_completion_cmds", 4)
            .unwrap();
        monitor.refresh().await;
        assert_eq!(verdict(&state).health, Health::Unhealthy);
        let warnings = log.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("device unhealthy") && warnings[0].contains("admin queue"),
            "{warnings:?}"
        );

        node.set_device_counter(failing, "no_completion_cmds", 0)
            .unwrap();
        monitor.refresh().await;
        assert_eq!(verdict(&state), Verdict::healthy());
        assert_eq!(state.current().healthy_count(), 4);
    }

    #[test]
    fn the_admin_queue_rule_can_be_turned_off_and_leaves_other_causes_first() {
        let root = tempfile::tempdir().unwrap();
        let (node, devices) =
            simulate::FakeNode::build(root.path(), simulate::Shape::P4d, simulate::Nodes::Files)
                .unwrap();
        for device in &devices[..2] {
            node.set_device_counter(device, "no_completion_cmds", 2)
                .unwrap();
        }
        node.remove_node(&devices[1]).unwrap();
        let causes = |judge: &Judge| -> Vec<Option<Failure>> {
            observe(&node.sysfs, DeviceIdStrategy::default(), judge)
                .records
                .into_iter()
                .map(|record| record.verdict.cause)
                .collect()
        };
        assert_eq!(
            causes(&node.judge()),
            [
                Some(Failure::AdminQueueClosed),
                Some(Failure::DeviceNode),
                None,
                None
            ]
        );
        assert_eq!(
            causes(&node.judge().checking_admin_queue(false)),
            [None, Some(Failure::DeviceNode), None, None]
        );
    }

    fn listed(state: &DeviceReader) -> Vec<(String, String, Health)> {
        state
            .current()
            .devices()
            .map(|d| (d.efa.id.clone(), d.efa.ibdev.clone(), d.verdict.health))
            .collect()
    }

    fn holding(ids: &[&str]) -> Holdings {
        let holder = Arc::new(crate::state::Holder {
            namespace: "ml".into(),
            pod: "trainer-0".into(),
            container: "main".into(),
        });
        Holdings {
            known: true,
            holders: ids
                .iter()
                .map(|id| ((*id).to_owned(), vec![Arc::clone(&holder)]))
                .collect(),
            ..Holdings::default()
        }
    }

    /// A Bottlerocket node scanned once, whose EFAs the test renames.
    struct Renaming {
        _root: tempfile::TempDir,
        node: simulate::FakeNode,
        devices: Vec<simulate::FakeDevice>,
        state: DeviceReader,
        holdings: Writer<Arc<Holdings>>,
        /// What Allocate gave out lately.
        given: Arc<Recent>,
        monitor: Monitor,
    }

    impl Renaming {
        /// With `held` the IDs pods hold.
        async fn bottlerocket(held: &[&str]) -> Renaming {
            let root = tempfile::tempdir().unwrap();
            let (node, devices) = simulate::FakeNode::build(
                root.path(),
                simulate::Shape::Bottlerocket,
                simulate::Nodes::Files,
            )
            .unwrap();
            let state = DeviceState::unguarded();
            let holdings = Writer::new(Arc::new(holding(held)));
            let (state, writer) = (state.reader(), state);
            let given = Arc::new(Recent::new(crate::allocation::recent::WINDOW));
            let mut monitor = Monitor::new(
                node.sysfs.clone(),
                node.judge(),
                Duration::from_secs(5),
                writer,
            )
            .with_holdings(holdings.reader(), Some(given.clone()));
            monitor.refresh().await;
            Renaming {
                _root: root,
                node,
                devices,
                state,
                holdings,
                given,
                monitor,
            }
        }

        /// Renames the `index`th EFA to `to`, and rescans.
        async fn rename(&mut self, index: usize, to: &str) {
            self.node.rename(&self.devices[index], to).unwrap();
            self.monitor.refresh().await;
        }
    }

    /// udev names an EFA `efa_N` when the driver registers it and renames it a moment later; a
    /// scan in between saw the first name. No pod can hold it yet: it makes way at once.
    #[tokio::test]
    async fn a_udev_rename_nobody_holds_lists_the_efa_once_under_its_new_name() {
        let mut at = Renaming::bottlerocket(&[]).await;
        assert_eq!(at.state.current().devices().len(), 4);

        at.rename(0, "rdmap16s27").await;
        let healthy = Health::Healthy;
        assert_eq!(
            listed(&at.state),
            [
                ("efa_1".into(), "efa_1".into(), healthy),
                ("efa_2".into(), "efa_2".into(), healthy),
                ("efa_3".into(), "efa_3".into(), healthy),
                ("rdmap16s27".into(), "rdmap16s27".into(), healthy),
            ]
        );
    }

    /// A rename right after Allocate gave the EFA out, before PodResources lists the pod: the
    /// ID it was given under stays, as it would for a pod PodResources lists.
    #[tokio::test(start_paused = true)]
    async fn a_rename_right_after_allocate_keeps_the_id_given_out() {
        let mut at = Renaming::bottlerocket(&[]).await;
        at.given.record(&["efa_2".to_owned()]);
        at.rename(2, "rdmap144s27").await;
        let ids: Vec<String> = listed(&at.state).into_iter().map(|(id, ..)| id).collect();
        assert_eq!(ids, ["efa_0", "efa_1", "efa_2", "efa_3"]);

        // Once the record forgets it, and PodResources never showed it held, it makes way.
        tokio::time::sleep(crate::allocation::recent::WINDOW * 2).await;
        at.monitor.refresh().await;
        let ids: Vec<String> = listed(&at.state).into_iter().map(|(id, ..)| id).collect();
        assert_eq!(ids, ["efa_0", "efa_1", "efa_3", "rdmap144s27"]);
    }

    /// `rdma dev set` while a pod holds the EFA: the kubelet keeps the old ID allocated, so the
    /// EFA stays listed under it alone until no pod holds it; the new name is never listed
    /// beside it, where the kubelet would count it free and give the EFA to a second pod.
    #[tokio::test]
    async fn a_renamed_efa_that_a_pod_holds_keeps_its_id_until_released() {
        let mut at = Renaming::bottlerocket(&["efa_1"]).await;
        at.rename(1, "rdmap32s27").await;
        let state = at.state.clone();
        let ids = |state: &DeviceReader| -> Vec<String> {
            listed(state).into_iter().map(|(id, _, _)| id).collect()
        };
        assert_eq!(ids(&state), ["efa_0", "efa_1", "efa_2", "efa_3"]);
        let current = state.current();
        let held = current.get("efa_1").unwrap();
        assert!(held.is_healthy(), "{held:?}");
        assert_eq!(held.efa.ibdev, "rdmap32s27", "read through its new entry");
        assert_eq!(held.efa.uverbs, "uverbs1");

        // Unknown holders are treated as holding it.
        at.holdings.send_replace(Arc::new(Holdings::default()));
        at.monitor.refresh().await;
        assert_eq!(ids(&state), ["efa_0", "efa_1", "efa_2", "efa_3"]);

        at.holdings.send_replace(Arc::new(holding(&[])));
        at.monitor.refresh().await;
        assert_eq!(ids(&state), ["efa_0", "efa_2", "efa_3", "rdmap32s27"]);
        assert_eq!(state.current().healthy_count(), 4);
    }

    #[test]
    fn liveness_fails_after_repeated_failures_or_a_stalled_monitor() {
        let stats = ScanStats::new(Duration::from_secs(5));
        assert_eq!(stats.liveness(), Ok(()));
        for _ in 0..FAILED_PASSES - 1 {
            assert!(!stats.finished(Some("EIO listing class/infiniband".into())));
        }
        assert_eq!(
            stats.liveness(),
            Ok(()),
            "a failure or two is retried quietly"
        );
        stats.finished(Some("EIO listing class/infiniband".into()));
        let reason = stats.liveness().unwrap_err();
        assert!(
            reason.contains("last 3 sysfs scans failed") && reason.contains("EIO"),
            "{reason}"
        );
        assert!(stats.finished(None), "the first good pass ends the run");
        assert_eq!(stats.liveness(), Ok(()));

        stats.lock().last_pass = Instant::now() - Duration::from_secs(18);
        let reason = stats.liveness().unwrap_err();
        assert!(
            reason.contains("no sysfs scan has finished for 18s"),
            "{reason}"
        );
    }
}
