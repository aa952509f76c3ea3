//! Prometheus metrics: the plugin's own state, Allocate outcomes, and the EFA hardware counters.
//!
//! Device and registration figures are read from the live state when scraped, so they cannot
//! drift from what the kubelet is told. Only Allocate, which leaves no trace in that state,
//! keeps counters of its own.
//!
//! Every family's name, type, HELP text and labels are its row of the metrics table
//! ([`super::families`]); this module only reads the values and writes them through the rows.

use std::convert::Infallible;
use std::fmt::{self, Write as _};
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Instant;

use hyper::body::{Bytes, Frame};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, prometheus_text};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::counters::{CounterFiles, DeviceCounters};
use super::families::{self, Family};
use crate::allocation::metrics::AllocationMetrics;
use crate::health::ScanStats;
use crate::state::{DeviceReader, Failure, Holdings, Reader, StatusReader};

/// The `Content-Type` of what [`Metrics::scrape`] returns.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Everything `/metrics` shows.
pub struct Metrics {
    registry: Registry,
    state: DeviceReader,
    counters: Arc<CounterFiles>,
    holdings: Reader<Arc<Holdings>>,
    /// Whether scrapes name the containers holding each device.
    pod_labels: bool,
    /// When the latest scrape was taken, and the scrape while a client still reads it.
    turn: tokio::sync::Mutex<Option<(Instant, Weak<Scrape>)>>,
}

impl Metrics {
    pub fn new(
        state: DeviceReader,
        status: StatusReader,
        allocations: &AllocationMetrics,
        scans: Arc<ScanStats>,
        sysfs_root: &Path,
        holdings: Reader<Arc<Holdings>>,
        pod_labels: bool,
    ) -> Self {
        let mut registry = Registry::default();
        let (outcomes, duration) = allocations.series();
        families::ALLOCATIONS.register(&mut registry, outcomes);
        families::ALLOCATE_DURATION.register(&mut registry, duration);
        registry.register_collector(Box::new(PluginCollector {
            state: state.clone(),
            status,
            scans,
            holdings: holdings.clone(),
        }));
        Metrics {
            registry,
            state,
            counters: Arc::new(CounterFiles::new(sysfs_root)),
            holdings,
            pod_labels,
            turn: tokio::sync::Mutex::new(None),
        }
    }

    /// Adds a counter that another module keeps, such as the CDI spec's failed writes, as the
    /// family the metrics table names.
    pub fn register_counter(&mut self, family: &Family, counter: Counter) {
        family.register(&mut self.registry, counter);
    }

    /// The exposition text of one scrape, written as it is sent: the plugin's own metrics, the
    /// hardware counters, then who holds each EFA.
    ///
    /// Scrapes are taken one at a time, and a scrape asked for while another was being taken
    /// shares the next one: however many clients ask at once, few scrapes exist at a time, and
    /// none is ever held as a whole text.
    pub async fn scrape(&self) -> ScrapeBody {
        let asked = Instant::now();
        let mut latest = self.turn.lock().await;
        let fresh = latest
            .as_ref()
            .filter(|(taken, _)| *taken >= asked)
            .and_then(|(_, scrape)| scrape.upgrade());
        let scrape = match fresh {
            Some(scrape) => scrape,
            None => {
                let taken = Instant::now();
                let scrape = Arc::new(self.take().await);
                *latest = Some((taken, Arc::downgrade(&scrape)));
                scrape
            }
        };
        ScrapeBody {
            scrape,
            part: Part::Plugin,
            headed: false,
        }
    }

    async fn take(&self) -> Scrape {
        let devices: Vec<(String, String)> = self
            .state
            .current()
            .devices()
            .map(|d| (d.efa.id.clone(), d.efa.ibdev.clone()))
            .collect();
        let counters = self.counters.clone();
        // Reading 600 counter files is the bulk of a scrape; done off the runtime thread, it
        // cannot delay an Allocate.
        let counters = tokio::task::spawn_blocking(move || counters.read(&devices))
            .await
            .unwrap_or_else(|err| {
            tracing::error!(error = %err, "reading the EFA hardware counters failed; this scrape has none");
            Vec::new()
        });
        let mut plugin = String::with_capacity(8 * 1024);
        // Writing to a String cannot fail.
        let _ = prometheus_text::encode(&mut plugin, &self.registry);
        let mut names: Vec<String> = counters
            .iter()
            .flat_map(|device| device.values.iter().map(|(name, _)| name.clone()))
            .collect();
        names.sort_unstable();
        names.dedup();
        Scrape {
            plugin,
            names,
            counters,
            holdings: self.holdings(),
        }
    }

