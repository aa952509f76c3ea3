//! Registration with the kubelet, kept alive across everything the kubelet does.
//!
//! The kubelet never redials a plugin: when it restarts it deletes every socket in the
//! device-plugin dir and creates a new `kubelet.sock`, and when a ListAndWatch stream ends it
//! only marks the devices unhealthy. So the plugin re-registers on its own, each time stopping
//! the old server first (ending its streams) and serving a fresh socket before calling
//! `Register`, because the kubelet dials back and asks for the plugin's options while that call
//! is still in flight. Changes are seen through inotify on the directory, not by polling.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::allocation::Allocator;
use crate::backoff::Backoff;
use crate::fswatch::DirWatch;
use crate::proto::deviceplugin::{
    KUBELET_SOCKET, PLUGIN_SOCKET, RegisterRequest, VERSION,
    registration_client::RegistrationClient,
};
use crate::service::server::PluginServer;
use crate::service::{PluginService, StreamHooks};
use crate::state::{Competition, DeviceReader, Reader, Registration, Writer};
use crate::uds::{self, FileIdentity};

/// A kubelet that accepted the connection but hangs in Register is retried after this long.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// Upper bound for the time a stopping server may take to close its connections.
const STOP_TIMEOUT: Duration = Duration::from_secs(1);
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(5);
/// How long a refused connect to a `kubelet.sock` that exists is retried before the attempt
/// counts as failed: the kubelet creates the file at `bind()` and listens a moment later.
const REFUSED_PATIENCE: Duration = Duration::from_secs(1);
/// A stream the kubelet keeps this long was not a rejection.
const STABLE_AFTER: Duration = Duration::from_secs(3);
/// The kubelet opens its ListAndWatch stream as soon as Register returns. A kubelet whose
/// stream call failed leaves the plugin registered with no stream and never retries it, so no
/// stream this long after Register counts as a failed registration.
const STREAM_PATIENCE: Duration = Duration::from_secs(5);
/// Longest pause between registrations while the kubelet keeps ending streams at once.
const CHURN_CAP: Duration = Duration::from_secs(30);

/// Shutdown was asked for. Every wait of the lifecycle can end with it, and `?` carries it up
/// to [`Lifecycle::run`], which then returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stopped;

/// Why a registration ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    SocketReplaced,
    KubeletSocketReplaced,
    StreamEnded,
    /// No stream within [`STREAM_PATIENCE`] of Register.
    NoStream,
}

pub(crate) struct Lifecycle {
    pub dir: PathBuf,
    pub resource_name: String,
    pub state: DeviceReader,
    pub allocator: Arc<Allocator>,
    pub registration: Writer<Registration>,
    /// Whether another plugin serves the resource: the competing-plugin watch says.
    pub competition: Reader<Competition>,
}

enum Attempt {
    Registered(Generation),
    Failed(anyhow::Error),
    /// A starting kubelet deleted the socket as we served or registered: its dir is clean now,
    /// so the next attempt goes at once rather than after a pause.
    SocketLost,
}

/// What one registration leaves the next: the watch on the dir, the two backoffs, and the
/// kubelet last registered with.
struct Turns {
    watch: DirWatch,
    churn: Churn,
    failures: Failures,
    last_kubelet: Option<FileIdentity>,
    waiting_logged: bool,
}

/// One served socket and its server task.
struct Generation {
    stop: CancellationToken,
    hooks: Arc<StreamHooks>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    socket: PathBuf,
    /// The socket file served, so a path the kubelet deleted, or that names another file by
    /// now, is never taken for it.
    identity: FileIdentity,
}

impl Generation {
    async fn stop(mut self) {
        self.stop.cancel();
        match tokio::time::timeout(STOP_TIMEOUT, &mut self.server).await {
            Ok(Ok(Err(err))) => tracing::error!(error = %err, "plugin gRPC server failed"),
            Ok(Err(err)) => tracing::error!(error = %err, "plugin gRPC server task failed"),
            Ok(Ok(Ok(()))) => {}
            Err(_) => self.server.abort(),
        }
        // Remove the socket only if it is still ours: the kubelet may already have deleted it,
        // and nothing else may be put at that path in between.
        if self.is_served() {
            let _ = std::fs::remove_file(&self.socket);
        }
    }

