//! Traffic on `efa-a`'s EFAs, as the driver's counters show it: the counters the fake p4d tree
//! lacks, as a Nitro v4 EFA has them, written into the tree every second, each higher than the
//! last (traffic, drops, RDMA work-request errors, retransmissions, remote events), so that
//! rates, `increase` and the counter alerts have something to see.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use efa_device_plugin::testkit::simulate::{FakeDevice, FakeNode};

const PORT_COUNTERS: [&str; 10] = [
    "tx_bytes",
    "rx_bytes",
    "rx_drops",
    "rdma_read_bytes",
    "rdma_read_wr_err",
    "rdma_write_wr_err",
    "retrans_pkts",
    "retrans_timeout_events",
    "unresponsive_remote_events",
    "impaired_remote_conn_events",
];
const DEVICE_COUNTERS: [&str; 2] = ["submitted_cmds", "cmds_err"];
const EVERY: Duration = Duration::from_secs(1);

/// The counters rising in the background until dropped.
pub struct RisingCounters {
    stop: Arc<AtomicBool>,
    /// The last write that failed, which leaves the counters where they were.
    failure: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl RisingCounters {
    /// Writes the first values, then raises them every second. Also says whether a counter file
    /// was missing before: a running plugin opens an EFA's counter files once, as the driver's
    /// set is fixed while it is loaded, so only a new plugin pod reads the files laid now.
    pub fn start(fake: FakeNode, efas: Vec<FakeDevice>) -> Result<(RisingCounters, bool)> {
        let laid_now = efas.iter().any(|efa| {
            let ibdev = fake.sysfs.join("class/infiniband").join(&efa.ibdev);
            PORT_COUNTERS
                .iter()
                .map(|counter| ibdev.join("ports/1/hw_counters").join(counter))
                .chain(
                    DEVICE_COUNTERS
                        .iter()
                        .map(|counter| ibdev.join("hw_counters").join(counter)),
                )
                .any(|file| !file.exists())
        });
        raise(&fake, &efas, 1)?;
        let stop = Arc::new(AtomicBool::new(false));
        let failure = Arc::new(Mutex::new(None));
        let thread = {
            let (stop, failure) = (Arc::clone(&stop), Arc::clone(&failure));
            thread::spawn(move || {
                let mut round = 2;
                while !stop.load(Ordering::Relaxed) {
                    thread::sleep(EVERY);
                    if let Err(err) = raise(&fake, &efas, round) {
                        *failure
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner()) =
                            Some(format!("{err:#}"));
                    }
                    round += 1;
                }
            })
        };
        let counters = RisingCounters {
            stop,
            failure,
            thread: Some(thread),
        };
        Ok((counters, laid_now))
    }

    /// An error if a write has failed since the start.
    pub fn check(&self) -> Result<()> {
        let failure = self
            .failure
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match &*failure {
            Some(failure) => bail!("the counters stopped rising: {failure}"),
            None => Ok(()),
        }
    }
}

impl Drop for RisingCounters {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Round `round`'s values: port counters in the millions, told apart by EFA; device counters
/// one per round.
fn raise(fake: &FakeNode, efas: &[FakeDevice], round: u64) -> Result<()> {
    for (i, efa) in (0u64..).zip(efas) {
        for counter in PORT_COUNTERS {
            fake.set_port_counter(efa, counter, round * 1_000_000 + i)
                .with_context(|| format!("{} {counter}", efa.ibdev))?;
        }
        for counter in DEVICE_COUNTERS {
            fake.set_device_counter(efa, counter, round)
                .with_context(|| format!("{} {counter}", efa.ibdev))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs;

    use efa_device_plugin::testkit::simulate::{Nodes, Shape};

    use super::*;

    #[test]
    fn the_missing_counters_are_laid_and_then_rise() {
        let dir = tempfile::tempdir().unwrap();
        let (fake, devices) = FakeNode::build(dir.path(), Shape::P4d, Nodes::Files).unwrap();
        let efas: Vec<FakeDevice> = devices.into_iter().filter(FakeDevice::is_efa).collect();
        let drops = fake
            .sysfs
            .join("class/infiniband")
            .join(&efas[1].ibdev)
            .join("ports/1/hw_counters/rx_drops");
        let read = || {
            fs::read_to_string(&drops)
                .unwrap()
                .trim()
                .parse::<u64>()
                .unwrap()
        };

        let (counters, laid_now) = RisingCounters::start(fake.clone(), efas.clone()).unwrap();
        assert!(laid_now);
        assert_eq!(read(), 1_000_001);
        thread::sleep(EVERY * 2);
        assert!(read() > 1_000_001);
        counters.check().unwrap();
        drop(counters);

        let (_again, laid_now) = RisingCounters::start(fake, efas).unwrap();
        assert!(!laid_now);
    }
}