    /// Who holds which EFA, for one scrape: the background view's latest, shared, not copied;
    /// `None` without pod attribution.
    fn holdings(&self) -> Option<Arc<Holdings>> {
        self.pod_labels.then(|| self.holdings.borrow().clone())
    }
}

/// What one scrape shows, shared by the clients that asked at the same time.
struct Scrape {
    /// The plugin's own metrics, a few KiB whatever the node.
    plugin: String,
    /// Every hardware counter name any device has, sorted: one family each.
    names: Vec<String>,
    counters: Vec<DeviceCounters>,
    holdings: Option<Arc<Holdings>>,
}

/// Where a [`ScrapeBody`] is in its scrape.
#[derive(Clone, Copy, Debug)]
enum Part {
    Plugin,
    /// The `family`th counter name, at the `device`th device.
    Counter {
        family: usize,
        device: usize,
    },
    /// The `holder`th container holding the `device`th device.
    Allocation {
        device: usize,
        holder: usize,
    },
    Done,
}

/// A body piece is sent once it reaches this size, so a client holds at most about this much
/// text of its scrape, however many pods hold the devices.
const CHUNK: usize = 16 * 1024;

/// One scrape's exposition text, rendered piece by piece as the client reads it.
pub struct ScrapeBody {
    scrape: Arc<Scrape>,
    part: Part,
    /// Whether the allocation family's header is out: it comes with its first series.
    headed: bool,
}

impl ScrapeBody {
    /// The next piece of text, about [`CHUNK`] long; `None` at the end.
    fn next_piece(&mut self) -> Option<String> {
        let scrape = &*self.scrape;
        let mut out = String::with_capacity(CHUNK + 1024);
        while out.len() < CHUNK {
            self.part = match self.part {
                Part::Plugin => {
                    out.push_str(&scrape.plugin);
                    Part::Counter {
                        family: 0,
                        device: 0,
                    }
                }
                Part::Counter { family, device } => match scrape.names.get(family) {
                    None => Part::Allocation {
                        device: 0,
                        holder: 0,
                    },
                    Some(name) => match scrape.counters.get(device) {
                        None => Part::Counter {
                            family: family + 1,
                            device: 0,
                        },
                        Some(counters) => {
                            if device == 0 {
                                families::HARDWARE_COUNTER.write_header(&mut out, name);
                            }
                            if let Ok(at) = counters
                                .values
                                .binary_search_by(|(known, _)| known.as_str().cmp(name))
                            {
                                families::HARDWARE_COUNTER.write_name(&mut out, name);
                                labels(
                                    &mut out,
                                    &families::HARDWARE_COUNTER,
                                    &[&counters.device, &counters.ibdev],
                                );
                                let _ = writeln!(out, " {}", counters.values[at].1);
                            }
                            Part::Counter {
                                family,
                                device: device + 1,
                            }
                        }
                    },
                },
                Part::Allocation { device, holder } => match scrape.counters.get(device) {
                    None => Part::Done,
                    Some(counters) => {
                        let held = scrape
                            .holdings
                            .as_ref()
                            .and_then(|h| h.holders.get(&counters.device));
                        match held.and_then(|list| list.get(holder)) {
                            None => Part::Allocation {
                                device: device + 1,
                                holder: 0,
                            },
                            Some(h) => {
                                let family = &families::DEVICE_ALLOCATION;
                                if !self.headed {
                                    family.write_header(&mut out, "");
                                    self.headed = true;
                                }
                                family.write_name(&mut out, "");
                                labels(
                                    &mut out,
                                    family,
                                    &[&counters.device, &h.namespace, &h.pod, &h.container],
                                );
                                out.push_str(" 1\n");
                                Part::Allocation {
                                    device,
                                    holder: holder + 1,
                                }
                            }
                        }
                    }
                },
                Part::Done => break,
            };
        }
        (!out.is_empty()).then_some(out)
    }
}

