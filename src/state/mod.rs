//! The one place device state lives: a `tokio::sync::watch` snapshot.
//!
//! The health monitor writes what it observes ([`DeviceState`]) and the DRA-conflict guard
//! whether another driver owns the devices ([`ConflictWriter`]); both are inputs of this one
//! snapshot and the only holders of its two writers, which are made together and are not
//! `Clone`. Every ListAndWatch stream, the Allocate path, the metrics endpoint and the
//! files that mirror the devices hold a [`DeviceReader`] and read the latest snapshot, so a
//! stream that starts after a change still sees it: nothing is handed over through channels
//! that a dead stream could swallow.
//!
//! The process's other snapshots (the [`Registration`], the [`Competition`], the PodResources
//! view's [`Holdings`]) follow the same rule with a [`Writer`] that is not `Clone` and its
//! [`Reader`]s: one writing module each.

mod holdings;
mod inventory;
mod snapshot;
mod status;

pub use holdings::{Cause, DoubleBooking, ForeignHold, Holder, Holders, Holdings};
pub use inventory::{
    Change, Conflict, ConflictWriter, DeviceReader, DeviceRecord, DeviceState, Failure, Health,
    Held, Inventory, Observation, Verdict,
};
pub use snapshot::{Reader, Writer};
pub use status::{Competition, PluginStatus, Registration, StatusReader};
