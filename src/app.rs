//! Wires the modules into a running plugin.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::{Id, JoinSet};
use tokio_util::sync::CancellationToken;

use prometheus_client::metrics::counter::Counter;

use crate::allocation::metrics::AllocationMetrics;
use crate::allocation::recent::{self, Recent};
use crate::allocation::{
    self, Allocator, Contributors, Delivery, DeviceNode, DeviceSpecs, FoundNodes,
};
use crate::cdi::{self, CdiNames, Kind, SpecSettings};
use crate::config::{ConfigError, DeviceListStrategy, Settings};
use crate::conflict::Guard;
use crate::health::{Monitor, ScanStats};
use crate::holdings::PodResources;
use crate::lifecycle::Lifecycle;
use crate::service::budget;
use crate::state::{
    Competition, ConflictWriter, DeviceReader, DeviceState, Holdings, Reader, Registration,
    StatusReader, Writer,
};
use crate::telemetry::families;
use crate::telemetry::http::{self, Endpoint};
use crate::telemetry::metrics::Metrics;

/// Scans once, then keeps devices current and the kubelet registration alive until
/// `shutdown`. Returns once the plugin's socket is removed.
pub(crate) async fn run(settings: &Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    // Before anything a second instance could disturb: the socket, the NFD file.
    let Ok(_lock) = crate::lifecycle::lock_dir(&settings.device_plugin_dir, &shutdown).await?
    else {
        return Ok(());
    };
    let strategy = Strategy::of(settings)?;
    let (writers, readers) = Writers::new();
    let Writers {
        devices,
        conflict,
        registration,
        competition,
        holdings,
        extra_nodes,
    } = writers;
    let mut lookup = crate::extra_nodes::Lookup::new(
        settings.extra_device_nodes_on_host(),
        settings.dev_root.clone(),
        readers.devices.clone(),
        extra_nodes,
    );
    let mut plugin = Plugin {
        settings,
        contributors: allocation::contributors(
            &settings.dev_root,
            &settings.allocate.env,
            readers.extra_nodes.clone(),
        ),
        strategy,
        allocations: Arc::default(),
        readers,
        shutdown,
        tasks: Tasks::default(),
    };
    // Built before the health monitor, which reads the IDs it gives out.
    let allocator = plugin.allocator();
    plugin
        .start_device_writers(devices, conflict, allocator.recent())
        .await?;
    // Judged against the EFAs the first scan found, before the first Allocate or CDI spec can
    // name them.
    lookup.start().map_err(|reason| {
        ConfigError(format!("{} {reason}", settings.origins.extra_device_nodes))
    })?;
    plugin.start_pod_view(holdings);
    plugin.start_competitor_watch(competition).await;
    plugin.start_files();
    plugin.start_readiness_notice();
    if !settings.extra_device_nodes.is_empty() {
        let look_up = lookup.run(settings.rescan_interval, plugin.shutdown.clone());
        plugin.tasks.spawn("extra device node look-up", look_up);
    }
    plugin.serve_kubelet(registration, allocator).await
}

/// Each snapshot's one writer, until [`run`] hands it to the module that writes it.
struct Writers {
    devices: DeviceState,
    conflict: ConflictWriter,
    registration: Writer<Registration>,
    competition: Writer<Competition>,
    holdings: Writer<Arc<Holdings>>,
    extra_nodes: Writer<Arc<[DeviceNode]>>,
}

/// What every other part is given of the snapshots.
struct Readers {
    devices: DeviceReader,
    status: StatusReader,
    holdings: Reader<Arc<Holdings>>,
    extra_nodes: FoundNodes,
}

impl Writers {
    fn new() -> (Writers, Readers) {
        let (devices, conflict) = DeviceState::with_conflict_writer();
        let (registration, competition) = (Writer::default(), Writer::default());
        let holdings = Writer::default();
        let extra_nodes = Writer::new(Arc::from([]));
        let readers = Readers {
            devices: devices.reader(),
            status: StatusReader {
                registration: registration.reader(),
                competition: competition.reader(),
            },
            holdings: holdings.reader(),
            extra_nodes: FoundNodes::new(extra_nodes.reader()),
        };
        let writers = Writers {
            devices,
            conflict,
            registration,
            competition,
            holdings,
            extra_nodes,
        };
        (writers, readers)
    }
}

/// A plugin being started: what its parts are built from, and the tasks started so far. Each
/// view is filled once before its task starts, so the kubelet never sees a device, an
/// allocatable count or a readiness before the first scan.
struct Plugin<'a> {
    settings: &'a Settings,
    strategy: Strategy,
    contributors: Contributors,
    allocations: Arc<AllocationMetrics>,
    readers: Readers,
    shutdown: CancellationToken,
    tasks: Tasks,
}

