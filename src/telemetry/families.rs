//! The metrics table: every family `/metrics` shows, with its type, its HELP text and its
//! labels, in the order a scrape shows them. It is the one place a family is named: the scrape
//! renders each family's `# HELP` and `# TYPE` lines and its label names from its row, and only
//! the values are read from the live state at scrape time.
//!
//! README.md's metrics table documents the same families with the same types and labels, and
//! `tests/metrics_table.rs` compares the two both ways. The README's `meaning` column is its own
//! longer text, as its settings table's help is: a HELP line is one short line a dashboard
//! shows, while the README tells when to alert and what a value implies, so the two are not
//! compared.

use std::fmt;

use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, EncodeMetric, LabelSetEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

/// One metric family as a scrape shows it.
#[derive(Debug)]
pub struct Family {
    /// The name queries use and the HELP and TYPE lines show: a counter's ends in `_total`.
    /// [`COUNTER`] in it stands for each hardware counter's name.
    pub name: &'static str,
    pub kind: MetricType,
    /// The HELP text, exactly as a scrape shows it; [`COUNTER`] as in the name.
    pub help: &'static str,
    /// The label names of each series, in the order a series shows them.
    pub labels: &'static [&'static str],
}

/// What stands for a hardware counter's name (its sysfs file) in a pattern row.
pub const COUNTER: &str = "<counter>";

/// Every family, in the order a scrape shows them.
pub const FAMILIES: &[Family] = &[
    ALLOCATIONS,
    ALLOCATE_DURATION,
    CDI_SPEC_WRITE_FAILURES,
    DEVICES,
    DEVICE_HEALTHY,
    UNHEALTHY_DEVICES,
    REGISTERED,
    REGISTRATIONS,
    KUBELET_RESTARTS,
    SCAN_ERRORS,
    BUILD_INFO,
    DRA_CONFLICT,
    COMPETING_PLUGIN,
    FOREIGN_ALLOCATIONS,
    DRA_CONFLICT_HELD_DEVICES,
    POD_RESOURCES_STALE,
    POD_RESOURCES_UNKNOWN,
    DOUBLE_BOOKED_DEVICES,
    RDMA_NETNS_EXCLUSIVE,
    HARDWARE_COUNTER,
    DEVICE_ALLOCATION,
];

pub(crate) const ALLOCATIONS: Family = Family {
    name: "efa_device_plugin_allocations_total",
    kind: MetricType::Counter,
    help: "Allocate calls answered, by result.",
    labels: &["result"],
};

pub(crate) const ALLOCATE_DURATION: Family = Family {
    name: "efa_device_plugin_allocate_duration_seconds",
    kind: MetricType::Histogram,
    help: "Time to answer an Allocate call.",
    labels: &[],
};

/// Only in cdi mode, where there is a spec to write.
pub(crate) const CDI_SPEC_WRITE_FAILURES: Family = Family {
    name: "efa_device_plugin_cdi_spec_write_failures_total",
    kind: MetricType::Counter,
    help: "Failed attempts to write the CDI spec file (each is retried).",
    labels: &[],
};

pub(crate) const DEVICES: Family = Family {
    name: "efa_device_plugin_devices",
    kind: MetricType::Gauge,
    help: "EFA devices advertised to the kubelet, by health; allocatable = healthy",
    labels: &["health"],
};

pub(crate) const DEVICE_HEALTHY: Family = Family {
    name: "efa_device_plugin_device_healthy",
    kind: MetricType::Gauge,
    help: "1 while the kubelet is told this EFA is Healthy, 0 while Unhealthy (list gives the \
           reason)",
    labels: &["device", "ibdev"],
};

/// One series per `state::Failure`, 0 included, so the label set is closed and always there.
pub(crate) const UNHEALTHY_DEVICES: Family = Family {
    name: "efa_device_plugin_unhealthy_devices",
    kind: MetricType::Gauge,
    help: "EFA devices advertised Unhealthy, by reason: admin_queue_closed, device_node, \
           dra_conflict, unreadable or vanished",
    labels: &["reason"],
};

pub(crate) const REGISTERED: Family = Family {
    name: "efa_device_plugin_registered",
    kind: MetricType::Gauge,
    help: "1 while registered with the kubelet with a ListAndWatch stream open (what /readyz \
           reports)",
    labels: &[],
};

