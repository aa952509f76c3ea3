//! Shared harness for the integration tests: a simulated node, the in-process kubelet
//! stand-in, and the real plugin binary as a child process.

// Each test crate uses a different part of the harness.
#![allow(dead_code)]

pub(crate) mod readme_table;

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use efa_device_plugin::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest,
    ContainerPreferredAllocationRequest, PreferredAllocationRequest,
};
use efa_device_plugin::testkit::kubelet_stub::{KubeletStub, KubeletView};
use efa_device_plugin::testkit::simulate::{FakeDevice, FakeNode, Nodes, Shape};
use tempfile::TempDir;

pub(crate) const TIMEOUT: Duration = Duration::from_secs(10);
pub(crate) const BINARY: &str = env!("CARGO_BIN_EXE_efa-device-plugin");

/// The plugin a harness starts: this build's, or the one `EFA_DP_HARNESS_BINARY` names, so a
/// benchmark can measure an older build under the same load.
fn plugin_binary() -> String {
    std::env::var("EFA_DP_HARNESS_BINARY").unwrap_or_else(|_| BINARY.to_owned())
}

/// Real character devices when the tests may create them, empty files otherwise.
pub(crate) fn node_kind() -> Nodes {
    if nix::unistd::geteuid().is_root() {
        Nodes::CharDevices
    } else {
        Nodes::Files
    }
}

/// The flags that point the binary at `node`: its sysfs and dev roots, and, when its device
/// nodes are regular files (no root, no mknod), the test-only switch that judges them healthy.
pub(crate) fn node_args(node: &FakeNode) -> Vec<String> {
    let test_only = match node.nodes {
        Nodes::Files => Some("--test-only-regular-file-nodes=true".to_owned()),
        Nodes::CharDevices => None,
    };
    [
        "--sysfs-root".to_owned(),
        node.sysfs.display().to_string(),
        "--dev-root".to_owned(),
        node.dev.display().to_string(),
    ]
    .into_iter()
    .chain(test_only)
    .collect()
}

pub(crate) struct Harness {
    pub root: TempDir,
    pub node: FakeNode,
    /// Every simulated RDMA device, EFA or not.
    pub devices: Vec<FakeDevice>,
    pub plugin_dir: PathBuf,
    pub kubelet: KubeletStub,
    pub log: PathBuf,
    plugin: Option<Child>,
}

impl Harness {
    /// Builds `shape` and starts the kubelet stand-in. Call inside a tokio runtime.
    pub(crate) fn new(shape: Shape) -> Self {
        let root = tempfile::Builder::new()
            .prefix("efa-dp-test.")
            .tempdir()
            .expect("temp dir");
        let (node, devices) = FakeNode::build(root.path(), shape, node_kind()).expect("fake node");
        let plugin_dir = root.path().join("device-plugins");
        let kubelet = KubeletStub::start(&plugin_dir).expect("kubelet stand-in");
        let log = root.path().join("plugin.log");
        Harness {
            root,
            node,
            devices,
            plugin_dir,
            kubelet,
            log,
            plugin: None,
        }
    }

    pub(crate) fn efas(&self) -> Vec<&FakeDevice> {
        self.devices.iter().filter(|d| d.is_efa()).collect()
    }

    /// The flags pointing the plugin at this harness: its node ([`node_args`]), its HTTP
    /// endpoint on an ephemeral loopback port, and the kubelet's other dirs inside the harness,
    /// never the host's.
    pub(crate) fn args(&self) -> Vec<String> {
        let kubelet_dir = |name: &str| self.root.path().join(name).display().to_string();
        let plugin_dir = self.plugin_dir.display().to_string();
        let pod_resources = kubelet_dir("pod-resources/kubelet.sock");
        let plugins_registry = kubelet_dir("plugins_registry");
        let harness = [
            "--device-plugin-dir",
            &plugin_dir,
            "--rescan-interval",
            "200ms",
            "--metrics-address",
            "127.0.0.1:0",
            "--pod-resources-socket",
            &pod_resources,
            "--plugins-registry-dir",
            &plugins_registry,
        ]
        .map(str::to_owned);
        node_args(&self.node).into_iter().chain(harness).collect()
    }

    /// Starts the plugin binary with the harness flags followed by `extra` (later flags win).
    pub(crate) fn spawn_plugin(&mut self, extra: &[&str]) -> u32 {
        self.spawn_plugin_with(extra, |_| {})
    }

    /// [`Self::spawn_plugin`], with `adjust` applied to the command first.
    pub(crate) fn spawn_plugin_with(
        &mut self,
        extra: &[&str],
        adjust: impl FnOnce(&mut Command),
    ) -> u32 {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut command = Command::new(plugin_binary());
        command
            .args(self.args())
            .args(extra)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        adjust(&mut command);
        let child = command.spawn().expect("spawn plugin");
        let pid = child.id();
        self.plugin = Some(child);
        pid
    }

    pub(crate) fn plugin_pid(&self) -> u32 {
        self.plugin.as_ref().expect("plugin running").id()
    }

