//! efa-device-plugin: advertises a node's AWS Elastic Fabric Adapters to the kubelet.
//!
//! See ARCHITECTURE.md for how a device travels from sysfs to a container.

pub mod allocation;
pub mod app;
pub mod cdi;
pub mod config;
pub mod conflict;
pub mod demo;
pub mod discovery;
pub mod fsread;
pub mod fswatch;
pub mod health;
pub mod hostfile;
pub mod kubelet_stub;
pub mod lifecycle;
pub mod list;
pub mod nfd;
pub mod pod_resources_stub;
pub mod proto;
pub mod service;
pub mod simulate;
pub mod state;
pub mod telemetry;
pub mod uds;