impl Plugin<'_> {
    /// The snapshot's two writers: the health monitor, filled by a first scan, and the
    /// DRA-conflict guard. The metrics endpoint is bound first, so a taken port fails the
    /// start with one line.
    async fn start_device_writers(
        &mut self,
        devices: DeviceState,
        conflict: ConflictWriter,
        given_lately: Option<Arc<Recent>>,
    ) -> anyhow::Result<()> {
        let settings = self.settings;
        // Before the first scan names any device: a held EFA renamed while no plugin ran keeps
        // the ID it was given under.
        devices.remember(crate::identities::read(
            &settings.device_plugin_dir,
            settings.device_id_strategy,
        ));
        let mut monitor = Monitor::new(
            settings.sysfs_root.clone(),
            settings.judge(),
            settings.rescan_interval,
            devices,
        )
        .with_ids(settings.device_id_strategy)
        .with_holdings(self.readers.holdings.clone(), given_lately);
        if let Some(address) = settings.metrics_address {
            let endpoint = self.endpoint(monitor.stats(), address).await?;
            self.tasks.spawn("metrics endpoint", endpoint);
        }
        // The first snapshot is in place before the kubelet can ask for it.
        monitor.refresh().await;
        let cdi = matches!(self.strategy, Strategy::Cdi { .. });
        budget::check_sharing_fits(&self.readers.devices.current(), settings.sharing, cdi)
            .map_err(|reason| ConfigError(format!("{} {reason}", settings.origins.sharing)))?;
        self.tasks
            .spawn("health monitor", monitor.run(self.shutdown.clone()));
        if let Some(guard) = self.start_guard(conflict).await {
            self.tasks
                .spawn("DRA-conflict guard", guard.run(self.shutdown.clone()));
        }
        Ok(())
    }

    fn start_pod_view(&mut self, holdings: Writer<Arc<Holdings>>) {
        let view = self.pod_resources().run(
            self.readers.devices.clone(),
            self.settings.sharing,
            self.settings.rescan_interval,
            holdings,
            self.shutdown.clone(),
        );
        self.tasks.spawn("PodResources view", view);
    }

    fn pod_resources(&self) -> PodResources {
        PodResources::new(
            self.settings.pod_resources_socket.clone(),
            self.settings.resource_name.to_string(),
        )
    }

    async fn start_competitor_watch(&mut self, competition: Writer<Competition>) {
        let competitors = crate::competitor::Watch {
            dir: self.settings.device_plugin_dir.clone(),
            sockets: self.settings.competing_plugin_sockets.clone(),
            interval: self.settings.rescan_interval,
            competition,
        };
        // Known before the first registration, so /readyz and the gauge tell from the start.
        competitors.refresh().await;
        self.tasks.spawn(
            "competing-plugin watch",
            competitors.run(self.shutdown.clone()),
        );
    }

    /// The files others read: the advertised IDs for the next run, the NFD feature file and, in
    /// cdi mode, the CDI spec.
    /// Tells a service manager that started the plugin when the kubelet can register it.
    fn start_readiness_notice(&mut self) {
        if let Some(notifier) = crate::readiness::Notifier::from_env() {
            let announce = crate::readiness::announce(
                notifier,
                self.readers.status.registration.clone(),
                self.shutdown.clone(),
            );
            self.tasks.spawn("readiness notice", announce);
        }
    }

    fn start_files(&mut self) {
        let settings = self.settings;
        let ids = crate::identities::run(
            settings.device_plugin_dir.clone(),
            settings.device_id_strategy,
            settings.rescan_interval,
            self.readers.devices.clone(),
            self.readers.status.registration.clone(),
            self.shutdown.clone(),
        );
        self.tasks.spawn("advertised-ID file writer", ids);
        if let Some(path) = &settings.nfd_features_file {
            let writer = crate::nfd::run(
                path.clone(),
                settings.rescan_interval,
                self.readers.devices.clone(),
                self.shutdown.clone(),
            );
            self.tasks.spawn("NFD feature file writer", writer);
        }
        if let Strategy::Cdi { kind, failures } = &self.strategy {
            // The writer's first attempt runs at the lifecycle's first await, on this one
            // runtime thread: before the kubelet can even register, let alone allocate.
            let writer = cdi::run(
                settings.cdi_spec_dir.clone(),
                SpecSettings {
                    kind: kind.clone(),
                    sharing: settings.sharing,
                    contributors: self.contributors.clone(),
                },
                settings.rescan_interval,
                failures.clone(),
                cdi::Sources {
                    state: self.readers.devices.clone(),
                    holdings: self.readers.holdings.clone(),
                    extra: self.readers.extra_nodes.clone(),
                },
                self.spec_still_needed(),
                self.shutdown.clone(),
            );
            self.tasks.spawn("CDI spec writer", writer);
        }
    }

    /// The Allocate side: what the contributors give a container, delivered by the strategy.
    fn allocator(&self) -> Allocator {
        let delivery: Box<dyn Delivery> = match &self.strategy {
            Strategy::DeviceSpecs => Box::new(DeviceSpecs),
            Strategy::Cdi { kind, .. } => Box::new(CdiNames { kind: kind.clone() }),
        };
        Allocator::new(delivery, self.contributors.clone())
            .with_sharing(self.settings.sharing)
            .with_metrics(self.allocations.clone())
            .with_holdings(self.readers.holdings.clone())
            .steering_from_recent(recent::window_for(self.settings.rescan_interval))
    }

    /// Registers with the kubelet and serves it until shutdown or until a task fails, which
    /// stops the rest.
    async fn serve_kubelet(
        self,
        registration: Writer<Registration>,
        allocator: Allocator,
    ) -> anyhow::Result<()> {
        let lifecycle = Lifecycle {
            dir: self.settings.device_plugin_dir.clone(),
            resource_name: self.settings.resource_name.to_string(),
            state: self.readers.devices.clone(),
            allocator: Arc::new(allocator),
            registration,
            competition: self.readers.status.competition.clone(),
        };
        let Plugin {
            mut tasks,
            shutdown,
            ..
        } = self;
        let registration = lifecycle.run(shutdown.clone());
        tokio::pin!(registration);
        let outcome = tokio::select! {
            result = &mut registration => result,
            failed = tasks.first_failure(&shutdown) => {
                tracing::error!(error = %failed, "stopping the plugin");
                shutdown.cancel();
                registration.await.and(Err(failed))
            }
        };
        shutdown.cancel();
        tasks.stop().await;
        outcome
    }

    async fn endpoint(
        &self,
        scans: Arc<ScanStats>,
        address: std::net::SocketAddr,
    ) -> anyhow::Result<impl Future<Output = ()> + Send + 'static> {
        let listener = TcpListener::bind(address)
            .await
            .with_context(|| format!("{} {address}", self.settings.origins.metrics_address))?;
        let bound = listener.local_addr()?;
        tracing::info!(address = %bound, "serving /metrics, /healthz and /readyz");
        let mut metrics = Metrics::new(
            self.readers.devices.clone(),
            self.readers.status.clone(),
            &self.allocations,
            scans.clone(),
            &self.settings.sysfs_root,
            self.readers.holdings.clone(),
            self.settings.counter_pod_labels,
        );
        if let Some(failures) = self.strategy.cdi_failures() {
            metrics.register_counter(&families::CDI_SPEC_WRITE_FAILURES, failures);
        }
        let endpoint = Arc::new(Endpoint {
            metrics,
            status: self.readers.status.clone(),
            scans,
            stopped: self.shutdown.clone(),
        });
        Ok(http::serve(listener, endpoint, self.shutdown.clone()))
    }

    /// Asks the kubelet at exit whether a container still holds an EFA: a holder that ended
    /// since the last poll must not keep the CDI spec, nor a new one lose it.
    fn spec_still_needed(&self) -> crate::hostfile::KeepOnExit {
        let pods = self.pod_resources();
        let (state, sharing) = (self.readers.devices.clone(), self.settings.sharing);
        Box::new(move || {
            Box::pin(async move {
                let holdings = pods.holdings_now(&state.current(), sharing).await;
                cdi::still_needed(&holdings)
            })
        })
    }

    /// The conflict is in the state before the kubelet can see a device, so no EFA is
    /// advertised as allocatable while a DRA driver owns them.
    async fn start_guard(&self, conflict: ConflictWriter) -> Option<Guard> {
        let settings = self.settings;
        if settings.allow_dra_coexistence {
            return None;
        }
        let mut guard = Guard::new(
            settings.plugins_registry_dir.clone(),
            settings.dra_drivers.clone(),
            settings.resource_name.to_string(),
            settings.rescan_interval,
            conflict,
        );
        guard.refresh().await;
        Some(guard)
    }
}