    /// Whether the socket's path still names the file this generation serves.
    fn is_served(&self) -> bool {
        uds::identity(&self.socket) == Some(self.identity)
    }
}

impl Lifecycle {
    fn kubelet_socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    fn plugin_socket(&self) -> PathBuf {
        self.dir.join(PLUGIN_SOCKET)
    }

    /// Runs until `shutdown`; the plugin's socket is removed before it returns.
    pub(crate) async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let Ok(watch) = self.watch_dir(&shutdown).await else {
            return Ok(());
        };
        self.registration.send_modify(|s| s.listening = true);
        let mut turns = Turns {
            watch,
            churn: Churn::default(),
            failures: Failures::default(),
            last_kubelet: None,
            waiting_logged: false,
        };
        while let Ok(()) = self.turn(&mut turns, &shutdown).await {}
        Ok(())
    }

    /// One registration: waits for a kubelet, registers, serves it until the registration
    /// ends, and pauses if the ending asks for it.
    async fn turn(&self, turns: &mut Turns, shutdown: &CancellationToken) -> Result<(), Stopped> {
        if turns.watch.is_dead() {
            turns.watch = self.watch_dir(shutdown).await?;
        }
        let kubelet = uds::identity(&self.kubelet_socket());
        if kubelet.is_none() {
            if !turns.waiting_logged {
                tracing::info!(socket = %self.kubelet_socket().display(), "waiting for the kubelet");
                turns.waiting_logged = true;
            }
            return self
                .wait_for_kubelet(&mut turns.watch, None, shutdown)
                .await;
        }
        turns.waiting_logged = false;
        let generation = match self.attempt(&mut turns.watch, shutdown).await? {
            Attempt::Registered(generation) => generation,
            Attempt::SocketLost => {
                tracing::info!("a starting kubelet removed the plugin socket; serving it again");
                return Ok(());
            }
            // The kubelet's socket went or was replaced between the look above and the dial:
            // a starting kubelet removes every socket before it binds its own. No failure: the
            // next turn waits for the new socket, or registers with it.
            Attempt::Failed(_) if uds::identity(&self.kubelet_socket()) != kubelet => return Ok(()),
            Attempt::Failed(err) => {
                let pause = turns.failures.failed(format!("{err:#}"));
                return self
                    .wait_for_kubelet(&mut turns.watch, Some(pause), shutdown)
                    .await;
            }
        };
        // The kubelet registered with is the one whose socket is there now: a kubelet that
        // restarted between the look above and our dial was dialled instead. A later restart
        // would have deleted our socket, which ends this registration anyway.
        let kubelet = uds::identity(&self.kubelet_socket()).or(kubelet);
        let restarted = turns.last_kubelet.is_some_and(|last| Some(last) != kubelet);
        turns.last_kubelet = kubelet;
        if restarted {
            // A restarting kubelet ends the stream before it replaces its socket: that
            // ending was no rejection.
            turns.churn.settle();
        }
        self.registration.send_modify(|s| {
            s.registered = true;
            s.registrations += 1;
            s.kubelet_restarts += u64::from(restarted);
        });
        let ended = self
            .serve_registration(&generation, turns, kubelet, restarted, shutdown)
            .await;
        self.registration.send_modify(|s| {
            s.registered = false;
            s.open_streams = 0;
        });
        generation.stop().await;
        self.after(ended?, turns, shutdown).await
    }

    /// Serves a registration until it ends, logging it once it counts as working.
    async fn serve_registration(
        &self,
        generation: &Generation,
        turns: &mut Turns,
        kubelet: Option<FileIdentity>,
        restarted: bool,
        shutdown: &CancellationToken,
    ) -> Result<Ending, Stopped> {
        let log_registered = |after_failures: u32| {
            tracing::info!(
                resource = %self.resource_name,
                endpoint = PLUGIN_SOCKET,
                kubelet_restarted = restarted,
                devices = self.state.current().devices().len(),
                after_failures,
                "registered with the kubelet"
            );
        };
        // While registrations fail, one that has no stream yet may fail too: it is logged
        // once its stream opens.
        if !turns.churn.backing_off() && !turns.failures.failing() {
            log_registered(0);
        }
        let Turns {
            watch,
            churn,
            failures,
            ..
        } = turns;
        if let Some(ended) = self
            .wait_for_stream(generation, watch, kubelet, shutdown)
            .await?
        {
            return Ok(ended);
        }
        if let Some(after) = failures.recovered() {
            log_registered(after);
        }
        self.wait_until_ended(generation, watch, kubelet, churn, shutdown)
            .await
    }

    /// After a registration ended: stands down for a competitor, or pauses as the ending
    /// asks.
    async fn after(
        &self,
        ended: Ending,
        turns: &mut Turns,
        shutdown: &CancellationToken,
    ) -> Result<(), Stopped> {
        let pause = match ended {
            Ending::StreamEnded if self.competitor().is_some() => {
                self.stand_down(shutdown).await?;
                turns.churn.settle();
                return Ok(());
            }
            Ending::StreamEnded => turns.churn.stream_ended(),
            Ending::NoStream => Some(turns.failures.failed(format!(
                "the kubelet accepted Register but opened no ListAndWatch stream within {STREAM_PATIENCE:?}"
            ))),
            Ending::SocketReplaced | Ending::KubeletSocketReplaced => {
                turns.churn.settle();
                None
            }
        };
        // A failed registration has had its line.
        if !turns.churn.backing_off() && ended != Ending::NoStream {
            tracing::info!(reason = ?ended, "registration ended; registering again");
        }
        match pause {
            Some(pause) => {
                self.wait_for_kubelet(&mut turns.watch, Some(pause), shutdown)
                    .await
            }
            None => Ok(()),
        }
    }

    fn competitor(&self) -> Option<String> {
        self.competition.borrow().socket.clone()
    }

    /// The kubelet gave the resource to a competing plugin: leave it there until that plugin's
    /// socket goes, instead of taking it back and being taken from in turn.
    async fn stand_down(&self, shutdown: &CancellationToken) -> Result<(), Stopped> {
        tracing::error!(
            competitor = self.competitor().unwrap_or_default(),
            "the kubelet ended this plugin's stream while a competing device plugin serves the \
             resource; not registering again until that plugin's socket goes"
        );
        let mut competition = self.competition.subscribe();
        tokio::select! {
            _ = shutdown.cancelled() => Err(Stopped),
            // A reader keeps its snapshot's channel open: this never errs.
            _ = competition.wait_for(|c| c.socket.is_none()) => {
                tracing::info!("the competing device plugin is gone; registering again");
                Ok(())
            }
        }
    }

    /// Sets up the inotify watch on the device-plugin dir, creating the dir like the kubelet
    /// would. Retries until it works: a missing or unreadable dir is not a reason to exit.
    async fn watch_dir(&self, shutdown: &CancellationToken) -> Result<DirWatch, Stopped> {
        persist("cannot watch the device-plugin dir", shutdown, || {
            std::fs::create_dir_all(&self.dir)
                .and_then(|()| DirWatch::new(&self.dir))
                .with_context(|| format!("device-plugin dir {}", self.dir.display()))
        })
        .await
    }

    /// Serves a fresh socket and registers it; a failed attempt leaves no server behind.
    async fn attempt(
        &self,
        watch: &mut DirWatch,
        shutdown: &CancellationToken,
    ) -> Result<Attempt, Stopped> {
        let generation = match self.serve() {
            Ok(Some(generation)) => generation,
            Ok(None) => return Ok(Attempt::SocketLost),
            Err(err) => {
                return Ok(Attempt::Failed(
                    err.context("cannot serve the plugin socket"),
                ));
            }
        };
        generation.hooks.registering();
        let registered = tokio::select! {
            _ = shutdown.cancelled() => {
                generation.stop().await;
                return Err(Stopped);
            }
            result = tokio::time::timeout(REGISTER_TIMEOUT, self.register()) => {
                result.unwrap_or_else(|_| Err(anyhow::anyhow!("Register timed out after {REGISTER_TIMEOUT:?}")))
            }
            // A kubelet that starts while we dial its old socket deletes ours first; its
            // dial-back would then fail, and Register hang until the timeout.
            () = socket_lost(watch, &generation) => {
                generation.stop().await;
                return Ok(Attempt::SocketLost);
            }
        };
        match registered {
            Ok(()) => {
                generation.hooks.registered();
                Ok(Attempt::Registered(generation))
            }
            Err(err) => {
                generation.stop().await;
                Ok(Attempt::Failed(err))
            }
        }
    }

    /// Serves a fresh socket; `None` if it was deleted as soon as it was made, as a starting
    /// kubelet's clean-up does to every socket in the dir. Its identity is read after the bind,
    /// so a socket deleted in between has none: a Register then would make the kubelet dial a
    /// path that is gone until Register times out, while nothing could tell the socket was lost.
    fn serve(&self) -> anyhow::Result<Option<Generation>> {
        let socket = self.plugin_socket();
        let listener =
            uds::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
        let Some(identity) = uds::identity(&socket) else {
            return Ok(None);
        };
        let stop = CancellationToken::new();
        let hooks = Arc::new(StreamHooks::default());
        let service = PluginService {
            devices: self.state.clone(),
            allocator: self.allocator.clone(),
            hooks: hooks.clone(),
            stop: stop.clone(),
        };
        let server = uds::spawn_server(listener, PluginServer::new(service), stop.clone());
        Ok(Some(Generation {
            stop,
            hooks,
            server,
            socket,
            identity,
        }))
    }

    async fn register(&self) -> anyhow::Result<()> {
        let channel = uds::dial_patiently(&self.kubelet_socket(), REFUSED_PATIENCE)
            .await
            .context("connecting to kubelet.sock")?;
        RegistrationClient::new(channel)
            .register(RegisterRequest {
                version: VERSION.into(),
                endpoint: PLUGIN_SOCKET.into(),
                resource_name: self.resource_name.clone(),
                options: None,
            })
            .await
            .map_err(|status| anyhow::anyhow!("kubelet refused Register: {}", status.message()))?;
        Ok(())
    }

    /// Waits until `kubelet.sock` is (re)created, or `timeout` passes.
    async fn wait_for_kubelet(
        &self,
        watch: &mut DirWatch,
        timeout: Option<Duration>,
        shutdown: &CancellationToken,
    ) -> Result<(), Stopped> {
        let deadline = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Err(Stopped),
                _ = &mut deadline => return Ok(()),
                events = watch.next() => match events {
                    Ok(events) if !events.iter().any(|e| e.is_about(KUBELET_SOCKET) && e.is_creation()) => {}
                    _ => return Ok(()),
                },
            }
        }
    }

    /// Waits for the kubelet's stream to open after Register: `None` once it is, or the
    /// registration's ending, [`Ending::NoStream`] after [`STREAM_PATIENCE`] without it. Only the
    /// kubelet's stream counts (see [`StreamHooks`]), so another client's stream, however long it
    /// stays open, cannot hide a missing one.
    async fn wait_for_stream(
        &self,
        generation: &Generation,
        watch: &mut DirWatch,
        kubelet: Option<FileIdentity>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Ending>, Stopped> {
        let mut kubelet_stream = generation.hooks.kubelet_stream();
        tokio::select! {
            _ = shutdown.cancelled() => Err(Stopped),
            ended = self.ending(generation, watch, kubelet) => Ok(Some(ended)),
            // The sender lives in the hooks this generation holds: it never errs here.
            _ = kubelet_stream.wait_for(|opened| *opened) => Ok(None),
            () = tokio::time::sleep(STREAM_PATIENCE) => Ok(Some(Ending::NoStream)),
        }
    }

    /// Waits for a working registration to end, settling the churn backoff once its stream has
    /// lasted [`STABLE_AFTER`].
    async fn wait_until_ended(
        &self,
        generation: &Generation,
        watch: &mut DirWatch,
        kubelet: Option<FileIdentity>,
        churn: &mut Churn,
        shutdown: &CancellationToken,
    ) -> Result<Ending, Stopped> {
        // Counted from the stream's opening, not from Register.
        let stable = tokio::time::sleep(STABLE_AFTER);
        tokio::pin!(stable);
        let ending = self.ending(generation, watch, kubelet);
        tokio::pin!(ending);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Err(Stopped),
                ended = &mut ending => return Ok(ended),
                _ = &mut stable, if churn.streak > 0 => churn.settle(),
            }
        }
    }

    /// The registration's ending: the kubelet ended its stream, or the plugin's or the kubelet's
    /// socket was replaced. Keeps the probes' count of open streams meanwhile.
    async fn ending(
        &self,
        generation: &Generation,
        watch: &mut DirWatch,
        kubelet: Option<FileIdentity>,
    ) -> Ending {
        let mut open_streams = generation.hooks.open_streams();
        self.record_open_streams(*open_streams.borrow_and_update());
        loop {
            tokio::select! {
                // The sender lives in the hooks this generation holds: it never errs here.
                Ok(()) = open_streams.changed() => {
                    self.record_open_streams(*open_streams.borrow_and_update());
                }
                _ = generation.hooks.ended_by_kubelet() => return Ending::StreamEnded,
                events = watch.next() => {
                    if events.is_err() {
                        return Ending::SocketReplaced;
                    }
                    // Level-triggered: whatever the events said, compare what is there now.
                    if !generation.is_served() {
                        return Ending::SocketReplaced;
                    }
                    let now = uds::identity(&self.kubelet_socket());
                    if now.is_some() && now != kubelet {
                        return Ending::KubeletSocketReplaced;
                    }
                }
            }
        }
    }
}

