//! The plugin's standing with the kubelet, for the probes and metrics: the [`Registration`]
//! the lifecycle writes and the [`Competition`] the competing-plugin watch writes.

use super::snapshot::Reader;

/// What the rest of the process may know about the registration, for the probes and metrics.
/// Written by the lifecycle alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registration {
    /// The device-plugin dir is watched: a kubelet's socket appearing is registered with at
    /// once. What a service manager that orders the kubelet after the plugin waits for.
    pub listening: bool,
    pub registered: bool,
    pub open_streams: usize,
    pub registrations: u64,
    pub kubelet_restarts: u64,
}

/// Whether another plugin serves the resource: written by the competing-plugin watch alone, and
/// read by the lifecycle, which stands down while one does, and by the probes and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Competition {
    /// The socket of another plugin for this resource that accepts connections.
    pub socket: Option<String>,
}

/// What the probes and metrics read of the plugin's standing with the kubelet: the
/// [`Registration`] and the [`Competition`], each read from its own writer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginStatus {
    pub registered: bool,
    pub open_streams: usize,
    pub competitor: Option<String>,
    pub registrations: u64,
    pub kubelet_restarts: u64,
}

/// Reads the two snapshots a [`PluginStatus`] is made of.
#[derive(Clone)]
pub struct StatusReader {
    pub registration: Reader<Registration>,
    pub competition: Reader<Competition>,
}

impl StatusReader {
    pub fn current(&self) -> PluginStatus {
        let Registration {
            // The service manager's readiness notice alone waits for it.
            listening: _,
            registered,
            open_streams,
            registrations,
            kubelet_restarts,
        } = self.registration.current();
        PluginStatus {
            registered,
            open_streams,
            competitor: self.competition.borrow().socket.clone(),
            registrations,
            kubelet_restarts,
        }
    }
}
