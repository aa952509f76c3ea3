//! The suite's real Prometheus against the plugin on `efa-a`: what it is asked comes from the
//! files users get, read at run time (the README's metrics table and PromQL examples, the
//! dashboard's panels, the chart's alert rules that the suite's Prometheus evaluates).

use std::fs;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, ensure};
use efa_device_plugin::testkit::simulate::{FakeDevice, FakeNode};
use nix::sys::stat::Mode;
use nix::unistd::mkfifo;
use serde::Deserialize;

use super::counters::RisingCounters;
use super::fleet::node_efas;
use super::prometheus::{POD_JOB, Prometheus};
use super::single_node::{
    EFAS, HOLDER, Overlay, SETTLES, allocatable_settles, ensure_holder, ensure_plugin, run_job,
};
use super::{Cluster, EFA_A, NODE_STATUS_PERIOD};
use crate::cases::Detail;
use crate::wait::{secs, wait_for, wait_until};

/// The plugin's namespace and DaemonSet, however the suite installed it.
const PLUGIN_NAMESPACE: &str = "kube-system";
const DAEMONSET: &str = "daemonset/efa-device-plugin";
const HOLDER_CONTAINER: &str = "probe";
/// The EFA whose node the alert case takes away, by uverbs index.
const ALERT_EFA: usize = 3;
/// A DRA driver's registration, as DRANET's helper names its socket: while it is there the
/// plugin withholds every EFA.
const DRA_SOCKET: &str = "/var/lib/kubelet/plugins_registry/dra.net-reg.sock";
/// The alerts on the counters AWS names, which the rising counters set off.
const COUNTER_ALERTS: [&str; 3] = ["EfaReceiveDrops", "EfaRdmaReadErrors", "EfaRdmaWriteErrors"];
/// Grafana's variables, as the dashboard fills them on a 6h view: every node, and a rate window
/// that spans several scrapes.
const GRAFANA_VARIABLES: [(&str, &str); 2] = [("$node", ".*"), ("$__rate_interval", "5m")];

fn repo_file(path: &str) -> Result<String> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../..")
        .join(path);
    fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))
}

/// The README's section that starts with `heading`, up to the next `## ` heading.
fn section<'a>(text: &'a str, heading: &str) -> Result<&'a str> {
    let start = text
        .find(heading)
        .with_context(|| format!("no {heading:?}"))?;
    let rest = &text[start..];
    Ok(rest
        .get(1..)
        .and_then(|after| after.find("\n## "))
        .map_or(rest, |end| &rest[..=end]))
}

/// Each backticked metric name in the first column of the README's metrics table;
/// `efa_<counter>_total` stands for every hardware counter, so the concrete names in its row are
/// the families.
fn families(readme: &str) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for line in section(readme, "### Metrics")?.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 6 || !cells[1].starts_with("`efa") {
            continue;
        }
        let name = cells[1].trim_matches('`');
        if name.contains('<') {
            names.extend(
                cells[4]
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .filter(|word| {
                        word.starts_with("efa_")
                            && word.ends_with("_total")
                            && word.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                    })
                    .map(str::to_owned),
            );
        } else {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

/// The queries of every PromQL block: its lines that are not comments.
fn examples(readme: &str) -> Vec<String> {
    readme
        .split("```promql\n")
        .skip(1)
        .filter_map(|block| block.split_once("```").map(|(code, _)| code))
        .flat_map(str::lines)
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|line| line.trim().to_owned())
        .collect()
}

#[derive(Deserialize)]
struct Dashboard {
    panels: Vec<Panel>,
}

#[derive(Deserialize)]
struct Panel {
    title: String,
    #[serde(default)]
    targets: Vec<PanelTarget>,
}

#[derive(Deserialize)]
struct PanelTarget {
    expr: String,
}