/// The plugin's long-running tasks. Each runs until shutdown, so one that ends sooner, by
/// returning or by panicking, has left the plugin without a part it needs.
#[derive(Default)]
struct Tasks {
    set: JoinSet<()>,
    names: HashMap<Id, &'static str>,
}

impl Tasks {
    fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let id = self.set.spawn(task).id();
        self.names.insert(id, name);
    }

    /// Waits for the first task to fail and says which and how: to panic, or to end before
    /// `shutdown`. Never resolves while every task runs or has stopped as asked.
    async fn first_failure(&mut self, shutdown: &CancellationToken) -> anyhow::Error {
        while let Some(ended) = self.set.join_next_with_id().await {
            if ended.is_err() || !shutdown.is_cancelled() {
                return anyhow::anyhow!(self.describe(ended));
            }
        }
        std::future::pending().await
    }

    /// After shutdown: waits for every task, logging any that failed rather than stopped.
    async fn stop(mut self) {
        while let Some(ended) = self.set.join_next_with_id().await {
            if ended.is_err() {
                tracing::error!(error = %self.describe(ended), "a task failed while stopping");
            }
        }
    }

    fn describe(&self, ended: Result<(Id, ()), tokio::task::JoinError>) -> String {
        match ended {
            Ok((id, ())) => format!("the {} stopped unexpectedly", self.name(id)),
            Err(err) => format!("the {} failed: {}", self.name(err.id()), panic_message(err)),
        }
    }

    fn name(&self, id: Id) -> &'static str {
        self.names.get(&id).copied().unwrap_or("task")
    }
}

