//! Static pods: their manifests, what their containers record, and the waits on them.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};

use crate::kubelet::{Checkpoint, PodStatus, pod_status};
use crate::note;
use crate::wait::{secs, wait_for, wait_until};

/// What a probe container runs unless told otherwise: it records `/dev/infiniband` once at
/// start into `/out/ls`, then every second into `/out/now`.
const RECORD_DEVICES: &str = "ls -l /dev/infiniband >/out/ls 2>&1; while true; do ls -l /dev/infiniband >/out/now.tmp 2>&1; mv /out/now.tmp /out/now; sleep 1; done";

/// The static pods of the standalone kubelet: manifests under `<run>/manifests`, each pod's
/// output under `<run>/out/<name>`.
pub struct Pods {
    pub run: PathBuf,
    pub node: String,
    pub read_only_port: u16,
    pub resource: String,
    pub checkpoint: Checkpoint,
}

/// A pod's container restart policy, as the manifest spells it.
#[derive(Clone, Copy)]
pub enum Restart {
    Never,
    Always,
}

impl Pods {
    fn manifests(&self) -> PathBuf {
        self.run.join("manifests")
    }

    pub fn out(&self, name: &str) -> PathBuf {
        self.run.join("out").join(name)
    }

    /// A static pod asking for `count` EFAs whose container records its devices, or runs
    /// `script` instead.
    pub fn write(
        &self,
        name: &str,
        count: u32,
        restart: Restart,
        script: Option<&str>,
    ) -> Result<()> {
        let out = self.make_out(name)?;
        let policy = match restart {
            Restart::Never => "Never",
            Restart::Always => "Always",
        };
        let manifest = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "hostNetwork": true, "restartPolicy": policy, "terminationGracePeriodSeconds": 1,
                "containers": [{
                    "name": "probe", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
                    "command": ["sh", "-c", script.unwrap_or(RECORD_DEVICES)],
                    "resources": {"limits": {self.resource.clone(): count}},
                    "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
                "volumes": [{"name": "out", "hostPath": {"path": out, "type": "Directory"}}]}});
        self.publish(name, &manifest)
    }

    /// The pod's output dir, made: its containers write there through the `out` volume.
    pub fn make_out(&self, name: &str) -> Result<PathBuf> {
        let out = self.out(name);
        fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
        Ok(out)
    }

    /// Hands the kubelet the static pod `manifest` as `name`.
    pub fn publish(&self, name: &str, manifest: &Value) -> Result<()> {
        let staged = self.run.join("manifests.tmp").join(format!("{name}.json"));
        fs::write(&staged, manifest.to_string())?;
        // A rename, so the kubelet never reads a half-written manifest.
        fs::rename(&staged, self.manifests().join(format!("{name}.json")))
            .with_context(|| format!("publish the manifest of {name}"))
    }

    /// The status of the static pod `name` (the kubelet names it `<name>-<node>`).
    pub fn status(&self, name: &str) -> PodStatus {
        pod_status(self.read_only_port, &format!("{name}-{}", self.node))
    }

    pub fn phase_is(&self, name: &str, phase: &str) -> bool {
        self.status(name).phase() == phase
    }

    /// Waits up to 60 s for `name` in `phase`; the error quotes its status.
    pub fn wait_phase(&self, name: &str, phase: &str, failure: &str) -> Result<PodStatus> {
        wait_for(&format!("pod {name} {phase}"), secs(60), || {
            let status = self.status(name);
            Ok((status.phase() == phase).then_some(status))
        })
        .map_err(|_| anyhow!("pod {name} {failure} within 60s: {}", self.status(name)))
    }

    /// The pod runs, the checkpoint gives it `count` devices, and its container saw exactly
    /// their nodes, which `expected` lists for IDs. The pod's device IDs.
    pub fn wait_running(
        &self,
        name: &str,
        count: usize,
        expected: impl Fn(&[String]) -> Result<BTreeSet<String>>,
    ) -> Result<Vec<String>> {
        let status = self.wait_phase(name, "Running", "not Running")?;
        let PodStatus::Listed { uid, .. } = status else {
            bail!("pod {name} Running without a uid");
        };
        let ids = self.checkpoint.allocated(&uid, &self.resource);
        if ids.len() != count {
            bail!(
                "checkpoint gives pod {name} {} devices [{}], want {count}",
                ids.len(),
                ids.join(" ")
            );
        }
        let ls = self.out(name).join("ls");
        wait_until("listing", secs(20), || {
            fs::metadata(&ls).is_ok_and(|m| m.len() > 0)
        })
        .map_err(|_| anyhow!("pod {name} wrote no listing of /dev/infiniband"))?;
        let raw = fs::read_to_string(&ls)?;
        let got = listing_entries(&raw);
        let want = expected(&ids)?;
        if got != want {
            bail!(
                "pod {name} sees [{}] in /dev/infiniband, want [{}]; raw: {}",
                joined(&got, ";"),
                joined(&want, ";"),
                raw.lines().collect::<Vec<_>>().join("|")
            );
        }
        Ok(ids)
    }

    /// Admission rejects the pod, naming the resource.
    pub fn wait_rejected(&self, name: &str, count: u32) -> Result<()> {
        let status = self.wait_phase(name, "Failed", &format!("asking for {count} not Failed"))?;
        let PodStatus::Listed {
            reason, message, ..
        } = &status
        else {
            bail!("pod {name} Failed but not listed");
        };
        if reason != "UnexpectedAdmissionError" || !message.contains(&self.resource) {
            bail!("pod {name} rejected with reason {reason}, message: {message}");
        }
        note(&format!("pod {name}: {reason}: {message}"));
        Ok(())
    }

    /// Removes `name`'s manifest and waits up to 60 s for the kubelet to drop the pod.
    pub fn remove(&self, name: &str) -> Result<()> {
        let _ = fs::remove_file(self.manifests().join(format!("{name}.json")));
        self.wait_absent(name)
    }

    /// [`Pods::remove`], and its output dir with it.
    pub fn remove_with_output(&self, name: &str) -> Result<()> {
        let _ = fs::remove_file(self.manifests().join(format!("{name}.json")));
        self.remove_output(name)
    }

    fn wait_absent(&self, name: &str) -> Result<()> {
        wait_until(&format!("pod {name} gone"), secs(60), || {
            self.phase_is(name, "Absent")
        })
        .map_err(|_| anyhow!("pod {name} still listed 60s after its manifest was removed"))
    }

    /// Every static pod but those in `keep` gone, with its output dir.
    pub fn remove_all_but(&self, keep: &[&str]) -> Result<()> {
        for manifest in entries(&self.manifests())? {
            if !keep.contains(&stem(&manifest).as_str()) {
                let _ = fs::remove_file(&manifest);
            }
        }
        for out in entries(&self.run.join("out"))? {
            let name = stem(&out);
            if !keep.contains(&name.as_str()) {
                self.remove_output(&name)?;
            }
        }
        Ok(())
    }

    /// Once the kubelet has dropped pod `name`, its output dir goes.
    fn remove_output(&self, name: &str) -> Result<()> {
        self.wait_absent(name)?;
        let out = self.out(name);
        // The kubelet stops listing a static pod before its container has stopped, and a
        // container still writing there fails a single removal.
        wait_until("output removed", secs(30), || {
            fs::remove_dir_all(&out).is_ok() || !out.exists()
        })
        .map_err(|_| {
            anyhow!(
                "{}/ still written 30s after pod {name} left the kubelet's list",
                out.display()
            )
        })
    }

    /// The names of the pods that have a manifest, for the diagnostics of a failed case.
    pub fn names(&self) -> Vec<String> {
        entries(&self.manifests())
            .unwrap_or_default()
            .iter()
            .map(|p| stem(p))
            .collect()
    }
}