impl Lifecycle {
    /// The probes' count of open streams, kept by the registration's wait: only a registered
    /// plugin's streams count.
    fn record_open_streams(&self, count: usize) {
        self.registration
            .send_if_modified(|s| std::mem::replace(&mut s.open_streams, count) != count);
    }
}

/// Returns once the generation's socket is no longer the one it serves (or the watch broke).
async fn socket_lost(watch: &mut DirWatch, generation: &Generation) {
    loop {
        let events = watch.next().await;
        if events.is_err() || !generation.is_served() {
            return;
        }
    }
}

/// Consecutive registrations whose stream the kubelet ended within [`STABLE_AFTER`]. A kubelet
/// that rejects every stream (say, a device list over its message limit) would otherwise be
/// re-registered with as fast as it can answer, with a log line each time.
struct Churn {
    streak: u32,
    backoff: Backoff,
}

impl Default for Churn {
    fn default() -> Self {
        Churn {
            streak: 0,
            backoff: Backoff::new(FIRST_RETRY, CHURN_CAP),
        }
    }
}

impl Churn {
    /// The pause before registering again: none for a first ending, then [`FIRST_RETRY`]
    /// doubling up to [`CHURN_CAP`]. Logs once, on entering the backoff.
    fn stream_ended(&mut self) -> Option<Duration> {
        self.streak += 1;
        if self.streak == 1 {
            return None;
        }
        if self.streak == 2 {
            tracing::warn!(
                within = ?STABLE_AFTER,
                cap = ?self.backoff.cap(),
                "the kubelet keeps ending the ListAndWatch stream; registering with growing pauses, quietly, until a stream lasts"
            );
        }
        Some(self.backoff.next_pause())
    }

