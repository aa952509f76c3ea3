//! The DRA-conflict guard: while a DRA driver that manages EFAs is registered on the node, the
//! plugin withholds every device.
//!
//! A device plugin cannot see ResourceClaims, so a DRA driver (DRANET's `dra.net`) and this
//! plugin would hand the same EFA to two pods without either noticing. The kubelet registers
//! DRA drivers through sockets in its `plugins_registry` dir, named after the driver
//! (`dra.net-reg.sock`); their presence is the signal. Withholding keeps capacity visible, so an
//! operator sees why allocatable dropped to zero, and the conflict ends by itself when the
//! driver goes.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::rescan::Rescans;
use crate::state::{Conflict, ConflictWriter};

/// While a conflict lasts it is logged again this often, so it is in any recent log excerpt.
const REMIND_EVERY: Duration = Duration::from_secs(60);
/// A listing of the dir takes microseconds; one still running after this (a hung filesystem) is
/// left to finish on its own, and no other starts until it has.
const LISTING_DEADLINE: Duration = Duration::from_secs(2);

pub(crate) struct Guard {
    pub dir: PathBuf,
    pub drivers: Vec<String>,
    /// The extended resource a DeviceClass would have to map for DRA to take the node over.
    pub resource_name: String,
    /// How often to look again when inotify cannot watch the dir (it may not exist yet).
    pub interval: Duration,
    pub state: ConflictWriter,
    last_logged: Option<Instant>,
    /// A listing that overran [`LISTING_DEADLINE`] and has not finished yet.
    listing: Option<JoinHandle<Listing>>,
    /// Why the dir could not be listed, as logged; `None` while listings work.
    trouble: Option<String>,
    /// How the dir is searched; a field only so a test can stand in for a slow listing.
    find: Finder,
}

type Listing = io::Result<Option<(String, PathBuf)>>;
type Finder = Arc<dyn Fn(&Path, &[String]) -> Listing + Send + Sync>;

/// The first socket in `dir` named after one of `drivers`, as `(driver, path)`. An absent dir
/// holds no registration (the kubelet creates it with its plugin manager); any other error
/// says nothing either way, and is returned.
pub(crate) fn find_driver(dir: &Path, drivers: &[String]) -> Listing {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(err),
    };
    let mut found = Vec::new();
    for entry in entries {
        // An entry the listing could not read might be the driver's socket.
        let entry = entry?;
        if !entry.file_type().is_ok_and(|t| t.is_socket()) {
            continue;
        }
        let name = entry.file_name();
        let Some(driver) = name
            .to_str()
            .and_then(|name| drivers.iter().find(|d| registers(name, d)))
        else {
            continue;
        };
        found.push((driver.clone(), entry.path()));
    }
    found.sort();
    Ok(found.into_iter().next())
}

/// Why every EFA is withheld while `driver` is registered at `socket`, and what decides whether
/// DRA serves `resource_name` on the node instead: the scheduler hands a resource at allocatable
/// 0 to DRA where the DRAExtendedResource feature is on (by default from Kubernetes 1.36), but
/// only through a DeviceClass that maps it, which the plugin has no credentials to read.
pub(crate) fn describe(driver: &str, socket: &Path, resource_name: &str) -> String {
    format!(
        "DRA driver {driver} is registered on this node ({}) and allocates the same EFAs; the \
         device plugin withholds them (allocatable 0) until it goes, or run with \
         --allow-dra-coexistence. Pods asking for {resource_name} get EFAs here through DRA only \
         on Kubernetes 1.36+ (DRAExtendedResource) with a DeviceClass whose \
         spec.extendedResourceName is {resource_name} (check kubectl get deviceclasses); pods already holding EFAs through \
         this plugin are invisible to {driver}",
        socket.display()
    )
}

/// Whether a socket called `name` registers `driver`, by the kubelet's naming rule for
/// `plugins_registry`: `<driver>[-<suffix>].sock`. The DRA helper library names its socket
/// `<driver>-reg.sock`, or `<driver>-<pod uid>-reg.sock` with rolling updates. A bare prefix
/// would let `dra.netapp.io-reg.sock` count as `dra.net`.
fn registers(name: &str, driver: &str) -> bool {
    name.strip_prefix(driver)
        .and_then(|rest| rest.strip_suffix(".sock"))
        .is_some_and(|suffix| suffix.is_empty() || suffix.starts_with('-'))
}

