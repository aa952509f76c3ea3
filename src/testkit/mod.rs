//! Stand-ins for what the plugin meets on a node, for the tests, the benchmarks, the fuzz
//! targets and the demo: simulated sysfs and dev trees, the kubelet's device manager and its
//! PodResources endpoint, a frozen plugin's socket. None of it is in the shipped binary: it is
//! compiled only for this crate's own tests or with the `testkit` feature, which the image build
//! leaves off.

pub mod frozen;
pub mod kubelet_stub;
pub mod log;
pub mod pod_resources_stub;
pub mod simulate;