/// Each panel query as `title: query`, with Grafana's variables filled in.
fn panels(dashboard: &str) -> Result<Vec<(String, String)>> {
    let dashboard: Dashboard = serde_json::from_str(dashboard).context("the dashboard's JSON")?;
    Ok(dashboard
        .panels
        .into_iter()
        .flat_map(|panel| {
            let title = panel.title;
            panel.targets.into_iter().map(move |target| {
                let expr = GRAFANA_VARIABLES
                    .iter()
                    .fold(target.expr, |expr, (variable, value)| {
                        expr.replace(variable, value)
                    });
                (title.clone(), expr)
            })
        })
        .collect())
}

/// The queries among `queries` (`what`, query) that return no sample.
fn without_data(prometheus: &Prometheus, queries: &[(String, String)]) -> Vec<String> {
    queries
        .iter()
        .filter(|(_, expr)| {
            prometheus
                .query(expr)
                .map_or(true, |samples| samples.is_empty())
        })
        .map(|(what, expr)| {
            if what == expr {
                expr.clone()
            } else {
                format!("{what}: {expr}")
            }
        })
        .collect()
}

/// Waits until every query of `queries` returns data, naming those that did not.
fn every_query_has_data(
    prometheus: &Prometheus,
    what: &str,
    queries: &[(String, String)],
    deadline: u64,
) -> Result<()> {
    wait_until(&format!("{what} with data"), secs(deadline), || {
        without_data(prometheus, queries).is_empty()
    })
    .map_err(|err| {
        anyhow!(
            "{err}: {what} without data: {}",
            without_data(prometheus, queries).join("|")
        )
    })
}

/// `efa-a`'s EFAs as its tree lays them out.
fn efa_a(cluster: &mut Cluster) -> Result<(FakeNode, Vec<FakeDevice>)> {
    Ok((cluster.fake_node(EFA_A)?, node_efas(cluster, EFA_A)?))
}

/// The suite's Prometheus with `efa-a`'s plugin a healthy target, its counters rising and read
/// by the plugin: a plugin that ran before the counter files were laid is restarted.
fn prometheus(cluster: &mut Cluster) -> Result<Prometheus> {
    ensure_plugin(cluster, Overlay::P4d)?;
    match &cluster.counters {
        Some(counters) => counters.check()?,
        None => {
            let (fake, efas) = efa_a(cluster)?;
            let (counters, laid_now) = RisingCounters::start(fake, efas)?;
            cluster.counters = Some(counters);
            if laid_now {
                restart_plugin(cluster)?;
            }
        }
    }
    cluster.prometheus()
}

fn restart_plugin(cluster: &Cluster) -> Result<()> {
    let kube = &cluster.kube;
    kube.run(&["rollout", "restart", "-n", PLUGIN_NAMESPACE, DAEMONSET])?;
    kube.plugin_rolled_out(secs(120))?;
    allocatable_settles(kube, EFAS, SETTLES, "after the plugin's restart")
}

/// The suite's holder, started if it is not running, and the IDs `efa-a`'s kubelet gave it.
fn holder(cluster: &mut Cluster) -> Result<Vec<String>> {
    Ok(ensure_holder(cluster)?.ids)
}

/// (P1) Prometheus discovers the plugin pod through the pod job and its `prometheus.io/*`
/// annotations, and scrapes it.
pub fn target(cluster: &mut Cluster) -> Result<Detail> {
    let prometheus = prometheus(cluster)?;
    Ok(prometheus
        .active_targets(POD_JOB)?
        .iter()
        .map(|target| format!("{} {}", target.health, target.scrape_url))
        .collect::<Vec<_>>()
        .join("; "))
}

