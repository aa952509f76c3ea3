//! (F2) `nodeScope.mode=labelled`: the plugin on the labelled nodes only, following the label.

use anyhow::{Context, Result, bail};

use super::{EFA_A, EFA_B, NAMES, PLAIN, serving};
use crate::cases::Detail;
use crate::cluster::Cluster;
use crate::wait::{secs, wait_until};

/// The label `labelled` mode keeps the plugin to (the chart's `nodeScope.label`, the labelled
/// overlay's node selector).
const SCOPE_LABEL: &str = "efa-device-plugin/enabled";

/// How the case installs the plugin in `labelled` mode.
#[derive(Clone, Copy)]
enum Install {
    Chart,
    Kustomize,
}

impl Install {
    fn name(self) -> &'static str {
        match self {
            Install::Chart => "the chart",
            Install::Kustomize => "the labelled overlay",
        }
    }

    /// The plugin installed anew this way, on the fleet; not yet serving, as only the labelled
    /// nodes will be.
    fn run(self, cluster: &mut Cluster) -> Result<()> {
        let (verb, args): (&str, &[&str]) = match self {
            Install::Chart => ("chart", &["--set", "nodeScope.mode=labelled"]),
            Install::Kustomize => ("labelled_kustomize", &[]),
        };
        cluster.host.request(verb, args).map(drop)
    }
}

/// (F2) With the chart and with kustomize in `labelled` mode, plugin pods run on the labelled
/// nodes only; a label added to `plain` starts one there, and its removal stops it.
pub fn labelled_scope(cluster: &mut Cluster) -> Result<Detail> {
    let outcome = [Install::Chart, Install::Kustomize]
        .into_iter()
        .try_for_each(|install| follows_the_label(cluster, install));
    // The fleet unlabelled and without the plugin, as the cases after expect to find it.
    let kube = &cluster.kube;
    let unlabelled = NAMES
        .iter()
        .try_for_each(|node| kube.label_node(node, SCOPE_LABEL, None));
    let uninstalled = cluster.host.request("uninstall", &[]);
    outcome?;
    unlabelled.context("removing the scope label")?;
    uninstalled.context("uninstalling the labelled plugin")?;
    Ok(format!(
        "chart and kustomize: pods on [{EFA_A} {EFA_B}], one on {PLAIN} while labelled"
    ))
}

/// The nodes with a plugin pod that is not terminating, sorted.
fn plugin_nodes(cluster: &Cluster) -> Result<Vec<String>> {
    let mut nodes: Vec<String> = cluster
        .kube
        .all_plugin_pods()?
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .map(|pod| pod.spec.node_name)
        .collect();
    nodes.sort();
    Ok(nodes)
}

fn follows_the_label(cluster: &mut Cluster, install: Install) -> Result<()> {
    let how = install.name();
    let want = [EFA_A, EFA_B];
    for node in NAMES {
        // A node without the label is what this step wants; kubectl's complaint about it is not.
        let _ = cluster.kube.label_node(node, SCOPE_LABEL, None);
    }
    for node in want {
        cluster
            .kube
            .label_node(node, SCOPE_LABEL, Some("true"))
            .context("cannot label the EFA nodes")?;
    }
    install.run(cluster)?;
    serving(&cluster.kube, &want)?;
    let nodes = plugin_nodes(cluster)?;
    if nodes != want {
        bail!(
            "{how}: plugin pods on [{}], want [{}]",
            nodes.join(" "),
            want.join(" ")
        );
    }

    let kube = &cluster.kube;
    kube.label_node(PLAIN, SCOPE_LABEL, Some("true"))?;
    wait_until(
        &format!("{how}: a Ready plugin pod on {PLAIN} after its label"),
        secs(60),
        || {
            kube.serving_plugin_pod(PLAIN)
                .is_ok_and(|pod| pod.is_some())
        },
    )?;
    kube.label_node(PLAIN, SCOPE_LABEL, None)?;
    wait_until(
        &format!(
            "{how}: plugin pods on [{}] only after {PLAIN} lost its label",
            want.join(" ")
        ),
        secs(60),
        || plugin_nodes(cluster).is_ok_and(|nodes| nodes == want),
    )
    .map_err(|err| {
        let nodes = plugin_nodes(cluster).map_or_else(|err| format!("{err:#}"), |n| n.join(" "));
        anyhow::anyhow!("{err}: plugin pods on [{nodes}]")
    })
}