pub(crate) const REGISTRATIONS: Family = Family {
    name: "efa_device_plugin_registrations_total",
    kind: MetricType::Counter,
    help: "Successful registrations with the kubelet",
    labels: &[],
};

pub(crate) const KUBELET_RESTARTS: Family = Family {
    name: "efa_device_plugin_kubelet_restarts_total",
    kind: MetricType::Counter,
    help: "Kubelet restarts seen (a new kubelet.sock after a registration)",
    labels: &[],
};

pub(crate) const SCAN_ERRORS: Family = Family {
    name: "efa_device_plugin_scan_errors_total",
    kind: MetricType::Counter,
    help: "sysfs scan errors, by reason: an errno name when the RDMA class directory cannot be \
           listed, deadline, entry (an EFA entry unreadable) or numa_node",
    labels: &["reason"],
};

pub(crate) const BUILD_INFO: Family = Family {
    name: "efa_device_plugin_build_info",
    kind: MetricType::Gauge,
    help: "Always 1; the labels describe the running build",
    labels: &["version"],
};

/// Labelled only while 1.
pub(crate) const DRA_CONFLICT: Family = Family {
    name: "efa_device_plugin_dra_conflict",
    kind: MetricType::Gauge,
    help: "1 while an EFA DRA driver is registered on the node and every device is withheld; \
           driver names it",
    labels: &["driver"],
};

pub(crate) const COMPETING_PLUGIN: Family = Family {
    name: "efa_device_plugin_competing_plugin",
    kind: MetricType::Gauge,
    help: "1 while another device plugin for this resource serves its socket in the \
           device-plugin dir; the plugin then does not take the resource back from it",
    labels: &[],
};

pub(crate) const FOREIGN_ALLOCATIONS: Family = Family {
    name: "efa_device_plugin_foreign_allocations",
    kind: MetricType::Gauge,
    help: "IDs that pods hold under this resource but this plugin does not advertise (from \
           another plugin, ID strategy or sharing count); the kubelet counts their EFAs as free",
    labels: &[],
};

pub(crate) const DRA_CONFLICT_HELD_DEVICES: Family = Family {
    name: "efa_device_plugin_dra_conflict_held_devices",
    kind: MetricType::Gauge,
    help: "EFAs that pods hold through this plugin while an EFA DRA driver is registered on the \
           node; the DRA driver cannot see them and may allocate them again, so drain their pods \
           before DRA serves the node",
    labels: &[],
};

pub(crate) const POD_RESOURCES_STALE: Family = Family {
    name: "efa_device_plugin_pod_resources_stale",
    kind: MetricType::Gauge,
    help: "1 while the kubelet's PodResources API fails and the pod view (allocations, foreign \
           IDs) is its last good answer",
    labels: &[],
};

pub(crate) const POD_RESOURCES_UNKNOWN: Family = Family {
    name: "efa_device_plugin_pod_resources_unknown",
    kind: MetricType::Gauge,
    help: "1 while the plugin cannot tell which pods hold which EFAs: the kubelet's PodResources \
           API has not answered since the start, or not for 5 minutes; the last known holders \
           are kept",
    labels: &[],
};

pub(crate) const DOUBLE_BOOKED_DEVICES: Family = Family {
    name: "efa_device_plugin_double_booked_devices",
    kind: MetricType::Gauge,
    help: "Devices (EFAs, or replicas under sharing) that the kubelet's PodResources lists in \
           two or more pods at once, in two answers in a row: the kubelet gave one ID out twice \
           (kubernetes PR #137534, every kubelet up to 1.37), or pods hold replica IDs of an \
           EFA given out under an earlier sharing count",
    labels: &[],
};

pub(crate) const RDMA_NETNS_EXCLUSIVE: Family = Family {
    name: "efa_device_plugin_rdma_netns_exclusive",
    kind: MetricType::Gauge,
    help: "1 while the RDMA subsystem is in exclusive network-namespace mode, which hides the \
           EFAs from pods without the host network",
    labels: &[],
};

/// One family per counter file any EFA has, sorted by name.
pub(crate) const HARDWARE_COUNTER: Family = Family {
    name: "efa_<counter>_total",
    kind: MetricType::Counter,
    help: "EFA hardware counter <counter> (sysfs hw_counters)",
    labels: &["device", "ibdev"],
};

