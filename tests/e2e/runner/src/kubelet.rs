//! The standalone kubelet under test and what the suite reads back from it: its log, its
//! device checkpoint and its read-only `/pods`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::daemon::{Daemon, tail};
use crate::http;
use crate::wait::{secs, wait_until};

/// The kubelet, started from the config the suite's bash wrote into the run dir; up or stopped.
pub struct Kubelet {
    binary: PathBuf,
    run: PathBuf,
    node: String,
    healthz_port: u16,
    starts: u32,
    daemon: Option<Daemon>,
}

impl Kubelet {
    pub fn new(binary: PathBuf, run: PathBuf, node: String, healthz_port: u16) -> Kubelet {
        Kubelet {
            binary,
            run,
            node,
            healthz_port,
            starts: 0,
            daemon: None,
        }
    }

    /// Starts it (as `start_kubelet` of lib/standalone.sh did) and waits up to 60 s for its
    /// healthz; the error quotes its log.
    pub fn start(&mut self) -> Result<()> {
        self.starts += 1;
        let root = self.run.join("kubelet");
        let mut command = Command::new(&self.binary);
        command
            .arg(format!("--config={}", root.join("config.yaml").display()))
            .arg(format!("--root-dir={}", root.join("root").display()))
            .arg(format!("--cert-dir={}", root.join("pki").display()))
            .arg(format!("--hostname-override={}", self.node))
            .arg("--v=2");
        self.daemon = Some(Daemon::start(
            "kubelet",
            command,
            &self.log(),
            &self.run.join("pids"),
        )?);
        let port = self.healthz_port;
        wait_until("kubelet healthy", secs(60), || {
            http::get(port, "/healthz").is_ok()
        })
        .map_err(|_| anyhow::anyhow!("kubelet not healthy within 60s: {}", tail(&self.log(), 3)))
    }

    pub fn stop(&mut self) -> Result<()> {
        if let Some(daemon) = self.daemon.take() {
            daemon.stop(Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// The log of the current (last started) kubelet.
    pub fn log(&self) -> PathBuf {
        self.run
            .join("logs")
            .join(format!("kubelet.{}.log", self.starts))
    }

    /// Registrations of `resource` the current kubelet logged.
    pub fn registrations(&self, resource: &str) -> usize {
        registrations_in(&self.log(), resource)
    }
}

/// Registrations of `resource` a kubelet's log holds.
pub fn registrations_in(log: &Path, resource: &str) -> usize {
    let quoted = format!("\"{resource}\"");
    fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|line| {
            line.split_once("Got registration request from device plugin with resource")
                .is_some_and(|(_, rest)| rest.contains(&quoted))
        })
        .count()
}

/// The kubelet's device checkpoint (`kubelet_internal_checkpoint`).
pub struct Checkpoint {
    pub path: PathBuf,
}

impl Checkpoint {
    fn data(&self) -> Result<Value> {
        let text = fs::read_to_string(&self.path)
            .with_context(|| format!("read {}", self.path.display()))?;
        let mut all: Value = serde_json::from_str(&text)
            .with_context(|| format!("parse {}", self.path.display()))?;
        Ok(all["Data"].take())
    }

    /// The IDs it lists as registered for `resource`, sorted; none when it cannot be read
    /// (the kubelet rewrites it in place).
    pub fn registered(&self, resource: &str) -> Vec<String> {
        let Ok(data) = self.data() else {
            return Vec::new();
        };
        let mut ids: Vec<String> = strings(&data["RegisteredDevices"][resource]).collect();
        ids.sort();
        ids
    }

    /// The IDs it records for pod `uid` under `resource`, over all its containers, sorted.
    pub fn allocated(&self, uid: &str, resource: &str) -> Vec<String> {
        let ids: BTreeSet<String> = self
            .devices(uid, resource)
            .into_iter()
            .map(|device| device.id)
            .collect();
        ids.into_iter().collect()
    }

    /// What it records for pod `uid` under `resource`: each device with its container and the
    /// NUMA key the plugin reported, sorted; none when it cannot be read.
    pub fn devices(&self, uid: &str, resource: &str) -> BTreeSet<Assigned> {
        let Ok(data) = self.data() else {
            return BTreeSet::new();
        };
        let mut devices = BTreeSet::new();
        for entry in data["PodDeviceEntries"].as_array().into_iter().flatten() {
            if entry["PodUID"] == uid && entry["ResourceName"] == resource {
                let container = entry["ContainerName"].as_str().unwrap_or_default();
                for (numa, ids) in entry["DeviceIDs"].as_object().into_iter().flatten() {
                    devices.extend(strings(ids).map(|id| Assigned {
                        container: container.to_owned(),
                        numa: numa.clone(),
                        id,
                    }));
                }
            }
        }
        devices
    }
}

/// A device the checkpoint gives a container: under the NUMA key the plugin reported for it
/// (`-1`: none).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Assigned {
    pub container: String,
    pub numa: String,
    pub id: String,
}

fn strings(list: &Value) -> impl Iterator<Item = String> + '_ {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|id| id.as_str().map(str::to_owned))
}

