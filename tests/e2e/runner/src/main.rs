//! The typed core of the end-to-end suites: the cases, their fixtures and their ground-truth
//! checks. The suite's bash brings the host up (containerd, the kubelet's config, the
//! binaries, for the topology suite the two-node NUMA view and the GPU stand-in), runs this for
//! the cases of one suite and restores the host.
//!
//! It prints one line per case, `ok   LABEL (Ns)[: DETAIL]` or `FAIL LABEL: REASON` with the
//! diagnostics after it as `#` lines on stderr, and writes the tally (`PASSED FAILED SKIPPED`)
//! to `<run dir>/tally` for the suite's last line and each case's time to
//! `<run dir>/logs/case-times.tsv`.

mod cases;
mod cluster;
mod daemon;
mod http;
mod kubelet;
mod node;
mod plugin;
mod pods;
mod reboot;
mod stats;
mod topology;
mod wait;

use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use efa_device_plugin::testkit::simulate::{FakeNode, Nodes, Shape};
use regex::Regex;

use crate::cases::{CASES, Fixture, Suite, runs_at};
use crate::cluster::{Cluster, Host, Kube};
use crate::kubelet::{Checkpoint, Kubelet};
use crate::node::{Node, RESOURCE};
use crate::plugin::Plugin;
use crate::pods::Pods;
use crate::topology::{Setup, Topology};

#[derive(Parser)]
#[command(about = "Runs an end-to-end suite's cases on a host or cluster the suite brought up")]
struct Args {
    /// Whose cases run.
    #[arg(long, value_enum)]
    suite: Suite,
    /// The GPU device plugin of the topology suite.
    #[arg(long, required_if_eq("suite", "topology"))]
    gpu_standin: Option<PathBuf>,
    /// The suite's run dir: the kubelet's config under kubelet/, manifests/, manifests.tmp/,
    /// out/ and logs/; the fake EFA hosts are laid out under it.
    #[arg(long)]
    run_dir: PathBuf,
    /// The kubelet binary.
    #[arg(long)]
    kubelet: PathBuf,
    /// The plugin binary.
    #[arg(long)]
    plugin: PathBuf,
    /// The kubelet's version, which picks the cases that run.
    #[arg(long)]
    kube_version: String,
    #[arg(long, default_value = "efa-e2e")]
    node_name: String,
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    device_plugin_dir: PathBuf,
    #[arg(long, default_value_t = 10255)]
    read_only_port: u16,
    #[arg(long, default_value_t = 10248)]
    healthz_port: u16,
    /// The repository the cluster suite runs: its manifests, chart and test overlays.
    #[arg(long, required_if_eq("suite", "cluster"))]
    repo: Option<PathBuf>,
    /// The cluster suite's kubectl.
    #[arg(long, required_if_eq("suite", "cluster"))]
    kubectl: Option<PathBuf>,
    #[arg(long, required_if_eq("suite", "cluster"))]
    kubeconfig: Option<PathBuf>,
    /// The FIFO the cluster suite reads the runner's requests for infrastructure from.
    #[arg(long, required_if_eq("suite", "cluster"))]
    requests: Option<PathBuf>,
    /// The FIFO the cluster suite answers them on.
    #[arg(long, required_if_eq("suite", "cluster"))]
    replies: Option<PathBuf>,
    /// Runs only the cases whose label matches this regex.
    #[arg(long, env = "EFA_DP_E2E_CASES", value_parser = Regex::new)]
    cases: Option<Regex>,
}

/// A line for the suite's log, out of the case lines' way.
pub fn note(text: &str) {
    eprintln!("# {text}");
}

