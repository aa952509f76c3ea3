//! The DRA-conflict guard: while a DRA driver that manages EFAs is registered on the node, the
//! plugin withholds every device.
//!
//! A device plugin cannot see ResourceClaims, so a DRA driver (DRANET's `dra.net`) and this
//! plugin would hand the same EFA to two pods without either noticing. The kubelet registers
//! DRA drivers through sockets in its `plugins_registry` dir, named after the driver
//! (`dra.net-reg.sock`); their presence is the signal. Withholding keeps capacity visible, so an
//! operator sees why allocatable dropped to zero, and the conflict ends by itself when the
//! driver goes.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::rescan::Rescans;
use crate::state::{Conflict, DeviceState};

/// While a conflict lasts it is logged again this often, so it is in any recent log excerpt.
const REMIND_EVERY: Duration = Duration::from_secs(60);

pub(crate) struct Guard {
    pub dir: PathBuf,
    pub drivers: Vec<String>,
    /// The extended resource a DeviceClass would have to map for DRA to take the node over.
    pub resource_name: String,
    /// How often to look again when inotify cannot watch the dir (it may not exist yet).
    pub interval: Duration,
    pub state: DeviceState,
    last_logged: Option<Instant>,
    /// How the dir is searched; a field only so a test can stand in for a slow listing.
    find: Finder,
}

type Finder = fn(&Path, &[String]) -> Option<(String, PathBuf)>;

/// The first socket in `dir` named after one of `drivers`, as `(driver, path)`.
pub(crate) fn find_driver(dir: &Path, drivers: &[String]) -> Option<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_socket()))
        .filter_map(|entry| {
            let name = entry.file_name();
            let name = name.to_str()?;
            let driver = drivers.iter().find(|d| registers(name, d))?;
            Some((driver.clone(), entry.path()))
        })
        .collect();
    found.sort();
    found.into_iter().next()
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
        state: DeviceState,
    ) -> Self {
        Guard {
            dir,
            drivers,
            resource_name,
            interval,
            state,
            last_logged: None,
            find: find_driver,
        }
    }

    /// Looks once and updates the device state; logs when a conflict starts or ends, and
    /// reminds of an ongoing one once a minute. The listing runs on the blocking pool: a
    /// crowded or slow dir must not stall the RPCs and probes that share the runtime thread.
    pub(crate) async fn refresh(&mut self) {
        let (dir, drivers, find) = (self.dir.clone(), self.drivers.clone(), self.find);
        let found = match tokio::task::spawn_blocking(move || find(&dir, &drivers)).await {
            Ok(found) => found,
            Err(err) => {
                // The last verdict stands until a later pass gets through.
                tracing::error!(error = %err, "looking for DRA drivers failed");
                return;
            }
        };
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
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex, mpsc};

    static GATE: Mutex<Option<mpsc::Receiver<()>>> = Mutex::new(None);
    static RELEASED: AtomicBool = AtomicBool::new(false);

    /// A listing that lasts until a task on the runtime thread releases it: were it run on
    /// that thread, the task could not run and the listing would give up after 5 s.
    fn gated_find(_: &Path, _: &[String]) -> Option<(String, PathBuf)> {
        let gate = GATE.lock().unwrap().take().expect("gate set");
        let released = gate.recv_timeout(Duration::from_secs(5)).is_ok();
        RELEASED.store(released, Ordering::SeqCst);
        None
    }

    #[tokio::test]
    async fn a_slow_listing_leaves_the_runtime_thread_free() {
        let (release, gate) = mpsc::channel();
        *GATE.lock().unwrap() = Some(gate);
        let mut guard = Guard::new(
            PathBuf::from("/nonexistent"),
            vec!["dra.net".into()],
            "vpc.amazonaws.com/efa".into(),
            Duration::from_secs(1),
            DeviceState::default(),
        );
        guard.find = gated_find;
        let releaser = tokio::spawn(async move { release.send(()).unwrap() });
        guard.refresh().await;
        releaser.await.unwrap();
        assert!(
            RELEASED.load(Ordering::SeqCst),
            "the listing blocked the runtime thread"
        );
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
            find_driver(dir.path(), &drivers),
            None,
            "a regular file is no registration"
        );

        let _dra =
            std::os::unix::net::UnixListener::bind(dir.path().join("dra.net-reg2.sock")).unwrap();
        let (driver, path) = find_driver(dir.path(), &drivers).unwrap();
        assert_eq!(driver, "dra.net");
        assert!(path.ends_with("dra.net-reg2.sock"));
        assert_eq!(find_driver(&dir.path().join("absent"), &drivers), None);
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