fn panic_message(err: tokio::task::JoinError) -> String {
    if !err.is_panic() {
        return err.to_string();
    }
    let payload = err.into_panic();
    payload
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".to_owned())
}

/// The device-list strategy, with the cdi one's spec kind and write-failure counter.
enum Strategy {
    DeviceSpecs,
    Cdi { kind: Kind, failures: Counter },
}

impl Strategy {
    fn of(settings: &Settings) -> anyhow::Result<Strategy> {
        Ok(match settings.device_list_strategy {
            DeviceListStrategy::DeviceSpecs => Strategy::DeviceSpecs,
            // `config::parse` refuses cdi mode for a name without a CDI kind; `Settings` built
            // in code (the demo, the tests) skip it, and get this error rather than a panic.
            DeviceListStrategy::Cdi => Strategy::Cdi {
                kind: settings
                    .resource_name
                    .cdi_kind()
                    .map_err(|err| anyhow::anyhow!("{err}"))?
                    .clone(),
                failures: Counter::default(),
            },
        })
    }

    fn cdi_failures(&self) -> Option<Counter> {
        match self {
            Strategy::DeviceSpecs => None,
            Strategy::Cdi { failures, .. } => Some(failures.clone()),
        }
    }
}

/// A read stuck in the kernel never returns; the process must end anyway, so shutdown waits
/// this long for blocking work and then leaves it behind.
const BLOCKING_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// The `run` command: the plugin as a process, stopped by SIGTERM, SIGINT or SIGHUP.
pub fn serve(settings: Settings) -> anyhow::Result<()> {
    crate::telemetry::init_logging(settings.log_format, settings.log_level.filter())?;
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
        // SIGHUP's default would end the process with no clean-up, leaving the socket and the
        // host files behind. There is nothing to reload (the config is read at start, and the
        // DaemonSet restarts the pod for a new one), so it stops the plugin like SIGTERM.
        let mut hangup = signal(SignalKind::hangup())?;
        tracing::info!(
            version = env!("CARGO_PKG_VERSION"),
            settings = ?settings,
            "starting"
        );
        let shutdown = CancellationToken::new();
        let running = run(&settings, shutdown.clone());
        tokio::pin!(running);
        tokio::select! {
            result = &mut running => return result,
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
            _ = hangup.recv() => {}
        }
        tracing::info!("stopping on signal");
        shutdown.cancel();
        running.await
    });
    runtime.shutdown_timeout(BLOCKING_GRACE);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_ends_before_shutdown_is_named() {
        let shutdown = CancellationToken::new();
        let mut tasks = Tasks::default();
        let until_shutdown = shutdown.clone();
        tasks.spawn(
            "health monitor",
            async move { until_shutdown.cancelled().await },
        );
        tasks.spawn("NFD feature file writer", async {});
        assert_eq!(
            tasks.first_failure(&shutdown).await.to_string(),
            "the NFD feature file writer stopped unexpectedly"
        );
        shutdown.cancel();
        tasks.stop().await;
    }

    #[tokio::test]
    async fn a_panicking_task_is_named_with_its_message() {
        let shutdown = CancellationToken::new();
        let mut tasks = Tasks::default();
        tasks.spawn("CDI spec writer", async { panic!("disk on fire") });
        assert_eq!(
            tasks.first_failure(&shutdown).await.to_string(),
            "the CDI spec writer failed: disk on fire"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn tasks_that_stop_on_shutdown_have_not_failed() {
        let shutdown = CancellationToken::new();
        let mut tasks = Tasks::default();
        for name in ["health monitor", "metrics endpoint"] {
            let until_shutdown = shutdown.clone();
            tasks.spawn(name, async move { until_shutdown.cancelled().await });
        }
        shutdown.cancel();
        let waited = tokio::time::timeout(
            std::time::Duration::from_secs(3600),
            tasks.first_failure(&shutdown),
        )
        .await;
        assert!(waited.is_err(), "no failure: {waited:?}");
    }
}