#[derive(Default)]
struct Tally {
    passed: u32,
    failed: u32,
    skipped: u32,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let tally = match run(&args) {
        Ok(tally) => tally,
        Err(err) => {
            println!("FAIL (setup) {err:#}");
            Tally {
                failed: 1,
                ..Tally::default()
            }
        }
    };
    let written = fs::write(
        args.run_dir.join("tally"),
        format!("{} {} {}\n", tally.passed, tally.failed, tally.skipped),
    );
    if let Err(err) = written {
        println!("FAIL (aborted) cannot write the tally: {err}");
        return ExitCode::FAILURE;
    }
    if tally.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The suite's fixture up, then each of its selected cases; its daemons are stopped at the end.
fn run(args: &Args) -> Result<Tally> {
    let run = &args.run_dir;
    let kubelet = Kubelet::new(
        args.kubelet.clone(),
        run.clone(),
        args.node_name.clone(),
        args.healthz_port,
    );
    let pods = Pods {
        run: run.clone(),
        node: args.node_name.clone(),
        read_only_port: args.read_only_port,
        resource: RESOURCE.to_owned(),
        checkpoint: Checkpoint {
            path: args.device_plugin_dir.join("kubelet_internal_checkpoint"),
        },
    };
    let plugin = |sysfs: PathBuf, dev: PathBuf| {
        Plugin::new(
            args.plugin.clone(),
            sysfs,
            dev,
            args.device_plugin_dir.clone(),
            run.join("kubelet/root/pod-resources/kubelet.sock"),
            run.clone(),
        )
    };
    match args.suite {
        Suite::Kubelet => {
            let (fake, devices) = FakeNode::build(run, Shape::P4d, Nodes::CharDevices)
                .context("cannot build the fake EFA host")?;
            let mut node = Node {
                efas: devices.into_iter().filter(|d| d.is_efa()).collect(),
                device_plugin_dir: args.device_plugin_dir.clone(),
                kubelet,
                plugin: plugin(fake.sysfs.clone(), fake.dev.clone()),
                pods,
                fake,
            };
            note("starting kubelet");
            node.kubelet.start()?;
            run_cases(args, &mut node)
        }
        Suite::Topology => {
            let gpu_standin = args
                .gpu_standin
                .clone()
                .context("--gpu-standin is needed for the topology suite")?;
            let mut topology = Topology::up(Setup {
                kubelet,
                // The plugin is pointed at a fake host before it starts.
                plugin: plugin(PathBuf::new(), PathBuf::new()),
                pods,
                gpu_standin,
                device_plugin_dir: args.device_plugin_dir.clone(),
                run: run.clone(),
            })?;
            run_cases(args, &mut topology)
        }
        Suite::Cluster => {
            let required = |arg: &Option<PathBuf>, flag: &str| {
                arg.clone()
                    .with_context(|| format!("--{flag} is needed for the cluster suite"))
            };
            let mut cluster = Cluster {
                kube: Kube {
                    kubectl: required(&args.kubectl, "kubectl")?,
                    kubeconfig: required(&args.kubeconfig, "kubeconfig")?,
                },
                host: Host::open(
                    &required(&args.requests, "requests")?,
                    &required(&args.replies, "replies")?,
                )?,
                run: run.clone(),
                repo: required(&args.repo, "repo")?,
                kubelet: args.kubelet.clone(),
                plugin: args.plugin.clone(),
                counters: None,
                started_prometheus: None,
                kube_version: args.kube_version.clone(),
            };
            run_cases(args, &mut cluster)
        }
    }
}

/// Each case of the fixture's suite that runs at this version and matches `--cases`: its line,
/// its time in case-times.tsv and, when it fails, the fixture's diagnostics.
fn run_cases<F: Fixture>(args: &Args, fixture: &mut F) -> Result<Tally> {
    let mut tally = Tally::default();
    let times_file = args.run_dir.join("logs/case-times.tsv");
    let mut times = String::new();
    let cases = CASES.iter().filter_map(|case| {
        let body = F::body(case.run)?;
        runs_at(case.since, case.before, &args.kube_version).then_some((case, body))
    });
    for (case, body) in cases {
        if args
            .cases
            .as_ref()
            .is_some_and(|re| !re.is_match(case.label))
        {
            tally.skipped += 1;
            continue;
        }
        note(&format!("case {}", case.label));
        let start = Instant::now();
        let outcome = body(fixture);
        let took = start.elapsed();
        let passed = outcome.is_ok();
        match outcome {
            Ok(detail) => {
                let detail = if detail.is_empty() {
                    detail
                } else {
                    format!(": {detail}")
                };
                println!("ok   {} ({}s){detail}", case.label, took.as_secs());
                tally.passed += 1;
            }
            Err(err) => {
                println!("FAIL {}: {err:#}", case.label);
                for line in fixture.diagnostics() {
                    note(&line);
                }
                tally.failed += 1;
            }
        }
        let _ = writeln!(
            times,
            "{}\t{:.1}\t{}\t{}",
            case.id,
            took.as_secs_f64(),
            if passed { "ok" } else { "fail" },
            case.label
        );
        fs::write(&times_file, &times)?;
    }
    fixture.stop();
    Ok(tally)
}
