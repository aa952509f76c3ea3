//! Wires the modules into a running plugin.

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::allocation::{Allocator, DeviceNodes};
use crate::config::Settings;
use crate::health::Monitor;
use crate::lifecycle::{Lifecycle, PluginStatus};
use crate::state::DeviceState;

/// Handles a caller keeps on a running plugin.
#[derive(Clone)]
pub struct Plugin {
    pub state: DeviceState,
    pub status: Arc<watch::Sender<PluginStatus>>,
}

impl Plugin {
    pub fn new() -> Self {
        Plugin {
            state: DeviceState::default(),
            status: Arc::new(watch::Sender::new(PluginStatus::default())),
        }
    }

    /// Scans once, then keeps devices current and the kubelet registration alive until
    /// `shutdown`. Returns once the plugin's socket is removed.
    pub async fn run(
        &self,
        settings: &Settings,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let mut monitor = Monitor::new(
            settings.sysfs_root.clone(),
            settings.dev_root.clone(),
            settings.rescan_interval,
            self.state.clone(),
        );
        // The first snapshot is in place before the kubelet can ask for it.
        monitor.refresh().await;
        let monitor_task = tokio::spawn(monitor.run(shutdown.clone()));
        let lifecycle = Lifecycle {
            dir: settings.device_plugin_dir.clone(),
            resource_name: settings.resource_name.clone(),
            state: self.state.clone(),
            allocator: Arc::new(
                Allocator::new(vec![Box::new(DeviceNodes {
                    dev_root: settings.dev_root.clone(),
                })])
                .with_sharing(settings.sharing),
            ),
            status: self.status.clone(),
        };
        let result = lifecycle.run(shutdown.clone()).await;
        shutdown.cancel();
        let _ = monitor_task.await;
        result
    }
}

impl Default for Plugin {
    fn default() -> Self {
        Self::new()
    }
}

/// The `run` command: the plugin as a process, stopped by SIGTERM or SIGINT.
pub fn serve(settings: Settings) -> anyhow::Result<()> {
    crate::telemetry::init_logging(settings.log_format, &settings.log_level)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        tracing::info!(
            version = env!("CARGO_PKG_VERSION"),
            settings = ?settings,
            "starting"
        );
        let shutdown = CancellationToken::new();
        let plugin = Plugin::new();
        let running = plugin.run(&settings, shutdown.clone());
        tokio::pin!(running);
        tokio::select! {
            result = &mut running => return result,
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        tracing::info!("stopping on signal");
        shutdown.cancel();
        running.await
    })
}