    fn backing_off(&self) -> bool {
        self.streak > 1
    }

    /// A stream lasted, or the registration ended for another reason: the next ending
    /// re-registers at once again.
    fn settle(&mut self) {
        if self.backing_off() {
            tracing::info!(
                after = self.streak,
                "the kubelet keeps the ListAndWatch stream open again; backoff over"
            );
        }
        self.streak = 0;
        self.backoff.reset();
    }
}

/// Consecutive failed registrations: refused, unreachable, or accepted without a stream. A
/// kubelet that keeps refusing is tried every few seconds for as long as it refuses, so each
/// attempt is not logged: only the first failure, a failure for another reason, and the
/// registration that ends the streak.
struct Failures {
    count: u32,
    logged: Option<String>,
    backoff: Backoff,
}

impl Default for Failures {
    fn default() -> Self {
        Failures {
            count: 0,
            logged: None,
            backoff: Backoff::new(FIRST_RETRY, LAST_RETRY),
        }
    }
}

impl Failures {
    /// Counts a failure and returns the pause before the next attempt: [`FIRST_RETRY`], then
    /// doubling up to [`LAST_RETRY`].
    fn failed(&mut self, error: String) -> Duration {
        self.count += 1;
        let pause = self.backoff.next_pause();
        if self.logged.as_ref() == Some(&error) {
            tracing::debug!(error, attempts = self.count, retry_in = ?pause, "registration with the kubelet failed again");
            return pause;
        }
        tracing::warn!(
            error,
            retry_in = ?pause,
            max_pause = ?self.backoff.cap(),
            "registration with the kubelet failed; retrying with growing pauses, logged again only if the error changes"
        );
        self.logged = Some(error);
        pause
    }

