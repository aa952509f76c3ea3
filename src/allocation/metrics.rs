//! What the Allocate path records. It is the one figure the state cannot show, because an answer
//! leaves no trace there; telemetry only registers these series, under the names its metrics
//! table gives them.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

type ResultLabel = [(&'static str, &'static str); 1];

/// What the Allocate path records: one counter increment and one histogram sample per call.
#[derive(Clone)]
pub struct AllocationMetrics {
    outcomes: Family<ResultLabel, Counter>,
    duration: Histogram,
}

impl Default for AllocationMetrics {
    fn default() -> Self {
        let outcomes = Family::default();
        // Both series exist from the start, so `rate()` sees the first error as a change.
        for result in ["ok", "error"] {
            let _ = outcomes.get_or_create(&[("result", result)]);
        }
        AllocationMetrics {
            outcomes,
            // Allocate answers from memory in microseconds; the upper buckets catch a starved
            // runtime. 25 µs … ~0.4 s.
            duration: Histogram::new(exponential_buckets(25e-6, 4.0, 8)),
        }
    }
}

impl AllocationMetrics {
    pub fn record(&self, ok: bool, elapsed: Duration) {
        let result = if ok { "ok" } else { "error" };
        self.outcomes.get_or_create(&[("result", result)]).inc();
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// Both series, for the scrape: the calls by result, and their durations.
    pub(crate) fn series(&self) -> (Family<ResultLabel, Counter>, Histogram) {
        (self.outcomes.clone(), self.duration.clone())
    }
}
