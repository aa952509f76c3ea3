//! efa-device-plugin: advertises a node's AWS Elastic Fabric Adapters to the kubelet.
//!
//! See ARCHITECTURE.md for how a device travels from sysfs to a container. A `pub` item is one
//! the binary, the integration tests, the benchmarks or the fuzz targets use; everything else is
//! `pub(crate)`, which the `unreachable_pub` lint keeps honest.

pub mod allocation;
pub mod app;
pub(crate) mod backoff;
pub(crate) mod cdi;
pub(crate) mod competitor;
pub mod config;
pub(crate) mod conflict;
#[cfg(feature = "demo")]
pub mod demo;
pub mod discovery;
pub(crate) mod extra_nodes;
pub(crate) mod fsread;
pub(crate) mod fswatch;
pub mod health;
pub(crate) mod holdings;
pub(crate) mod hostfile;
pub(crate) mod identities;
pub(crate) mod lifecycle;
pub mod list;
pub(crate) mod nfd;
pub mod proto;
pub(crate) mod readiness;
pub(crate) mod rescan;
pub(crate) mod service;
pub mod state;
pub mod telemetry;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod uds;