/// (P2) Every family the README's metrics table lists has series; those it says are cdi mode's
/// only are not asked for in device-specs mode. An unreadable `numa_node` (a FIFO, whose read
/// never ends) makes the scan-error family appear.
pub fn families_present(cluster: &mut Cluster) -> Result<Detail> {
    // efa_device_allocation needs a holder.
    holder(cluster)?;
    let prometheus = prometheus(cluster)?;
    let readme = repo_file("README.md")?;
    let (fake, efas) = efa_a(cluster)?;
    // Through the ibdev's `device` link, as the plugin reaches it.
    let numa = fake
        .sysfs
        .join("class/infiniband")
        .join(&efas[0].ibdev)
        .join("device/numa_node");
    let saved = numa.with_extension("saved");
    fs::rename(&numa, &saved).with_context(|| format!("move {} aside", numa.display()))?;
    let scanned = mkfifo(&numa, Mode::from_bits_truncate(0o644))
        .with_context(|| format!("mkfifo {}", numa.display()))
        .map(|()| {
            // Not asserted here: the family is asked for with the others below.
            let _ = wait_until("a scan error", secs(30), || {
                has_series(&prometheus, "efa_device_plugin_scan_errors_total")
            });
        });
    let _ = fs::remove_file(&numa);
    fs::rename(&saved, &numa).with_context(|| format!("put {} back", numa.display()))?;
    scanned?;

    let (mut missing, mut skipped) = (Vec::new(), Vec::new());
    for name in families(&readme)? {
        let cdi_only = readme
            .lines()
            .any(|line| line.contains(&format!("`{name}`")) && line.contains("cdi mode only"));
        if cdi_only {
            skipped.push(name);
        } else if wait_until(&name, secs(10), || has_series(&prometheus, &name)).is_err() {
            missing.push(name);
        }
    }
    ensure!(
        missing.is_empty(),
        "families the README lists but Prometheus lacks: {}",
        missing.join(" ")
    );
    let mut detail = "all present".to_owned();
    if !skipped.is_empty() {
        detail += &format!(
            "; not in device-specs mode, as the README says: {}",
            skipped.join(" ")
        );
    }
    Ok(detail)
}

/// Whether the family `name` has series from the pod job; a histogram's are its buckets.
fn has_series(prometheus: &Prometheus, name: &str) -> bool {
    prometheus
        .query(&format!(
            "count({{__name__=~\"{name}(_bucket)?\", job=\"{POD_JOB}\"}})"
        ))
        .is_ok_and(|samples| !samples.is_empty())
}

/// (P3) The holder's counters carry its namespace, pod and container, for each of its EFAs.
pub fn holder_labels(cluster: &mut Cluster) -> Result<Detail> {
    let want = holder(cluster)?.join(" ");
    let prometheus = prometheus(cluster)?;
    let expr = format!(
        "count by (device) ({{job=\"{POD_JOB}\", namespace=\"default\", pod=\"{HOLDER}\", container=\"{HOLDER_CONTAINER}\", device!=\"\"}})"
    );
    let devices = || -> Result<(Vec<String>, f64)> {
        let samples = prometheus.query(&expr)?;
        let mut devices: Vec<String> = samples
            .iter()
            .map(|sample| sample.label("device").to_owned())
            .collect();
        devices.sort();
        let series = samples
            .iter()
            .map(|sample| sample.value().parse::<f64>().unwrap_or(0.0))
            .sum();
        Ok((devices, series))
    };
    // A holder created just now shows from the scrape after the plugin's next rescan.
    let series = wait_for("series naming the holder's devices", secs(30), || {
        let (got, series) = devices()?;
        Ok((got.join(" ") == want).then_some(series))
    })
    .map_err(|err| {
        let got = devices().map(|(got, _)| got.join(" ")).unwrap_or_default();
        anyhow!(
            "{err}: series with the holder's namespace, pod and container name devices [{got}], want its [{want}]"
        )
    })?;
    Ok(format!("{series} series name holder's {want}"))
}

