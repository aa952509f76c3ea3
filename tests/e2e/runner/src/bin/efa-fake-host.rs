//! Lays out the fake EFA host of a cluster-suite node: the test kit's simulated shape, the
//! one the crate's own tests and the runner's cases read, so that a node is described once.
//! The suite's bash runs it at setup, before any runner case, for each node it brings up.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use efa_device_plugin::testkit::simulate::{FakeNode, Nodes, Shape};

/// The shapes the cluster suite's nodes take.
#[derive(Clone, Copy, ValueEnum)]
enum NodeShape {
    /// efa-a: 4 EFAs, each on its own root complex, 2 per NUMA node.
    P4d,
    /// efa-b: 16 EFAs, 2 behind each of 8 PCIe switches.
    P5en,
}

#[derive(Parser)]
#[command(about = "Lays out a fake EFA host: its sysfs tree and real uverbs character devices")]
struct Args {
    #[arg(long, value_enum)]
    shape: NodeShape,
    /// Where the tree goes: the dir the plugin is given as its sysfs.
    #[arg(long)]
    sysfs: PathBuf,
    /// The dir whose infiniband/ gets the uverbs nodes (the host's /dev for efa-a).
    #[arg(long)]
    dev: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let shape = match args.shape {
        NodeShape::P4d => Shape::P4d,
        NodeShape::P5en => Shape::P5en,
    };
    let node = FakeNode {
        sysfs: args.sysfs,
        dev: args.dev,
        nodes: Nodes::CharDevices,
    };
    match node.lay_out(shape) {
        Ok(_) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!(
                "efa-fake-host: cannot lay out the host at {}: {err}",
                node.sysfs.display()
            );
            ExitCode::FAILURE
        }
    }
}