/// `{name="value",...}`: `family`'s label names with `values` in their order, each value
/// escaped as the text format requires.
fn labels(out: &mut String, family: &Family, values: &[&str]) {
    out.push('{');
    for (i, (name, value)) in family.labels.iter().zip(values).enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(name);
        out.push_str("=\"");
        for c in value.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
}

impl hyper::body::Body for ScrapeBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(
            self.next_piece()
                .map(|text| Ok(Frame::data(Bytes::from(text)))),
        )
    }
}

/// Reads device health and registration figures from the live state at scrape time.
struct PluginCollector {
    state: DeviceReader,
    status: StatusReader,
    scans: Arc<ScanStats>,
    holdings: Reader<Arc<Holdings>>,
}

impl fmt::Debug for PluginCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginCollector").finish_non_exhaustive()
    }
}

impl Collector for PluginCollector {
    /// Each family's HELP, TYPE and label names come from its row of the metrics table; only
    /// the values are read here.
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let inventory = self.state.current();
        let status = self.status.current();
        let healthy = inventory.healthy_count();
        let unhealthy = inventory.devices().len() - healthy;
        let gauge = |value: i64| ConstGauge::new(value);
        let by_health = [(["healthy"], healthy), (["unhealthy"], unhealthy)];
        families::DEVICES.encode(
            &mut encoder,
            by_health.map(|(health, count)| (health, gauge(count as i64))),
        )?;
        let each = inventory.devices().map(|record| {
            let labels = [record.efa.id.as_str(), record.efa.ibdev.as_str()];
            (labels, gauge(i64::from(record.is_healthy())))
        });
        families::DEVICE_HEALTHY.encode(&mut encoder, each)?;
        let by_failure = Failure::ALL.map(|failure| {
            let count = inventory
                .devices()
                .filter(|record| record.verdict.cause == Some(failure))
                .count();
            ([failure.label()], gauge(count as i64))
        });
        families::UNHEALTHY_DEVICES.encode(&mut encoder, by_failure)?;
        // The condition /readyz reports: without a stream the kubelet cannot see the devices.
        let registered = status.registered && status.open_streams > 0;
        families::REGISTERED.encode(&mut encoder, [([], gauge(i64::from(registered)))])?;
        let counters = [
            (&families::REGISTRATIONS, status.registrations),
            (&families::KUBELET_RESTARTS, status.kubelet_restarts),
        ];
        for (family, value) in counters {
            family.encode(&mut encoder, [([], ConstCounter::new(value))])?;
        }
        let errors = self.scans.errors();
        let errors = errors
            .iter()
            .map(|(reason, count)| ([reason.as_str()], ConstCounter::new(*count)));
        families::SCAN_ERRORS.encode(&mut encoder, errors)?;
        let version = [env!("CARGO_PKG_VERSION")];
        families::BUILD_INFO.encode(&mut encoder, [(version, gauge(1))])?;
        let conflict = &families::DRA_CONFLICT;
        match inventory.conflicting_driver() {
            Some(driver) => conflict.encode(&mut encoder, [([driver], gauge(1))])?,
            None => conflict.encode(&mut encoder, [([], gauge(0))])?,
        }
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let holdings = self.holdings.borrow().clone();
        let gauges = [
            (
                &families::COMPETING_PLUGIN,
                i64::from(status.competitor.is_some()),
            ),
            (
                &families::FOREIGN_ALLOCATIONS,
                count(holdings.foreign_ids()),
            ),
            (
                &families::DRA_CONFLICT_HELD_DEVICES,
                count(holdings.unseen_by_dra(&inventory)),
            ),
            (&families::POD_RESOURCES_STALE, i64::from(holdings.stale)),
            (&families::POD_RESOURCES_UNKNOWN, i64::from(!holdings.known)),
            (
                &families::DOUBLE_BOOKED_DEVICES,
                count(holdings.double_booked.len()),
            ),
            (
                &families::RDMA_NETNS_EXCLUSIVE,
                i64::from(inventory.netns_exclusive()),
            ),
        ];
        for (family, value) in gauges {
            family.encode(&mut encoder, [([], gauge(value))])?;
        }
        Ok(())
    }
}