    fn failing(&self) -> bool {
        self.count > 0
    }

    /// A registration worked: how many failed before it, if any.
    fn recovered(&mut self) -> Option<u32> {
        let failed = std::mem::take(self).count;
        (failed > 0).then_some(failed)
    }
}

/// Holds the device-plugin dir for one plugin: two plugins on one dir would replace each
/// other's socket and re-register in turn forever.
pub(crate) struct DirLock {
    _dir: Flock<File>,
}

/// Takes an exclusive `flock` on `dir` itself. A lock on the directory needs no file of its
/// own: nothing to create on a full disk, and nothing for the kubelet's clean-up to touch.
/// Another holder, or a dir that cannot be locked, is fatal; a dir that cannot be created or
/// opened is retried, as the dir watch is.
pub(crate) async fn lock_dir(
    dir: &Path,
    shutdown: &CancellationToken,
) -> anyhow::Result<Result<DirLock, Stopped>> {
    let taken =
        persist("cannot lock the device-plugin dir", shutdown, || {
            std::fs::create_dir_all(dir)
                .and_then(|()| File::open(dir))
                .with_context(|| format!("device-plugin dir {}", dir.display()))
                .map(
                    |file| match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                        Ok(locked) => Ok(DirLock { _dir: locked }),
                        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(anyhow::anyhow!(
                            "another efa-device-plugin is running on {}: it holds the dir's lock",
                            dir.display()
                        )),
                        Err((_, errno)) => Err(anyhow::Error::from(errno)
                            .context(format!("locking {}", dir.display()))),
                    },
                )
        })
        .await;
    match taken {
        Ok(locked) => locked.map(Ok),
        Err(Stopped) => Ok(Err(Stopped)),
    }
}

