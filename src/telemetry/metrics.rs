//! Prometheus metrics: the plugin's own state, Allocate outcomes, and the EFA hardware counters.
//!
//! Device and registration figures are read from the live state when scraped, so they cannot
//! drift from what the kubelet is told. Only Allocate, which leaves no trace in that state,
//! keeps counters of its own.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

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
use crate::state::{DeviceReader, Holder, Holders, Holdings, PluginStatus};

/// The `Content-Type` of what [`Metrics::render`] returns.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Everything `/metrics` shows.
pub struct Metrics {
    registry: Registry,
    state: DeviceReader,
    counters: Arc<CounterFiles>,
    holdings: watch::Receiver<Arc<Holdings>>,
    /// Whether the counters carry the holders' pod labels.
    pod_labels: bool,
}

impl Metrics {
    pub fn new(
        state: DeviceReader,
        status: watch::Receiver<PluginStatus>,
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
        }
    }

    /// Adds a counter that another module keeps, such as the CDI spec's failed writes.
    pub fn register_counter(&mut self, name: &str, help: &str, counter: Counter) {
        self.registry.register(name, help, counter);
    }

    /// The exposition text: the plugin's own metrics, then the hardware counters.
    pub async fn render(&self) -> String {
        let devices: Vec<(String, String)> = self
            .state
            .current()
            .devices()
            .map(|d| (d.efa.id.clone(), d.efa.ibdev.clone()))
            .collect();
        let counters = self.counters.clone();
        let holders = if self.pod_labels {
            self.holdings.borrow().holders.clone()
        } else {
            Holders::new()
        };
        // Reading and encoding 600 counter series is the bulk of a scrape; done off the
        // runtime thread, it cannot delay an Allocate.
        let hardware = tokio::task::spawn_blocking(move || {
            let read = counters.read(&devices);
            let mut scrape = Registry::default();
            scrape.register_collector(Box::new(HwCounters::new(read, &holders)));
            let mut text = String::with_capacity(64 * 1024);
            // Writing to a String cannot fail.
            let _ = prometheus_text::encode(&mut text, &scrape);
            text
        });
        let hardware = hardware.await.unwrap_or_else(|err| {
            tracing::error!(error = %err, "reading the EFA hardware counters failed; this scrape has none");
            String::new()
        });
        let mut text = String::with_capacity(hardware.len() + 4096);
        let _ = prometheus_text::encode(&mut text, &self.registry);
        text.push_str(&hardware);
        text
    }
}

/// Reads device health and registration figures from the live state at scrape time.
struct PluginCollector {
    state: DeviceReader,
    status: watch::Receiver<PluginStatus>,
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
        let status = self.status.borrow().clone();
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
        ConstGauge::new(i64::from(inventory.conflict().is_some())).encode(
            encoder.encode_descriptor(
                "efa_device_plugin_dra_conflict",
                "1 while an EFA DRA driver is registered on the node and every device is withheld",
                None,
                MetricType::Gauge,
            )?,
        )?;
        let foreign = self.holdings.borrow().foreign_ids();
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

type Labels = Vec<(&'static str, String)>;

/// One scrape's hardware counters, grouped by counter name as the exposition format wants.
#[derive(Debug)]
struct HwCounters {
    by_name: BTreeMap<String, Vec<(Labels, u64)>>,
}

impl HwCounters {
    fn new(read: Vec<DeviceCounters>, holders: &Holders) -> Self {
        let mut by_name: BTreeMap<String, Vec<(Labels, u64)>> = BTreeMap::new();
        for device in read {
            let labels = device_labels(&device, holders);
            for (name, value) in device.values {
                by_name
                    .entry(name)
                    .or_default()
                    .push((labels.clone(), value));
            }
        }
        HwCounters { by_name }
    }
}

/// `device` and `ibdev`, plus the holder when a pod has the device. A device shared by several
/// containers names them all, comma-separated in the same order, so its one series still sums
/// correctly.
fn device_labels(device: &DeviceCounters, holders: &Holders) -> Labels {
    let mut labels = vec![
        ("device", device.device.clone()),
        ("ibdev", device.ibdev.clone()),
    ];
    if let Some(list) = holders.get(&device.device).filter(|l| !l.is_empty()) {
        let join =
            |field: fn(&Holder) -> &str| list.iter().map(field).collect::<Vec<_>>().join(",");
        labels.push(("namespace", join(|h| &h.namespace)));
        labels.push(("pod", join(|h| &h.pod)));
        labels.push(("container", join(|h| &h.container)));
    }
    labels
}

impl Collector for HwCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        for (name, series) in &self.by_name {
            let metric = format!("efa_{name}");
            let help = format!("EFA hardware counter {name} (sysfs hw_counters)");
            let mut family =
                encoder.encode_descriptor(&metric, &help, None, MetricType::Counter)?;
            for (labels, value) in series {
                ConstCounter::new(*value).encode(family.encode_family(labels)?)?;
            }
        }
        Ok(())
    }
}
