//! The admin-queue rule: an EFA whose driver has closed its admin queue is Unhealthy.
//!
//! The kernel's EFA driver (`drivers/infiniband/hw/efa/efa_com.c`) counts an admin command that
//! gets no completion within the device's timeout in `aq->stats.no_completion`
//! (`efa_com_wait_and_process_admin_cq_polling` and `_interrupts`), and in the same place clears
//! `EFA_AQ_STATE_RUNNING_BIT`; from then on `efa_com_submit_admin_cmd` refuses every command
//! with "Admin queue is closed" (`-ENODEV`), so no QP, CQ, MR or AH can be created on the device.
//! The bit is set again only by `efa_com_admin_init`, which zeroes the same stats
//! (`efa_com_stats_init`) just before, and which only the device's probe calls
//! (`efa_probe_device` in `efa_main.c`): no command, reset or timer re-opens the queue of a
//! device that keeps running. `efa_fill_device_stats` (`efa_verbs.c`) shows the stat as the
//! device-level hw counter `no_completion_cmds`. So a non-zero value means the queue of this
//! incarnation of the device is closed, and 0 means it is open: the rule needs no baseline, a
//! plugin started after the failure sees it, and a value that falls is a device probed again
//! (whose counters start at 0), never a failure.
//!
//! Only the device-level file is read: reading it copies atomics, whereas the port-level
//! counters are fetched from the device with an admin command (`efa_fill_port_stats`), which a
//! stuck device would hold for the command timeout.

use std::path::Path;

use crate::fsread;
use crate::state::{Failure, Verdict};

/// The counter, relative to the device's entry in `<sysfs>/class/infiniband`.
pub(crate) const COUNTER: &str = "hw_counters/no_completion_cmds";

/// What the counter of one EFA says about its admin queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum AdminQueue {
    /// The counter reads 0.
    Open,
    /// The counter reads this many commands without a completion.
    Closed(u64),
    /// The counter cannot be read as a count: missing (a kernel without it), not a regular
    /// file, unreadable or garbled. It says nothing, so it is not a failure of the device.
    Unknown(String),
}

impl AdminQueue {
    /// Reads the counter of the device whose class entry is `entry`.
    pub(crate) fn read(entry: &Path) -> AdminQueue {
        match fsread::read_text(&entry.join(COUNTER), fsread::ATTRIBUTE_LIMIT) {
            Ok(text) => Self::parse(&text),
            Err(err) => AdminQueue::Unknown(err.to_string()),
        }
    }

    fn parse(text: &str) -> AdminQueue {
        match text.trim().parse::<u64>() {
            Ok(0) => AdminQueue::Open,
            Ok(count) => AdminQueue::Closed(count),
            Err(err) => AdminQueue::Unknown(format!("{text:?} is no count: {err}")),
        }
    }

    /// The rule's verdict: Unhealthy while the queue is closed, else none of its own.
    pub(crate) fn verdict(&self) -> Option<Verdict> {
        match self {
            AdminQueue::Closed(count) => Some(Verdict::unhealthy(
                Failure::AdminQueueClosed,
                format!(
                    "the driver closed its admin queue ({COUNTER} is {count}): no QP, MR or AH \
                     can be created until the device is probed again"
                ),
            )),
            AdminQueue::Open | AdminQueue::Unknown(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry_with(text: Option<&str>) -> tempfile::TempDir {
        let entry = tempfile::tempdir().unwrap();
        std::fs::create_dir(entry.path().join("hw_counters")).unwrap();
        if let Some(text) = text {
            std::fs::write(entry.path().join(COUNTER), text).unwrap();
        }
        entry
    }

    #[test]
    fn a_count_above_zero_is_a_closed_queue_and_unhealthy() {
        let entry = entry_with(Some("3\n"));
        let queue = AdminQueue::read(entry.path());
        assert_eq!(queue, AdminQueue::Closed(3));
        let verdict = queue.verdict().expect("a closed queue is a verdict");
        assert_eq!(verdict.cause, Some(Failure::AdminQueueClosed));
        let reason = verdict.reason.unwrap();
        assert!(
            reason.contains("closed its admin queue") && reason.contains("no_completion_cmds is 3"),
            "{reason}"
        );
    }

    /// Whether the rule judges the EFA whose entry is `entry` Unhealthy.
    fn closed(entry: &Path) -> bool {
        AdminQueue::read(entry).verdict().is_some()
    }

    #[test]
    fn zero_is_an_open_queue_with_no_verdict_and_a_rise_closes_it() {
        let entry = entry_with(Some("0\n"));
        assert_eq!(AdminQueue::read(entry.path()), AdminQueue::Open);
        assert!(!closed(entry.path()));
        std::fs::write(entry.path().join(COUNTER), "1\n").unwrap();
        assert!(
            closed(entry.path()),
            "the first command without a completion"
        );
    }

    /// A device probed again starts its counters at 0: the fall is the queue re-opened.
    #[test]
    fn a_counter_that_falls_to_zero_is_healthy_again_and_one_that_falls_short_of_it_is_not() {
        let entry = entry_with(Some("7\n"));
        assert!(AdminQueue::read(entry.path()).verdict().is_some());
        std::fs::write(entry.path().join(COUNTER), "0\n").unwrap();
        assert_eq!(AdminQueue::read(entry.path()).verdict(), None);
        // The new incarnation timed out too: its own queue is closed.
        std::fs::write(entry.path().join(COUNTER), "2\n").unwrap();
        assert_eq!(AdminQueue::read(entry.path()), AdminQueue::Closed(2));
    }

    #[test]
    fn a_missing_counter_says_nothing() {
        let entry = entry_with(None);
        let queue = AdminQueue::read(entry.path());
        assert!(
            matches!(&queue, AdminQueue::Unknown(why) if why.contains("No such file")),
            "{queue:?}"
        );
        assert_eq!(queue.verdict(), None);
        // The same place, once the counter is there, is read.
        std::fs::write(entry.path().join(COUNTER), "1\n").unwrap();
        assert!(closed(entry.path()));
    }

    #[test]
    fn an_unreadable_or_garbled_counter_says_nothing() {
        let entry = entry_with(None);
        let counter = entry.path().join(COUNTER);
        nix::unistd::mkfifo(&counter, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let fifo = AdminQueue::read(entry.path());
        assert!(
            matches!(&fifo, AdminQueue::Unknown(why) if why.contains("a FIFO")),
            "{fifo:?}"
        );
        assert_eq!(fifo.verdict(), None);
        std::fs::remove_file(&counter).unwrap();
        std::fs::create_dir(&counter).unwrap();
        assert!(!closed(entry.path()), "a directory");
        std::fs::remove_dir(&counter).unwrap();
        for garbled in [
            "",
            "N/A (no PMA)\n",
            "-1\n",
            "3 4\n",
            "99999999999999999999999\n",
        ] {
            std::fs::write(&counter, garbled).unwrap();
            let queue = AdminQueue::read(entry.path());
            assert!(
                matches!(queue, AdminQueue::Unknown(_)),
                "{garbled:?}: {queue:?}"
            );
            assert_eq!(queue.verdict(), None, "{garbled:?}");
        }
        // The same file, holding a count, is read.
        std::fs::write(&counter, "2\n").unwrap();
        assert!(closed(entry.path()));
    }
}
