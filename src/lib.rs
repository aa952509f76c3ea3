//! efa-device-plugin: advertises a node's AWS Elastic Fabric Adapters to the kubelet.
//!
//! See ARCHITECTURE.md for how a device travels from sysfs to a container.

pub mod allocation;
pub mod app;
pub mod cdi;
pub mod config;
pub mod conflict;
#[cfg(feature = "demo")]
pub mod demo;
pub mod discovery;
pub mod fsread;
pub mod fswatch;
pub mod health;
pub mod hostfile;
pub mod lifecycle;
pub mod list;
pub mod nfd;
pub mod proto;
pub mod service;
pub mod state;
pub mod telemetry;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod uds;
