//! Wires the modules into a running plugin.

use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use prometheus_client::metrics::counter::Counter;

use crate::allocation::metrics::AllocationMetrics;
use crate::allocation::{Allocator, Contributor, DeviceNodes, Environment};
use crate::cdi::{self, CdiDevices, Kind, SpecSettings};
use crate::config::{DeviceListStrategy, Settings};
use crate::conflict::Guard;
use crate::health::{Monitor, ScanStats};
use crate::lifecycle::Lifecycle;
use crate::state::DeviceState;
use crate::state::PluginStatus;
use crate::telemetry::http::{self, Endpoint};
use crate::telemetry::metrics::Metrics;
use crate::telemetry::pod_resources::PodResources;

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
        // Before anything a second instance could disturb: the socket, the NFD file.
        let Some(_lock) =
            crate::lifecycle::lock_dir(&settings.device_plugin_dir, &shutdown).await?
        else {
            return Ok(());
        };
        let allocations = Arc::new(AllocationMetrics::default());
        let cdi = match settings.device_list_strategy {
            DeviceListStrategy::DeviceSpecs => None,
            DeviceListStrategy::Cdi => Some(CdiSpec {
                settings: SpecSettings {
                    kind: Kind::of(&settings.resource_name).map_err(anyhow::Error::msg)?,
                    sharing: settings.sharing,
                    env: settings.allocate.env.clone(),
                },
                failures: Counter::default(),
            }),
        };
        let mut monitor = Monitor::new(
            settings.sysfs_root.clone(),
            settings.dev_root.clone(),
            settings.rescan_interval,
            self.state.clone(),
        )
        .with_regular_files(settings.test_only_regular_file_nodes);
        // Bound before anything else starts, so a taken port fails the start with one line.
        let endpoint = match settings.metrics_address {
            Some(address) => Some(
                self.endpoint(
                    settings,
                    &allocations,
                    cdi.as_ref().map(|spec| spec.failures.clone()),
                    monitor.stats(),
                    address,
                    &shutdown,
                )
                .await?,
            ),
            None => None,
        };
        // The first snapshot is in place before the kubelet can ask for it.
        monitor.refresh().await;
        crate::service::check_list_fits(&self.state.current(), settings.sharing)?;
        let mut tasks = vec![tokio::spawn(monitor.run(shutdown.clone()))];
        tasks.extend(endpoint);
        tasks.extend(self.start_guard(settings, &shutdown).await);
        if let Some(path) = &settings.nfd_features_file {
            tasks.push(tokio::spawn(crate::nfd::run(
                path.clone(),
                settings.rescan_interval,
                self.state.reader(),
                shutdown.clone(),
            )));
        }
        // The env goes into every Allocate answer in both modes: in cdi mode the spec's container
        // edits carry it as well, and the kubelet's checkpoint then records it either way.
        let environment = Box::new(Environment {
            env: settings.allocate.env.clone(),
        });
        let contributors: Vec<Box<dyn Contributor>> = match cdi {
            None => vec![
                Box::new(DeviceNodes {
                    dev_root: settings.dev_root.clone(),
                }),
                environment,
            ],
            Some(spec) => {
                let contributor = CdiDevices {
                    kind: spec.settings.kind.clone(),
                };
                // The writer's first attempt runs at the lifecycle's first await, on this one
                // runtime thread: before the kubelet can even register, let alone allocate.
                tasks.push(tokio::spawn(cdi::run(
                    settings.cdi_spec_dir.clone(),
                    spec.settings,
                    settings.rescan_interval,
                    spec.failures,
                    self.state.reader(),
                    shutdown.clone(),
                )));
                vec![Box::new(contributor), environment]
            }
        };
        let lifecycle = Lifecycle {
            dir: settings.device_plugin_dir.clone(),
            resource_name: settings.resource_name.clone(),
            state: self.state.reader(),
            allocator: Arc::new(
                Allocator::new(contributors)
                    .with_sharing(settings.sharing)
                    .with_metrics(allocations),
            ),
            status: self.status.clone(),
        };
        let result = lifecycle.run(shutdown.clone()).await;
        shutdown.cancel();
        for task in tasks {
            let _ = task.await;
        }
        result
    }

    async fn endpoint(
        &self,
        settings: &Settings,
        allocations: &AllocationMetrics,
        cdi_failures: Option<Counter>,
        scans: Arc<ScanStats>,
        address: std::net::SocketAddr,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<JoinHandle<()>> {
        let listener = TcpListener::bind(address)
            .await
            .with_context(|| format!("--metrics-address {address}"))?;
        let bound = listener.local_addr()?;
        tracing::info!(address = %bound, "serving /metrics, /healthz and /readyz");
        let mut metrics = Metrics::new(
            self.state.reader(),
            self.status.subscribe(),
            allocations,
            scans.clone(),
            &settings.sysfs_root,
            settings.counter_pod_labels.then(|| {
                PodResources::new(
                    settings.pod_resources_socket.clone(),
                    settings.resource_name.clone(),
                )
            }),
        );
        if let Some(failures) = cdi_failures {
            metrics.register_counter(
                "efa_device_plugin_cdi_spec_write_failures",
                "Failed attempts to write the CDI spec file (each is retried)",
                failures,
            );
        }
        let endpoint = Arc::new(Endpoint {
            metrics,
            status: self.status.subscribe(),
            scans,
            stopped: shutdown.clone(),
        });
        Ok(tokio::spawn(http::serve(
            listener,
            endpoint,
            shutdown.clone(),
        )))
    }

    /// The conflict is in the state before the kubelet can see a device, so no EFA is
    /// advertised as allocatable while a DRA driver owns them.
    async fn start_guard(
        &self,
        settings: &Settings,
        shutdown: &CancellationToken,
    ) -> Option<JoinHandle<()>> {
        if settings.allow_dra_coexistence {
            return None;
        }
        let mut guard = Guard::new(
            settings.plugins_registry_dir.clone(),
            settings.dra_drivers.clone(),
            settings.rescan_interval,
            self.state.clone(),
        );
        guard.refresh().await;
        Some(tokio::spawn(guard.run(shutdown.clone())))
    }
}

/// The cdi strategy's spec file, before its writer starts.
struct CdiSpec {
    settings: SpecSettings,
    failures: Counter,
}

impl Default for Plugin {
    fn default() -> Self {
        Self::new()
    }
}

/// A read stuck in the kernel never returns; the process must end anyway, so shutdown waits
/// this long for blocking work and then leaves it behind.
const BLOCKING_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// The `run` command: the plugin as a process, stopped by SIGTERM or SIGINT.
pub fn serve(settings: Settings) -> anyhow::Result<()> {
    crate::telemetry::init_logging(settings.log_format, &settings.log_level)?;
    crate::telemetry::fds::raise_limit();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        // sysfs reads run on the blocking pool for milliseconds every rescan; an idle plugin
        // should not keep their threads around.
        .thread_keep_alive(std::time::Duration::from_secs(2))
        .build()?;
    let outcome = runtime.block_on(async {
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
    });
    runtime.shutdown_timeout(BLOCKING_GRACE);
    outcome
}