fn entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut all = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        all.push(entry?.path());
    }
    all.sort();
    Ok(all)
}

fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `c MAJOR MINOR NAME` for each entry of a busybox `ls -l` listing; `total` and short lines
/// (an error message) are skipped.
pub fn listing_entries(listing: &str) -> BTreeSet<String> {
    listing
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 6 || fields[0] == "total" {
                return None;
            }
            let kind = &fields[0][..1];
            let major = fields[4].replacen(',', "", 1);
            Some(format!(
                "{kind} {major} {} {}",
                fields[5],
                fields[fields.len() - 1]
            ))
        })
        .collect()
}

pub fn joined(entries: &BTreeSet<String>, separator: &str) -> String {
    entries.iter().cloned().collect::<Vec<_>>().join(separator)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busybox_listing_gives_type_numbers_and_name() {
        let listing = "total 0\n\
            crw-rw-rw-    1 0        0         231, 193 Dec  3 17:00 uverbs1\n\
            crw-rw-rw-    1 0        0         231, 192 Dec  3 17:00 uverbs0\n";
        assert_eq!(
            listing_entries(listing).into_iter().collect::<Vec<_>>(),
            ["c 231 192 uverbs0", "c 231 193 uverbs1"]
        );
        assert!(listing_entries("total 0\n").is_empty());
    }
}
