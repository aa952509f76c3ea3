#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# End-to-end test of GPU–EFA alignment by the real kubelet's Topology Manager.
# The standalone kubelet of kubelet.sh, on a host that looks like two NUMA
# nodes to it: the suite re-runs itself in a private mount namespace and binds
# a fake /sys/devices/system/node there (lib/numa.sh) before containerd and the
# kubelet start, so every daemon sees two nodes and the host sees nothing. The
# plugin under test serves fake p4d, p5en and g5-shaped EFAs; a second device
# plugin, built from the kubelet's own stub (gpu-standin/), serves nvidia.com/gpu
# with GPU-0 on node 0 and GPU-1 on node 1.
#
# Needs root. Prints one line per case and "N passed, M failed" last; exits
# non-zero on any failure. Leaves the host as it found it, also on failure.
#
# Environment: EFA_DP_E2E_CACHE, EFA_DP_E2E_KUBE_VERSION, EFA_DP_E2E_CASES, as
# kubelet.sh.
#
# This script brings the host up (the two-node view, containerd, the
# kubelet's config, the binaries and the GPU stand-in) and puts it back; the
# cases, their fixtures (the fake EFA hosts, the kubelet's policies, the
# plugins, the static pods) and their checks, the view's among them, are the
# runner's (tests/e2e/runner), which prints the case lines.
set -uo pipefail

# shellcheck source=SCRIPTDIR/lib/suite.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/suite.sh"
source "$HERE/lib/standalone.sh"
source "$HERE/lib/numa.sh"

SUITE=topology
STANDIN=

setup() {
	prepare_standalone
	STANDIN=$(stub_plugin "$CACHE" "$HERE/gpu-standin" gpu-standin) || fail_setup "building gpu-standin failed"
	make_two_node_tree "$T/numa" || fail_setup "cannot build the two-node tree"
	mount_two_node_tree "$T/numa" || fail_setup "cannot mount the two-node tree"
	start_standalone
}

topology_cases() { run_runner topology --gpu-standin "$STANDIN"; }

cleanup() { stop_standalone; }

main() {
	# Every daemon has to inherit the namespace, so the whole suite runs in it;
	# exec keeps the PID, and the mounts go when its last process exits.
	if [[ -z ${EFA_DP_E2E_UNSHARED:-} ]]; then
		# A killed run's leftovers are the host's: claim_host undoes them out here, as the
		# private namespace would undo only its copy of the mounts. Inside, it takes the lock again.
		claim_host
		EFA_DP_E2E_OUTER_MOUNTS=$(readlink /proc/self/ns/mnt) EFA_DP_E2E_UNSHARED=1 exec unshare --mount --propagation private -- bash "$0" "$@"
	fi
	run_suite topology_cases
}

main "$@"