    /// The plugin's exit status once it has exited by itself; it is then no longer running.
    pub(crate) fn plugin_exited(&mut self) -> Option<ExitStatus> {
        let status = self.plugin.as_mut()?.try_wait().expect("wait")?;
        self.plugin = None;
        Some(status)
    }

    pub(crate) fn plugin_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for `done`, failing the test with the kubelet's view and the plugin's log.
    pub(crate) async fn wait(
        &self,
        what: &str,
        done: impl Fn(&KubeletView) -> bool,
    ) -> KubeletView {
        match self.kubelet.wait_for(TIMEOUT, done).await {
            Ok(view) => view,
            Err(view) => panic!(
                "timed out waiting for {what}\nkubelet view: {view:#?}\nplugin log:\n{}",
                self.plugin_log()
            ),
        }
    }

    /// Waits until the plugin is registered with its stream open and every EFA listed.
    pub(crate) async fn registered(&self) -> KubeletView {
        let expected = self.efas().len();
        self.wait("registration", |v| {
            v.stream_open && v.snapshots > 0 && v.devices.len() == expected
        })
        .await
    }

    /// [`Self::registered`], and the plugin has logged it: the kubelet sees the stream inside
    /// `Register`, a moment before the plugin's call returns and it logs.
    pub(crate) async fn registered_and_logged(&self) -> KubeletView {
        let view = self.registered().await;
        eventually("the registration log line", || {
            self.plugin_log().contains("registered with the kubelet")
        })
        .await;
        view
    }

    /// Sends SIGTERM and waits for the exit.
    pub(crate) fn terminate_plugin(&mut self) -> (ExitStatus, Duration) {
        self.stop_plugin(nix::sys::signal::Signal::SIGTERM)
    }

