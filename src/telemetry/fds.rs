//! File descriptors: the core (gRPC, sockets, inotify, sysfs scans) must never run out of them
//! because of what the HTTP endpoint or the hardware-counter cache hold.
//!
//! At start the soft `RLIMIT_NOFILE` is raised to the hard limit: containerd 2.x leaves the soft
//! limit at 1024. Of the limit, [`CORE_RESERVE`] descriptors are kept for the core and
//! [`MAX_CONNECTIONS`] for HTTP connections; the counter cache may keep the rest
//! open, and opens per scrape past that.

use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// At most this many HTTP connections are served at once; one more is closed as soon as it is
/// accepted. Prometheus and the kubelet's two probes need a handful, and 64 of hyper's
/// connections cost well under a MiB, so a flood of idle connections from any pod cannot take
/// the descriptors or the memory the devices depend on.
pub const MAX_CONNECTIONS: usize = 64;

/// Descriptors neither HTTP connections nor the counter cache may take. The core holds a few
/// dozen; a rescan of 256 EFAs opens one at a time.
pub(crate) const CORE_RESERVE: u64 = 256;

/// Raises the soft limit on open files to the hard limit; a failure leaves it as it was.
pub(crate) fn raise_limit() {
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %err, "cannot raise the open-file limit");
            }
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "cannot read the open-file limit"),
    }
}

/// How many descriptors the counter cache may keep open under the current soft limit.
pub(crate) fn counter_budget() -> usize {
    let soft = getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft);
    budget_under(soft)
}

fn budget_under(soft: u64) -> usize {
    let budget = soft.saturating_sub(CORE_RESERVE + MAX_CONNECTIONS as u64);
    usize::try_from(budget).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_and_the_connections_come_off_the_limit() {
        assert_eq!(budget_under(1024), 1024 - 256 - MAX_CONNECTIONS);
        assert_eq!(
            budget_under(100),
            0,
            "a tiny limit leaves the cache nothing"
        );
        assert_eq!(budget_under(1 << 20), (1 << 20) - 256 - MAX_CONNECTIONS);
    }
}