impl Guard {
    pub(crate) fn new(
        dir: PathBuf,
        drivers: Vec<String>,
        resource_name: String,
        interval: Duration,
        state: ConflictWriter,
    ) -> Self {
        Guard {
            dir,
            drivers,
            resource_name,
            interval,
            state,
            last_logged: None,
            listing: None,
            trouble: None,
            find: Arc::new(find_driver),
        }
    }

    /// Looks once and updates the device state; logs when a conflict starts or ends, and
    /// reminds of an ongoing one once a minute. The listing runs on the blocking pool: a
    /// crowded or slow dir must not stall the RPCs and probes that share the runtime thread.
    /// A dir that cannot be listed, or whose listing hangs, leaves the verdict as it was: an
    /// error is no evidence that a driver went, and failing open would hand out EFAs that a
    /// registered driver also allocates.
    pub(crate) async fn refresh(&mut self) {
        let mut listing = match self.listing.take() {
            Some(running) if !running.is_finished() => {
                self.listing = Some(running);
                return;
            }
            // A hung listing that has finished since is stale: list again.
            _ => {
                let (dir, drivers, find) =
                    (self.dir.clone(), self.drivers.clone(), self.find.clone());
                tokio::task::spawn_blocking(move || find(&dir, &drivers))
            }
        };
        let found = match tokio::time::timeout(LISTING_DEADLINE, &mut listing).await {
            Ok(Ok(Ok(found))) => found,
            Ok(Ok(Err(err))) => return self.cannot_list(err.to_string()),
            Ok(Err(err)) => return self.cannot_list(format!("the listing failed: {err}")),
            Err(_) => {
                self.listing = Some(listing);
                return self.cannot_list(format!(
                    "the listing takes longer than {LISTING_DEADLINE:?}"
                ));
            }
        };
        if self.trouble.take().is_some() {
            tracing::info!(dir = %self.dir.display(), "the plugins_registry dir can be listed again");
        }
        let conflict = found.map(|(driver, socket)| Conflict {
            reason: describe(&driver, &socket, &self.resource_name),
            driver,
        });
        let now = Instant::now();
        let changed = self.state.set_conflict(conflict.clone());
        match conflict {
            Some(Conflict { driver, reason })
                if changed || self.last_logged.is_none_or(|t| now - t >= REMIND_EVERY) =>
            {
                tracing::error!(
                    driver = %driver,
                    conflict = %reason,
                    devices = self.state.current().devices().len(),
                    "every EFA is withheld from allocation"
                );
                self.last_logged = Some(now);
            }
            Some(_) => {}
            None if changed => {
                tracing::info!(
                    dir = %self.dir.display(),
                    "no EFA DRA driver is registered any more; devices are advertised again"
                );
                self.last_logged = None;
            }
            None => {}
        }
    }

    /// Logs why the dir cannot be listed, once while the reason lasts.
    fn cannot_list(&mut self, why: String) {
        if self.trouble.as_ref() == Some(&why) {
            return;
        }
        tracing::warn!(
            dir = %self.dir.display(),
            error = %why,
            conflict = self.state.current().conflict().is_some(),
            "cannot list the plugins_registry dir; the DRA conflict verdict stays as it was until it can"
        );
        self.trouble = Some(why);
    }

    /// Re-checks on every change of the dir, and every `interval` in any case.
    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        let mut rescans = Rescans::every(self.interval, shutdown).watching(self.dir.clone());
        while rescans.due().await {
            self.refresh().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Mutex, mpsc};

    fn guard(dir: &Path) -> Guard {
        Guard::new(
            dir.to_owned(),
            vec!["dra.net".into()],
            "vpc.amazonaws.com/efa".into(),
            Duration::from_secs(1),
            crate::state::DeviceState::with_conflict_writer().1,
        )
    }

    /// A listing that lasts until `gate` is released (or dropped), counting its calls.
    fn gated(gate: mpsc::Receiver<()>, calls: Arc<AtomicUsize>) -> Finder {
        let gate = Mutex::new(gate);
        Arc::new(move |_: &Path, _: &[String]| {
            calls.fetch_add(1, Ordering::SeqCst);
            let _ = gate.lock().unwrap().recv();
            Ok(None)
        })
    }

    #[tokio::test]
    async fn a_slow_listing_leaves_the_runtime_thread_free() {
        let (release, gate) = mpsc::channel();
        let mut guard = guard(Path::new("/nonexistent"));
        guard.find = gated(gate, Arc::default());
        // Were the listing run on the runtime thread, this task could not run to release it.
        let releaser = tokio::spawn(async move { release.send(()).unwrap() });
        guard.refresh().await;
        releaser.await.unwrap();
        assert!(guard.listing.is_none(), "the listing finished in time");
    }

