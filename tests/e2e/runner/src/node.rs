//! The host under test and its fixtures: the fake EFAs, the kubelet, the plugin, the static
//! pods. A case asks for what it needs through a fixture that is cheap when the state is
//! there already, so each case stands alone.

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use efa_device_plugin::testkit::simulate::{FakeDevice, FakeNode};

use crate::daemon::tail;
use crate::kubelet::{Kubelet, PodStatus};
use crate::plugin::Plugin;
use crate::pods::{Pods, Restart};
use crate::wait::{secs, wait_until};

/// The extended resource the plugin advertises the EFAs as: its default `--resource-name`.
pub const RESOURCE: &str = "vpc.amazonaws.com/efa";

pub struct Node {
    pub fake: FakeNode,
    /// The EFAs, by uverbs index.
    pub efas: Vec<FakeDevice>,
    pub device_plugin_dir: PathBuf,
    pub kubelet: Kubelet,
    pub plugin: Plugin,
    pub pods: Pods,
}

/// The static pod `holder` running with 2 EFAs: the running pod the restart cases expect to
/// keep its devices (the cluster suite's `ensure_holder` is its counterpart through the API).
pub struct Holder {
    pub ids: Vec<String>,
}

pub const HOLDER: &str = "holder";

impl Node {
    /// The device IDs (ibdev names) of the EFAs with these uverbs indexes, sorted as the
    /// checkpoint lists them.
    pub fn ids_of(&self, indexes: &[usize]) -> Vec<String> {
        let mut ids: Vec<String> = indexes
            .iter()
            .map(|&i| self.efas[i].ibdev.clone())
            .collect();
        ids.sort();
        ids
    }

    pub fn all_ids(&self) -> Vec<String> {
        self.ids_of(&(0..self.efas.len()).collect::<Vec<_>>())
    }

    /// What `/dev/infiniband` must hold for these device IDs, as `listing_entries` gives it.
    pub fn expected_entries(&self, ids: &[String]) -> Result<BTreeSet<String>> {
        ids.iter()
            .map(|id| {
                let efa = self
                    .efas
                    .iter()
                    .find(|efa| &efa.ibdev == id || &efa.bdf == id)
                    .ok_or_else(|| anyhow!("{id} is none of the fake host's EFAs"))?;
                Ok(format!(
                    "c {} {} {}",
                    efa.dev.major,
                    efa.dev.minor,
                    efa.uverbs_name()
                ))
            })
            .collect()
    }

    pub fn registered(&self) -> Vec<String> {
        self.pods.checkpoint.registered(RESOURCE)
    }

    pub fn registrations(&self) -> usize {
        self.kubelet.registrations(RESOURCE)
    }

    /// The plugin runs on the fake host, started if it does not, and the kubelet's checkpoint
    /// lists its 4 IDs.
    pub fn ensure_plugin(&mut self) -> Result<()> {
        self.plugin.ensure_up()?;
        let all = self.all_ids();
        wait_until("registered", secs(30), || self.registered() == all).map_err(|_| {
            anyhow!(
                "checkpoint lists [{}] under {RESOURCE} after 30s, want [{}]; kubelet registrations: {}; plugin log: {}",
                self.registered().join(" "),
                all.join(" "),
                self.registrations(),
                tail(&self.plugin.log(), 3)
            )
        })
    }

    /// The holder runs with 2 EFAs, its manifest written if it is not running.
    pub fn ensure_holder(&mut self) -> Result<Holder> {
        self.ensure_plugin()?;
        if let PodStatus::Listed { phase, uid, .. } = self.pods.status(HOLDER)
            && phase == "Running"
        {
            return Ok(Holder {
                ids: self.pods.checkpoint.allocated(&uid, RESOURCE),
            });
        }
        self.run_pod(HOLDER, 2).map(|ids| Holder { ids })
    }

    /// A pod recording its devices, asking for `count`, runs with exactly its devices' nodes.
    pub fn run_pod(&self, name: &str, count: u32) -> Result<Vec<String>> {
        self.pods.write(name, count, Restart::Never, None)?;
        self.pods
            .wait_running(name, count as usize, |ids| self.expected_entries(ids))
    }

    /// A pod asking for `count` is rejected at admission, and removed.
    pub fn rejected_pod(&self, name: &str, count: u32) -> Result<()> {
        self.pods.write(name, count, Restart::Never, None)?;
        self.pods.wait_rejected(name, count)?;
        self.pods.remove(name)
    }

    /// The current kubelet logged more than `before` registrations and its checkpoint lists
    /// `ids`.
    pub fn registered_since(&self, before: usize, ids: &[String]) -> bool {
        self.registrations() > before && self.registered() == ids
    }

    /// Takes the uverbs node of EFA `index` away until the guard is restored or dropped.
    pub fn remove_node(&self, index: usize) -> Result<MissingNode> {
        let efa = self.efas[index].clone();
        self.fake
            .remove_node(&efa)
            .with_context(|| format!("remove {}", self.fake.node_path(&efa).display()))?;
        Ok(MissingNode {
            fake: self.fake.clone(),
            efa,
            restored: false,
        })
    }

    /// What a failed case leaves to read: each pod's status and the daemons' last lines.
    pub fn diagnostics(&self) -> Vec<String> {
        standalone_diagnostics(&self.pods, &self.kubelet, &self.plugin)
    }
}

/// Each static pod's status, then the kubelet's and the plugin's last log lines: what either
/// standalone suite shows after a failed case.
pub fn standalone_diagnostics(pods: &Pods, kubelet: &Kubelet, plugin: &Plugin) -> Vec<String> {
    let mut lines: Vec<String> = pods
        .names()
        .iter()
        .map(|name| format!("pod {name}: {}", pods.status(name)))
        .collect();
    lines.push(format!("kubelet log: {}", tail(&kubelet.log(), 3)));
    lines.push(format!("plugin log: {}", tail(&plugin.log(), 3)));
    lines
}

/// A uverbs node taken away; put back by [`MissingNode::restore`] or, if a case ends first, on
/// drop, so the next case finds the host whole.
pub struct MissingNode {
    fake: FakeNode,
    efa: FakeDevice,
    restored: bool,
}

impl MissingNode {
    pub fn path(&self) -> PathBuf {
        self.fake.node_path(&self.efa)
    }

    pub fn restore(mut self) -> Result<()> {
        self.restored = true;
        self.fake
            .create_node(&self.efa)
            .with_context(|| format!("restore {}", self.path().display()))
    }
}

impl Drop for MissingNode {
    fn drop(&mut self) {
        if !self.restored {
            let _ = self.fake.create_node(&self.efa);
        }
    }
}

/// Fails with `reason` unless `holds`.
pub fn ensure(holds: bool, reason: impl FnOnce() -> String) -> Result<()> {
    if !holds {
        bail!(reason());
    }
    Ok(())
}