/// (P4) One EFA's uverbs node goes: EfaDeviceUnhealthy fires for it, every dashboard query
/// has data meanwhile, and the alert resolves once the node is back.
pub fn alert_lifecycle(cluster: &mut Cluster) -> Result<Detail> {
    let prometheus = prometheus(cluster)?;
    let (fake, efas) = efa_a(cluster)?;
    let lost = efas
        .get(ALERT_EFA)
        .with_context(|| format!("{EFA_A} has no EFA {ALERT_EFA}"))?;
    let dashboard = panels(&repo_file(
        "manifests/helm/efa-device-plugin/dashboards/efa-device-plugin.json",
    )?)?;
    // A fresh allocation for the allocation and latency panels.
    run_job(cluster, "prometheus-job", 1)?;
    fake.remove_node(lost)
        .with_context(|| format!("remove {}", fake.node_path(lost).display()))?;
    let outcome = unhealthy_while_gone(&prometheus, &lost.ibdev, &dashboard);
    fake.create_node(lost)
        .with_context(|| format!("make {} again", fake.node_path(lost).display()))?;
    let fired = outcome?;
    let back = Instant::now();
    let state = || {
        prometheus
            .alert_state("EfaDeviceUnhealthy", ("ibdev", &lost.ibdev))
            .unwrap_or_else(|err| format!("{err:#}"))
    };
    wait_until(
        &format!("EfaDeviceUnhealthy for {} inactive", lost.ibdev),
        secs(60),
        || state() == "inactive",
    )
    .map_err(|err| anyhow!("{err}: '{}' after its node returned", state()))?;
    let resolved = back.elapsed().as_secs();
    allocatable_settles(
        &cluster.kube,
        EFAS,
        NODE_STATUS_PERIOD + secs(10),
        "after the node returned",
    )?;
    Ok(format!(
        "firing after {fired}s (for: 10s), every dashboard query had data, resolved {resolved}s after the node returned"
    ))
}

/// With `ibdev`'s node gone: the seconds until its alert fires, then every dashboard query has
/// data.
fn unhealthy_while_gone(
    prometheus: &Prometheus,
    ibdev: &str,
    dashboard: &[(String, String)],
) -> Result<u64> {
    let gone = Instant::now();
    let state = || {
        prometheus
            .alert_state("EfaDeviceUnhealthy", ("ibdev", ibdev))
            .unwrap_or_else(|err| format!("{err:#}"))
    };
    wait_until(
        &format!("EfaDeviceUnhealthy for {ibdev} firing"),
        secs(90),
        || state() == "firing",
    )
    .map_err(|err| anyhow!("{err}: '{}' after its node went", state()))?;
    let fired = gone.elapsed().as_secs();
    // While an EFA is unhealthy, every panel has something to show, the unhealthy one included.
    every_query_has_data(prometheus, "dashboard queries", dashboard, 30)?;
    Ok(fired)
}

/// (P5) Every PromQL example of the README returns a result, with what they ask about made true:
/// a DRA driver's registration socket withholds every EFA, and the counters keep rising.
pub fn readme_examples(cluster: &mut Cluster) -> Result<Detail> {
    // The examples join on efa_device_allocation, which needs a holder.
    holder(cluster)?;
    let prometheus = prometheus(cluster)?;
    let queries: Vec<(String, String)> = examples(&repo_file("README.md")?)
        .into_iter()
        .map(|query| (query.clone(), query))
        .collect();
    let socket: PathBuf = cluster.host_path(EFA_A, DRA_SOCKET)?;
    let listener =
        UnixListener::bind(&socket).with_context(|| format!("create {}", socket.display()))?;
    let outcome = every_query_has_data(&prometheus, "README examples", &queries, 60);
    drop(listener);
    fs::remove_file(&socket).with_context(|| format!("remove {}", socket.display()))?;
    outcome?;
    allocatable_settles(
        &cluster.kube,
        EFAS,
        NODE_STATUS_PERIOD + secs(10),
        "after the DRA socket went",
    )?;
    Ok(format!("all {} examples returned results", queries.len()))
}

