//! GPU-initiated networking without privileged: the chart installed as
//! docs/gpu-initiated-networking.md shows it, `extra-device-nodes: [/dev/gdrdrv]` with the node
//! mounted into the plugin pod, and a Job asking for EFAs sees `/dev/gdrdrv`, with the host's
//! number, next to exactly its uverbs nodes. The case installs its own release and removes it,
//! and the node, when it ends.

use std::fs;

use anyhow::{Context, Result, anyhow, bail, ensure};
use efa_device_plugin::discovery::DevNum;
use efa_device_plugin::testkit::simulate::make_char_device;
use serde_json::{Value, json};

use super::Cluster;
use super::fleet::{listing, uverbs_entries};
use super::single_node::{NODE, helm_template, installed_ok, running_job_pod, test_values};
use super::workload::short_job;
use crate::cases::Detail;
use crate::node::RESOURCE;
use crate::pods::{joined, listing_entries};

const GDRDRV: &str = "/dev/gdrdrv";
/// A major no driver of the suite's host holds (gdrdrv's own is dynamic): the container only
/// lists the node, it never opens it.
const GDRDRV_MAJOR: u32 = 235;
const RELEASE: &str = "gdrdrv";
const JOB: &str = "gdrdrv-job";

/// The suite's chart values plus the docs' settings for `/dev/gdrdrv`; the lists are the
/// suite's with the node added, as Helm replaces a list whole.
fn values(cluster: &Cluster) -> Result<String> {
    let path = test_values(cluster);
    let text = fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    let mut values: Value =
        serde_yaml::from_str(&text).with_context(|| format!("{path}: not YAML"))?;
    values["config"]["extra-device-nodes"] = json!([GDRDRV]);
    let add = |list: &mut Value, item: Value| -> Result<()> {
        list.as_array_mut()
            .with_context(|| format!("{path}: no list to extend"))?
            .push(item);
        Ok(())
    };
    add(
        &mut values["extraVolumes"],
        json!({"name": "gdrdrv", "hostPath": {"path": GDRDRV, "type": "CharDevice"}}),
    )?;
    add(
        &mut values["extraVolumeMounts"],
        json!({"name": "gdrdrv", "mountPath": GDRDRV, "readOnly": true}),
    )?;
    let written = cluster.run.join("values-gdrdrv.yaml");
    fs::write(&written, serde_yaml::to_string(&values)?)?;
    Ok(written.to_string_lossy().into_owned())
}

/// (16) With a character node made at `/dev/gdrdrv` and the chart installed with it as an extra
/// device node, a Job asking for 2 EFAs lists exactly its two uverbs nodes and `/dev/gdrdrv`
/// with the host's number.
pub fn extra_device_nodes(cluster: &mut Cluster) -> Result<Detail> {
    let node = cluster.host_path(NODE, GDRDRV)?;
    // A real GDRCopy on the suite's host is left alone.
    if node.exists() {
        bail!("{GDRDRV} exists on this host; the case makes its own");
    }
    cluster.host.request("uninstall", &[])?;
    make_char_device(
        &node,
        DevNum {
            major: GDRDRV_MAJOR,
            minor: 0,
        },
    )
    .with_context(|| format!("cannot create {}", node.display()))?;
    let outcome = with_gdrdrv(cluster);
    let job = format!("job/{JOB}");
    let cleaned = cluster
        .kube
        .delete(&[&job])
        .and_then(|()| cluster.host.request("helm_uninstall", &[RELEASE]).map(drop))
        .and_then(|()| {
            fs::remove_file(&node).with_context(|| format!("remove {}", node.display()))
        });
    let detail = outcome?;
    cleaned?;
    Ok(detail)
}

fn with_gdrdrv(cluster: &mut Cluster) -> Result<Detail> {
    let values = values(cluster)?;
    let shipped = helm_template(cluster, &["-f", &values])?;
    cluster
        .host
        .request("helm_install", &[RELEASE, "-f", &values])
        .map_err(|err| anyhow!("helm install with extra-device-nodes: {err:#}"))?;
    installed_ok(cluster, &shipped)?;
    cluster.kube.apply(&short_job(JOB, 2, &[GDRDRV]))?;
    let pod = running_job_pod(cluster, JOB)?;
    let ids = cluster
        .checkpoint(NODE)?
        .allocated(&pod.metadata.uid, RESOURCE);
    let got = listing_entries(&listing(cluster, &pod.metadata.name)?);
    let mut want = uverbs_entries(cluster, NODE, &ids)?;
    want.insert(format!("c {GDRDRV_MAJOR} 0 {GDRDRV}"));
    ensure!(
        ids.len() == 2 && got == want,
        "pod {} (EFAs [{}]) sees [{}], want [{}]",
        pod.metadata.name,
        ids.join(" "),
        joined(&got, ";"),
        joined(&want, ";")
    );
    Ok(format!(
        "{GDRDRV} ({GDRDRV_MAJOR}:0) beside uverbs of {}",
        ids.join(" ")
    ))
}