/// Only with pod attribution on, and only while a container holds an EFA.
pub(crate) const DEVICE_ALLOCATION: Family = Family {
    name: "efa_device_allocation",
    kind: MetricType::Gauge,
    help: "1 for each container that holds the EFA named by device; join on device to \
           attribute the EFA's counters",
    labels: &["device", "namespace", "pod", "container"],
};

impl Family {
    /// The name prometheus-client is given: it adds a counter's `_total` itself.
    fn stem(&self) -> &'static str {
        match self.kind {
            MetricType::Counter => self.name.strip_suffix("_total").unwrap_or(self.name),
            _ => self.name,
        }
    }

    /// Registers a series another module keeps under this family's name and help.
    pub(crate) fn register(&self, registry: &mut Registry, metric: impl Metric) {
        // The registry ends each help it is given with a period; the row holds the text as
        // shown, so the period is taken off here.
        let help = self.help.strip_suffix('.').unwrap_or(self.help);
        registry.register(self.stem(), help, metric);
    }

    /// Writes this family's HELP and TYPE lines, then each series: its label values, in the
    /// order of the family's labels, and its value. A series may leave the last labels out, as
    /// the DRA conflict gauge does while 0.
    pub(crate) fn encode<'v, const N: usize>(
        &self,
        encoder: &mut DescriptorEncoder,
        series: impl IntoIterator<Item = ([&'v str; N], impl EncodeMetric)>,
    ) -> Result<(), fmt::Error> {
        let mut family = encoder.encode_descriptor(self.stem(), self.help, None, self.kind)?;
        for (values, metric) in series {
            let labels = Labels {
                names: self.labels,
                values: &values,
            };
            metric.encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// Writes this family's HELP and TYPE lines as text, for the families a scrape writes
    /// itself: `counter` takes the place of [`COUNTER`].
    pub(crate) fn write_header(&self, out: &mut String, counter: &str) {
        for (line, text) in [("# HELP ", self.help), ("# TYPE ", self.kind.as_str())] {
            out.push_str(line);
            self.write_name(out, counter);
            out.push(' ');
            fill(out, text, counter);
            out.push('\n');
        }
    }

    /// Writes this family's name, `counter` in place of [`COUNTER`].
    pub(crate) fn write_name(&self, out: &mut String, counter: &str) {
        fill(out, self.name, counter);
    }
}

/// `template` with each [`COUNTER`] replaced by `counter`.
fn fill(out: &mut String, template: &str, counter: &str) {
    // Found by its first character, which takes half the time of a substring search: a
    // scrape writes a counter's name for each of its hundreds of series.
    let mut rest = template;
    while let Some(at) = rest.find('<') {
        out.push_str(&rest[..at]);
        rest = match rest[at..].strip_prefix(COUNTER) {
            Some(after) => {
                out.push_str(counter);
                after
            }
            None => {
                out.push('<');
                &rest[at + 1..]
            }
        };
    }
    out.push_str(rest);
}

/// A series' labels: each name of its family's row with its value, so a series cannot name a
/// label the table does not.
struct Labels<'v> {
    names: &'static [&'static str],
    values: &'v [&'v str],
}

impl EncodeLabelSet for Labels<'_> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), fmt::Error> {
        for (name, value) in self.names.iter().zip(self.values) {
            (*name, *value).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counters_name_ends_in_total_and_no_other_does() {
        for family in FAMILIES {
            assert_eq!(
                family.kind == MetricType::Counter,
                family.name.ends_with("_total"),
                "{family:?}"
            );
        }
    }

    #[test]
    fn each_family_is_named_once() {
        let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len());
    }

    #[test]
    fn only_the_counter_placeholder_is_filled() {
        let mut out = String::new();
        fill(&mut out, "<counter> <2 <count <counter><counter>", "x");
        assert_eq!(out, "x <2 <count xx");
    }

    #[test]
    fn a_pattern_row_is_filled_with_the_counter() {
        let mut out = String::new();
        HARDWARE_COUNTER.write_header(&mut out, "tx_bytes");
        DEVICE_ALLOCATION.write_header(&mut out, "tx_bytes");
        assert_eq!(
            out,
            "# HELP efa_tx_bytes_total EFA hardware counter tx_bytes (sysfs hw_counters)\n\
             # TYPE efa_tx_bytes_total counter\n\
             # HELP efa_device_allocation 1 for each container that holds the EFA named by \
             device; join on device to attribute the EFA's counters\n\
             # TYPE efa_device_allocation gauge\n"
        );
    }
}
