//! Prometheus metrics: the plugin's own state, Allocate outcomes, and the EFA hardware counters.
//!
//! Device and registration figures are read from the live state when scraped, so they cannot
//! drift from what the kubelet is told. Only Allocate, which leaves no trace in that state,
//! keeps counters of its own.

use std::convert::Infallible;
use std::fmt::{self, Write as _};
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Instant;

use hyper::body::{Bytes, Frame};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, prometheus_text};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use super::counters::{CounterFiles, DeviceCounters};
use crate::allocation::metrics::AllocationMetrics;
use crate::health::ScanStats;
use crate::state::{DeviceReader, Holdings, StatusReader};

/// The `Content-Type` of what [`Metrics::scrape`] returns.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Everything `/metrics` shows.
pub struct Metrics {
    registry: Registry,
    state: DeviceReader,
    counters: Arc<CounterFiles>,
    holdings: watch::Receiver<Arc<Holdings>>,
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
        holdings: watch::Receiver<Arc<Holdings>>,
        pod_labels: bool,
    ) -> Self {
        let mut registry = Registry::default();
        allocations.register(&mut registry);
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

    /// Adds a counter that another module keeps, such as the CDI spec's failed writes.
    pub fn register_counter(&mut self, name: &str, help: &str, counter: Counter) {
        self.registry.register(name, help, counter);
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
                                let _ = write!(
                                    out,
                                    "# HELP efa_{name}_total EFA hardware counter {name} (sysfs hw_counters)\n\
                                     # TYPE efa_{name}_total counter\n"
                                );
                            }
                            if let Ok(at) = counters
                                .values
                                .binary_search_by(|(known, _)| known.as_str().cmp(name))
                            {
                                let _ = write!(out, "efa_{name}_total");
                                labels(
                                    &mut out,
                                    &[("device", &counters.device), ("ibdev", &counters.ibdev)],
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
                                if !self.headed {
                                    out.push_str(ALLOCATION_HEADER);
                                    self.headed = true;
                                }
                                out.push_str(ALLOCATION);
                                labels(
                                    &mut out,
                                    &[
                                        ("device", &counters.device),
                                        ("namespace", &h.namespace),
                                        ("pod", &h.pod),
                                        ("container", &h.container),
                                    ],
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

const ALLOCATION: &str = "efa_device_allocation";
const ALLOCATION_HEADER: &str = "# HELP efa_device_allocation 1 for each container that holds the EFA named by device; join on device to attribute the EFA's counters\n\
                                 # TYPE efa_device_allocation gauge\n";

/// `{name="value",...}`, each value escaped as the text format requires.
fn labels(out: &mut String, pairs: &[(&str, &str)]) {
    out.push('{');
    for (i, (name, value)) in pairs.iter().enumerate() {
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
    holdings: watch::Receiver<Arc<Holdings>>,
}

impl fmt::Debug for PluginCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginCollector").finish_non_exhaustive()
    }
}

impl Collector for PluginCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let inventory = self.state.current();
        let status = self.status.current();
        let healthy = inventory.healthy_count();
        let unhealthy = inventory.devices().len() - healthy;

        let mut devices = encoder.encode_descriptor(
            "efa_device_plugin_devices",
            "EFA devices advertised to the kubelet, by health; allocatable = healthy",
            None,
            MetricType::Gauge,
        )?;
        for (health, count) in [("healthy", healthy), ("unhealthy", unhealthy)] {
            ConstGauge::new(count as i64).encode(devices.encode_family(&[("health", health)])?)?;
        }
        let mut each = encoder.encode_descriptor(
            "efa_device_plugin_device_healthy",
            "1 while the kubelet is told this EFA is Healthy, 0 while Unhealthy (list gives the reason)",
            None,
            MetricType::Gauge,
        )?;
        for record in inventory.devices() {
            let labels = [
                ("device", record.efa.id.as_str()),
                ("ibdev", record.efa.ibdev.as_str()),
            ];
            ConstGauge::new(i64::from(record.is_healthy())).encode(each.encode_family(&labels)?)?;
        }
        // The condition /readyz reports: without a stream the kubelet cannot see the devices.
        ConstGauge::new(i64::from(status.registered && status.open_streams > 0))
        .encode(encoder.encode_descriptor(
            "efa_device_plugin_registered",
            "1 while registered with the kubelet with a ListAndWatch stream open (what /readyz reports)",
            None,
            MetricType::Gauge,
        )?)?;
        let counters = [
            (
                "efa_device_plugin_registrations",
                "Successful registrations with the kubelet",
                status.registrations,
            ),
            (
                "efa_device_plugin_kubelet_restarts",
                "Kubelet restarts seen (a new kubelet.sock after a registration)",
                status.kubelet_restarts,
            ),
        ];
        for (name, help, value) in counters {
            ConstCounter::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        let mut errors = encoder.encode_descriptor(
            "efa_device_plugin_scan_errors",
            "sysfs scan errors, by reason: an errno name when the RDMA class directory cannot be \
             listed, deadline, entry (an EFA entry unreadable) or numa_node",
            None,
            MetricType::Counter,
        )?;
        for (reason, count) in self.scans.errors() {
            ConstCounter::new(count)
                .encode(errors.encode_family(&[("reason", reason.as_str())])?)?;
        }
        let mut build = encoder.encode_descriptor(
            "efa_device_plugin_build_info",
            "Always 1; the labels describe the running build",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(1i64)
            .encode(build.encode_family(&[("version", env!("CARGO_PKG_VERSION"))])?)?;
        let mut conflict = encoder.encode_descriptor(
            "efa_device_plugin_dra_conflict",
            "1 while an EFA DRA driver is registered on the node and every device is withheld; \
             driver names it",
            None,
            MetricType::Gauge,
        )?;
        match inventory.conflicting_driver() {
            Some(driver) => {
                ConstGauge::new(1i64).encode(conflict.encode_family(&[("driver", driver)])?)?
            }
            None => ConstGauge::new(0i64).encode(conflict)?,
        }
        let (foreign, unseen_by_dra, stale, double_booked) = {
            let holdings = self.holdings.borrow();
            (
                holdings.foreign_ids(),
                holdings.unseen_by_dra(&inventory),
                holdings.stale,
                holdings.double_booked.len(),
            )
        };
        let gauges = [
            (
                "efa_device_plugin_competing_plugin",
                "1 while another device plugin for this resource serves its socket in the \
                 device-plugin dir; the plugin then does not take the resource back from it",
                i64::from(status.competitor.is_some()),
            ),
            (
                "efa_device_plugin_foreign_allocations",
                "IDs that pods hold under this resource but this plugin does not advertise \
                 (from another plugin, ID strategy or sharing count); the kubelet counts their \
                 EFAs as free",
                i64::try_from(foreign).unwrap_or(i64::MAX),
            ),
            (
                "efa_device_plugin_dra_conflict_held_devices",
                "EFAs that pods hold through this plugin while an EFA DRA driver is registered \
                 on the node; the DRA driver cannot see them and may allocate them again, so \
                 drain their pods before DRA serves the node",
                i64::try_from(unseen_by_dra).unwrap_or(i64::MAX),
            ),
            (
                "efa_device_plugin_pod_resources_stale",
                "1 while the kubelet's PodResources API fails and the pod view (allocations, \
                 foreign IDs) is its last good answer, kept for at most 5 minutes",
                i64::from(stale),
            ),
            (
                "efa_device_plugin_double_booked_devices",
                "Devices (EFAs, or replicas under sharing) that the kubelet's PodResources lists \
                 in two or more pods at once, in two answers in a row: the kubelet gave one ID \
                 out twice (kubernetes PR #137534, every kubelet up to 1.37)",
                i64::try_from(double_booked).unwrap_or(i64::MAX),
            ),
            (
                "efa_device_plugin_rdma_netns_exclusive",
                "1 while the RDMA subsystem is in exclusive network-namespace mode, which hides \
                 the EFAs from pods without the host network",
                i64::from(inventory.netns_exclusive()),
            ),
        ];
        for (name, help, value) in gauges {
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}