    /// Sends `sig` and waits for the exit; returns the status and how long it took.
    pub(crate) fn stop_plugin(&mut self, sig: nix::sys::signal::Signal) -> (ExitStatus, Duration) {
        let mut child = self.plugin.take().expect("plugin running");
        let started = Instant::now();
        signal(child.id(), sig);
        let deadline = started + TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return (status, started.elapsed());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("plugin ignored SIGTERM\n{}", self.plugin_log());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub(crate) fn plugin_socket(&self) -> PathBuf {
        self.plugin_dir.join("efa-device-plugin.sock")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(mut child) = self.plugin.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `done` until it holds, failing the test after [`TIMEOUT`].
pub(crate) async fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).expect("signal");
}

/// Open file descriptors and threads of a process, to catch leaks across restarts.
pub(crate) fn fds_and_tasks(pid: u32) -> (usize, usize) {
    let count = |dir: &str| {
        std::fs::read_dir(Path::new("/proc").join(pid.to_string()).join(dir))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    (count("fd"), count("task"))
}

/// The binary with `args` and `env` and none of the caller's settings from the environment.
pub(crate) fn binary_command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(BINARY);
    command
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (key, _) in std::env::vars() {
        if key.starts_with("EFA_DP_") {
            command.env_remove(key);
        }
    }
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

/// Runs the binary to completion with `args` and `env`, returning (exit code, stdout, stderr).
pub(crate) fn run_binary(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let output = binary_command(args, env).output().expect("run binary");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Writes `text` as `config.yaml` in `dir`; returns its path.
pub(crate) fn write_config(dir: &Path, text: &str) -> String {
    let path = dir.join("config.yaml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// Asserts a failed start: non-zero exit and exactly one line on stderr containing `names`.
pub(crate) fn assert_one_line_error(result: (i32, String, String), names: &[&str]) {
    let (code, _, stderr) = result;
    assert_ne!(code, 0, "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "not one line: {stderr:?}");
    for name in names {
        assert!(stderr.contains(name), "{stderr:?} does not name {name:?}");
    }
}

/// An Allocate request as the kubelet sends it: one container per slice of IDs.
pub(crate) fn allocate_request(containers: &[&[&str]]) -> AllocateRequest {
    AllocateRequest {
        container_requests: containers
            .iter()
            .map(|ids| ContainerAllocateRequest {
                devices_ids: ids.iter().map(|id| (*id).to_owned()).collect(),
            })
            .collect(),
    }
}

impl Harness {
    /// One Allocate call over the plugin's socket, as the kubelet makes it.
    pub(crate) async fn allocate(
        &self,
        containers: &[&[&str]],
    ) -> Result<AllocateResponse, tonic::Status> {
        let mut client = self.kubelet.plugin().expect("plugin connection");
        client
            .allocate(allocate_request(containers))
            .await
            .map(tonic::Response::into_inner)
    }

    /// One GetPreferredAllocation call for one container with nothing it must include; the
    /// IDs the plugin prefers.
    pub(crate) async fn prefer(&self, available: Vec<String>, size: i32) -> Vec<String> {
        let mut client = self.kubelet.plugin().expect("plugin connection");
        let mut response = client
            .get_preferred_allocation(PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: available,
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: size,
                }],
            })
            .await
            .expect("GetPreferredAllocation")
            .into_inner();
        response.container_responses.remove(0).device_i_ds
    }

    /// Where the plugin's HTTP endpoint listens: the harness asks for an ephemeral loopback
    /// port, and the plugin logs the one it bound.
    pub(crate) async fn metrics_address(&self) -> SocketAddr {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let log = self.plugin_log();
            // The latest start's line: a harness may run the plugin several times.
            let found = log
                .lines()
                .rev()
                .filter(|line| line.contains("serving /metrics"))
                .find_map(logged_address);
            if let Some(address) = found {
                return address;
            }
            assert!(
                Instant::now() < deadline,
                "no metrics address logged\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// GETs `path` from the plugin's HTTP endpoint: (status, body).
    pub(crate) async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.metrics_address().await, path).await
    }

    /// Scrapes until `done` holds for the exposition text, failing with the last one.
    pub(crate) async fn scrape_until(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let (status, text) = self.get("/metrics").await;
            assert_eq!(status, 200, "{text}");
            if done(&text) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\nlast scrape:\n{text}\nplugin log:\n{}",
                self.plugin_log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The `address` field of a text or JSON log line.
fn logged_address(line: &str) -> Option<SocketAddr> {
    let (_, rest) = line
        .split_once("address=")
        .or_else(|| line.split_once("\"address\":\""))?;
    rest.split(|c: char| c.is_whitespace() || c == '"')
        .next()?
        .parse()
        .ok()
}

/// A minimal HTTP/1.1 GET: (status, body).
pub(crate) async fn http_get(address: SocketAddr, path: &str) -> (u16, String) {
    try_http_get(address, path)
        .await
        .unwrap_or_else(|| panic!("no HTTP answer for {path} from {address}"))
}

/// [`http_get`], or `None` when the plugin closes the connection without an answer, as it
/// does past its connection cap or deadline.
pub(crate) async fn try_http_get(address: SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .unwrap_or_else(|e| panic!("connecting to {address}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("status code");
    let chunked = head
        .lines()
        .any(|line| line.eq_ignore_ascii_case("transfer-encoding: chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Some((status, body))
}

/// The body of a chunked HTTP/1.1 answer: each chunk is its size in hex, CRLF, the data, CRLF.
fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").expect("chunk size");
        let size = usize::from_str_radix(size.trim(), 16).expect("chunk size in hex");
        if size == 0 {
            return body;
        }
        body.push_str(&after[..size]);
        rest = after[size..].strip_prefix("\r\n").expect("chunk end");
    }
}

/// The value of the sample `series` (name with its exact label set, as exposed).
pub(crate) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// A `/proc/<pid>/status` figure in KiB (`VmRSS`, `VmHWM`); 0 if it cannot be read.
pub(crate) fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The longest name Kubernetes accepts of its kind, `len` long (a namespace or a container
/// name is a DNS label, 63; a pod name a DNS subdomain, 253), made unique by `i`.
pub(crate) fn longest_name(prefix: &str, i: usize, len: usize) -> String {
    let mut name = format!("{prefix}{i:03}-");
    name.extend(std::iter::repeat_n('x', len - name.len()));
    name
}

/// `pods` pods with the longest names, pod `k` holding replica `k` of every EFA in `efas`, so
/// each EFA has `pods` holders: the most pod names a scrape can carry for those EFAs.
pub(crate) fn pods_holding_every_efa(
    efas: &[FakeDevice],
    pods: usize,
) -> Vec<efa_device_plugin::proto::podresources::PodResources> {
    (0..pods)
        .map(|k| {
            let ids: Vec<String> = efas.iter().map(|d| format!("{}::{k}", d.ibdev)).collect();
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            efa_device_plugin::testkit::pod_resources_stub::pod(
                &longest_name("ns", k % 4, 63),
                &longest_name("pod", k, 253),
                &longest_name("c", k, 63),
                "vpc.amazonaws.com/efa",
                &ids,
            )
        })
        .collect()
}

/// Opens a ListAndWatch stream of its own to the plugin, as another client would, and reads its
/// first list; the plugin's status if it refuses or ends the stream instead.
pub(crate) async fn open_list_stream(
    h: &Harness,
) -> Result<
    (
        tonic::Streaming<efa_device_plugin::proto::deviceplugin::ListAndWatchResponse>,
        efa_device_plugin::proto::deviceplugin::ListAndWatchResponse,
    ),
    tonic::Status,
> {
    use efa_device_plugin::proto::deviceplugin::{Empty, device_plugin_client::DevicePluginClient};
    let channel = efa_device_plugin::uds::dial(&h.plugin_socket())
        .await
        .expect("plugin connection");
    let mut stream = DevicePluginClient::new(channel)
        .list_and_watch(Empty {})
        .await?
        .into_inner();
    match stream.message().await? {
        Some(list) => Ok((stream, list)),
        None => Err(tonic::Status::unknown(
            "the stream ended before its first list",
        )),
    }
}