/// (P6) Each counter alert fires on one of the holder's EFAs naming the holder, and on an EFA
/// no pod holds naming none.
pub fn counter_alerts(cluster: &mut Cluster) -> Result<Detail> {
    let held = holder(cluster)?.remove(0);
    let prometheus = prometheus(cluster)?;
    let free = wait_for("an EFA without a holder in Prometheus", secs(30), || {
        free_device(&prometheus)
    })?;
    let holder = format!("default/{HOLDER}");
    for alert in COUNTER_ALERTS {
        wait_until(
            &format!("{alert} firing for the holder's {held} with holder={holder}"),
            secs(90),
            || {
                prometheus
                    .firing(alert, &[("device", &held), ("holder", &holder)])
                    .unwrap_or(false)
            },
        )
        .map_err(|err| anyhow!("{err}: {}", prometheus.alerts(alert)))?;
        wait_until(
            &format!("{alert} firing for the free {free} without a holder"),
            secs(30),
            || {
                prometheus
                    .firing(alert, &[("device", &free), ("holder", "")])
                    .unwrap_or(false)
            },
        )
        .map_err(|err| anyhow!("{err}: {}", prometheus.alerts(alert)))?;
    }
    Ok(format!(
        "{} fired on {held} (holder {holder}) and on {free} (no holder)",
        COUNTER_ALERTS.join(" ")
    ))
}

/// An EFA with counters and no holder, as Prometheus sees it; the first by name.
fn free_device(prometheus: &Prometheus) -> Result<Option<String>> {
    let samples = prometheus.query(
        "count by (device) (efa_rx_drops_total unless on (instance, device) efa_device_allocation)",
    )?;
    let mut devices: Vec<&str> = samples
        .iter()
        .map(|sample| sample.label("device"))
        .collect();
    devices.sort();
    Ok(devices.first().map(|device| (*device).to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_families_are_the_metrics_tables_names_and_the_counters_it_names() {
        let readme = "intro `efa_nothing`\n### Metrics\n\n| metric | type | labels | meaning |\n\
            | --- | --- | --- | --- |\n\
            | `efa_device_plugin_devices` | gauge | `health` = `healthy` \\| `unhealthy` | x |\n\
            | `efa_<counter>_total` | counter | `device` | Each: `efa_tx_bytes_total`, `efa_rx_drops_total`, ... |\n\
            \n## Next\n| `efa_later` | gauge | | y |\n";
        assert_eq!(
            families(readme).unwrap(),
            [
                "efa_device_plugin_devices",
                "efa_tx_bytes_total",
                "efa_rx_drops_total"
            ]
        );
    }

    #[test]
    fn the_examples_are_the_promql_blocks_lines_but_comments() {
        let readme = "```promql\n# per pod\ncount by (pod) (x)\n\n  sum(y)\n```\n\
            ```yaml\nnot: promql\n```\n```promql\nz == 1\n```\n";
        assert_eq!(examples(readme), ["count by (pod) (x)", "sum(y)", "z == 1"]);
    }

    #[test]
    fn a_panels_queries_get_grafanas_variables() {
        let dashboard = r#"{"panels": [{"title": "Rate", "targets": [
            {"expr": "rate(a{node=~\"$node\"}[$__rate_interval])"}]}, {"title": "Row"}]}"#;
        assert_eq!(
            panels(dashboard).unwrap(),
            [("Rate".to_owned(), "rate(a{node=~\".*\"}[5m])".to_owned())]
        );
    }

    #[test]
    fn the_shipped_readme_and_dashboard_give_queries() {
        let readme = repo_file("README.md").unwrap();
        assert!(families(&readme).unwrap().len() > 10);
        assert!(!examples(&readme).is_empty());
        let dashboard =
            repo_file("manifests/helm/efa-device-plugin/dashboards/efa-device-plugin.json")
                .unwrap();
        assert!(!panels(&dashboard).unwrap().is_empty());
    }
}
