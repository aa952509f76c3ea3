//! Generated bindings for the kubelet's gRPC contracts (see `proto/`).

/// Device plugin API: `Registration` (served by the kubelet) and `DevicePlugin` (served by us).
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");

    /// The only API version a kubelet accepts in `RegisterRequest.version`.
    pub const VERSION: &str = "v1beta1";
    /// The kubelet counts a device as allocatable only when its health is exactly this string.
    pub const HEALTHY: &str = "Healthy";
    pub const UNHEALTHY: &str = "Unhealthy";
    /// File name of the kubelet's registration socket inside the device-plugin dir.
    pub const KUBELET_SOCKET: &str = "kubelet.sock";
    /// File name of this plugin's socket inside the device-plugin dir, sent as
    /// `RegisterRequest.endpoint`.
    pub const PLUGIN_SOCKET: &str = "efa-device-plugin.sock";
}

/// Kubelet PodResources API, used to attribute EFA traffic to pods.
pub mod podresources {
    tonic::include_proto!("v1");
}