/// Repeats `attempt` every [`LAST_RETRY`] until it succeeds, logging the first failure only.
async fn persist<T>(
    what: &str,
    shutdown: &CancellationToken,
    mut attempt: impl FnMut() -> anyhow::Result<T>,
) -> Result<T, Stopped> {
    let mut logged = false;
    let mut retry = Backoff::constant(LAST_RETRY);
    loop {
        match attempt() {
            Ok(done) => return Ok(done),
            Err(err) if !logged => {
                tracing::error!(error = %format!("{err:#}"), "{what}; retrying");
                logged = true;
            }
            Err(_) => {}
        }
        if !retry.sleep(shutdown).await {
            return Err(Stopped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_registrations_pause_longer_until_one_works() {
        let mut failures = Failures::default();
        let pauses: Vec<u64> = (0..9)
            .map(|_| failures.failed("refused".into()).as_millis() as u64)
            .collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert!(failures.failing());
        assert_eq!(failures.recovered(), Some(9));
        assert_eq!(failures.recovered(), None);
        assert_eq!(failures.failed("refused".into()), FIRST_RETRY);
    }

    #[test]
    fn a_churning_kubelet_is_registered_with_at_once_then_with_growing_pauses() {
        let mut churn = Churn::default();
        let pauses: Vec<Option<u64>> = (0..12)
            .map(|_| churn.stream_ended().map(|p| p.as_millis() as u64))
            .collect();
        let doubling = [
            100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000,
        ];
        assert_eq!(pauses[0], None, "a first ending re-registers at once");
        assert_eq!(pauses[1..], doubling.map(Some));
        assert!(churn.backing_off());
        churn.settle();
        assert!(!churn.backing_off());
        assert_eq!(churn.stream_ended(), None);
        assert_eq!(churn.stream_ended(), Some(FIRST_RETRY));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_setup_is_retried_every_five_seconds_until_it_works_or_shutdown() {
        let shutdown = CancellationToken::new();
        let started = tokio::time::Instant::now();
        let mut tries = Vec::new();
        let done = persist("cannot set up", &shutdown, || {
            tries.push(started.elapsed().as_secs());
            if tries.len() < 4 {
                anyhow::bail!("not yet");
            }
            Ok("set up")
        })
        .await;
        assert_eq!(done, Ok("set up"));
        assert_eq!(tries, [0, 5, 10, 15]);

        let stopping = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(7)).await;
            stopping.cancel();
        });
        let started = tokio::time::Instant::now();
        let never = persist("cannot set up", &shutdown, || anyhow::bail!("never"));
        assert_eq!(never.await, Err::<(), _>(Stopped));
        assert_eq!(started.elapsed(), Duration::from_secs(7));
    }
}