/// A static pod as the kubelet's `/pods` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodStatus {
    Absent,
    /// The read-only port did not answer (the kubelet is restarting).
    Unreachable,
    Listed {
        phase: String,
        reason: String,
        uid: String,
        message: String,
        /// Over all its containers.
        restarts: u64,
    },
}

impl PodStatus {
    pub fn phase(&self) -> &str {
        match self {
            PodStatus::Absent => "Absent",
            PodStatus::Unreachable => "Unreachable",
            PodStatus::Listed { phase, .. } => phase,
        }
    }

    pub fn restarts(&self) -> u64 {
        match self {
            PodStatus::Listed { restarts, .. } => *restarts,
            _ => 0,
        }
    }
}

/// Phase, reason, uid and message, tab-separated, as the bash suites quoted a pod's status.
impl std::fmt::Display for PodStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PodStatus::Listed {
                phase,
                reason,
                uid,
                message,
                ..
            } => write!(f, "{phase}\t{reason}\t{uid}\t{message}"),
            other => f.write_str(other.phase()),
        }
    }
}

/// The status of the pod named `name` in the kubelet's `/pods` on `port`.
pub fn pod_status(port: u16, name: &str) -> PodStatus {
    let Ok(body) = http::get(port, "/pods") else {
        return PodStatus::Unreachable;
    };
    let Ok(pods) = serde_json::from_str::<Value>(&body) else {
        return PodStatus::Unreachable;
    };
    find_pod(&pods, name)
}

fn find_pod(pods: &Value, name: &str) -> PodStatus {
    let Some(pod) = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|pod| pod["metadata"]["name"] == name)
    else {
        return PodStatus::Absent;
    };
    let status = &pod["status"];
    let text = |value: &Value, default: &str| {
        value
            .as_str()
            .filter(|s| !s.is_empty())
            .unwrap_or(default)
            .replace('\n', " ")
    };
    PodStatus::Listed {
        phase: text(&status["phase"], "Unknown"),
        reason: text(&status["reason"], "-"),
        uid: text(&pod["metadata"]["uid"], "-"),
        message: text(&status["message"], "-"),
        restarts: status["containerStatuses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["restartCount"].as_u64())
            .sum(),
    }
}

/// Whether `path` was written in a later second than `epoch` (Unix seconds).
pub fn modified_since(path: &Path, epoch: u64) -> bool {
    fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .is_some_and(|t| t.as_secs() > epoch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_pod_is_read_as_the_kubelet_lists_it() {
        let pods = json!({"items": [{
            "metadata": {"name": "holder-efa-e2e", "uid": "u1"},
            "status": {"phase": "Running", "message": "a\nb",
                       "containerStatuses": [{"restartCount": 2}, {"restartCount": 1}]}}]});
        let status = find_pod(&pods, "holder-efa-e2e");
        assert_eq!(status.to_string(), "Running\t-\tu1\ta b");
        assert_eq!(status.restarts(), 3);
        assert_eq!(find_pod(&pods, "other-efa-e2e"), PodStatus::Absent);
        assert_eq!(find_pod(&json!({"items": null}), "x"), PodStatus::Absent);
    }

    #[test]
    fn the_checkpoint_gives_registered_and_allocated_ids_sorted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint");
        fs::write(
            &path,
            json!({"Data": {
                "RegisteredDevices": {"r": ["b", "a"]},
                "PodDeviceEntries": [
                    {"PodUID": "u", "ResourceName": "r", "ContainerName": "c",
                     "DeviceIDs": {"0": ["d"], "1": ["c"]}},
                    {"PodUID": "v", "ResourceName": "r", "ContainerName": "c",
                     "DeviceIDs": {"0": ["a"]}}]}})
            .to_string(),
        )
        .unwrap();
        let checkpoint = Checkpoint { path };
        assert_eq!(checkpoint.registered("r"), ["a", "b"]);
        assert_eq!(checkpoint.allocated("u", "r"), ["c", "d"]);
        let keys: Vec<(String, String)> = checkpoint
            .devices("u", "r")
            .into_iter()
            .map(|d| (d.numa, d.id))
            .collect();
        assert_eq!(keys, [("0".into(), "d".into()), ("1".into(), "c".into())]);
        assert!(checkpoint.registered("other").is_empty());
    }

    #[test]
    fn only_registrations_of_the_resource_count() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("logs")).unwrap();
        let mut kubelet = Kubelet::new("kubelet".into(), dir.path().into(), "n".into(), 0);
        kubelet.starts = 1;
        fs::write(
            kubelet.log(),
            "I1 Got registration request from device plugin with resource name=\"vpc.amazonaws.com/efa\"\n\
             I2 Got registration request from device plugin with resource name=\"nvidia.com/gpu\"\n\
             I3 something else \"vpc.amazonaws.com/efa\"\n",
        )
        .unwrap();
        assert_eq!(kubelet.registrations("vpc.amazonaws.com/efa"), 1);
    }
}