    #[tokio::test]
    async fn a_hung_listing_is_one_thread_however_many_passes_wait_on_it() {
        let (release, gate) = mpsc::channel();
        let calls = Arc::new(AtomicUsize::new(0));
        let mut guard = guard(Path::new("/nonexistent"));
        guard.find = gated(gate, calls.clone());
        let reason = "dra.net at /x".to_owned();
        guard.state.set_conflict(Some(Conflict {
            driver: "dra.net".to_owned(),
            reason: reason.clone(),
        }));
        let started = std::time::Instant::now();
        for _ in 0..500 {
            guard.refresh().await;
        }
        // The first pass gave up at the deadline; the others found it still running.
        assert!(
            started.elapsed() < LISTING_DEADLINE * 2,
            "{:?}",
            started.elapsed()
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one listing in flight");
        assert!(guard.trouble.is_some());
        assert_eq!(guard.state.current().conflict(), Some(reason.as_str()));

        drop(release);
        while !guard.listing.as_ref().is_some_and(JoinHandle::is_finished) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        guard.refresh().await;
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "a fresh listing after it ended"
        );
        assert_eq!(guard.state.current().conflict(), None);
        assert!(guard.trouble.is_none());
    }

    #[tokio::test]
    async fn a_registry_that_cannot_be_listed_keeps_the_last_verdict() {
        let root = tempfile::tempdir().unwrap();
        let registry = root.path().join("plugins_registry");
        std::fs::create_dir(&registry).unwrap();
        let socket = registry.join("dra.net-reg.sock");
        let _dranet = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mut guard = guard(&registry);
        guard.refresh().await;
        let conflict = guard.state.current().conflict().map(str::to_owned);
        assert!(conflict.is_some());

        // Not a directory: ENOTDIR, no evidence that the driver went.
        let aside = root.path().join("aside");
        std::fs::rename(&registry, &aside).unwrap();
        std::fs::write(&registry, "").unwrap();
        guard.refresh().await;
        guard.refresh().await;
        assert_eq!(guard.state.current().conflict(), conflict.as_deref());
        assert!(
            guard
                .trouble
                .as_deref()
                .is_some_and(|t| t.contains("Not a directory"))
        );

        std::fs::remove_file(&registry).unwrap();
        std::fs::rename(&aside, &registry).unwrap();
        std::fs::remove_file(&socket).unwrap();
        guard.refresh().await;
        assert_eq!(guard.state.current().conflict(), None, "the driver went");
        assert!(guard.trouble.is_none());
    }

    #[test]
    fn only_sockets_named_after_a_listed_driver_count() {
        let dir = tempfile::tempdir().unwrap();
        let drivers = vec!["dra.net".to_owned()];
        std::fs::write(dir.path().join("dra.net-reg.sock"), b"").unwrap();
        let _other =
            std::os::unix::net::UnixListener::bind(dir.path().join("gpu.nvidia.com-reg.sock"))
                .unwrap();
        assert_eq!(
            find_driver(dir.path(), &drivers).unwrap(),
            None,
            "a regular file is no registration"
        );

        let _dra =
            std::os::unix::net::UnixListener::bind(dir.path().join("dra.net-reg2.sock")).unwrap();
        let (driver, path) = find_driver(dir.path(), &drivers).unwrap().unwrap();
        assert_eq!(driver, "dra.net");
        assert!(path.ends_with("dra.net-reg2.sock"));
        assert_eq!(
            find_driver(&dir.path().join("absent"), &drivers).unwrap(),
            None,
            "an absent dir holds no registration"
        );
    }

    #[test]
    fn a_driver_matches_by_the_kubelets_naming_rule_not_by_prefix() {
        for (name, matches) in [
            ("dra.net-reg.sock", true),
            ("dra.net.sock", true),
            ("dra.net-0b7e6c4d-reg.sock", true),
            ("dra.netapp.io-reg.sock", false),
            ("dra.netapp.io.sock", false),
            ("dra.net", false),
            ("dra.net-reg.sock.old", false),
            ("dra.network-reg.sock", false),
            ("xdra.net-reg.sock", false),
        ] {
            assert_eq!(registers(name, "dra.net"), matches, "{name}");
        }
    }
}
