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
# Environment: EFA_DP_E2E_CACHE, EFA_DP_E2E_KUBE_VERSION, as kubelet.sh.
set -uo pipefail

# shellcheck source=SCRIPTDIR/lib/suite.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/suite.sh"
source "$HERE/lib/standalone.sh"
source "$HERE/lib/numa.sh"
source "$HERE/topology/observe.sh"
source "$HERE/topology/cases.sh"

SUITE=topology
GPU=nvidia.com/gpu
GPU_ENV=NVIDIA_VISIBLE_DEVICES
GPU_DEVICES="GPU-0@0,GPU-1@1"
STANDIN=
STANDIN_PID=
STANDIN_STARTS=0
# What the kubelet and the plugin currently run with.
POLICY=
SCOPE=
CPU_POLICY=
FIXTURE=
FIXTURES=(p4d p5en g5)
# Our plugin logs each GetPreferredAllocation answer at debug level.
PLUGIN_FLAGS=(--log-level 'info,efa_device_plugin=debug')

# ---------------------------------------------------------------- setup

make_fixtures() {
	make_fake_efa_host "$T/p4d/sys" "$T/p4d/dev" &&
		make_fake_p5en_host "$T/p5en/sys" "$T/p5en/dev" &&
		make_fake_efa_host "$T/g5/sys" "$T/g5/dev" -1 -1 -1 -1 || return 1
	# The IDs and NUMA nodes as the plugin itself reports them, whichever
	# device ID strategy it uses.
	local f
	for f in "${FIXTURES[@]}"; do
		"$PLUGIN" --sysfs-root "$T/$f/sys" --dev-root "$T/$f/dev" list --output json |
			python3 "$HERE/topology/observe.py" fixture >"$T/$f/ids" || return 1
	done
}

start_standin() {
	STANDIN_STARTS=$((STANDIN_STARTS + 1))
	"$STANDIN" --plugin-dir "$DP_DIR" --resource "$GPU" --devices "$GPU_DEVICES" --env "$GPU_ENV" \
		>"$T/logs/gpu-standin.$STANDIN_STARTS.log" 2>&1 9>&- &
	STANDIN_PID=$!
	wait_until 30 gpu_registered
}

gpu_registered() { (($(registrations "$GPU") > 0)) && registered_is "GPU-0 GPU-1" "$GPU"; }

# kubelet_policy_config POLICY SCOPE CPU_POLICY: the kubelet config lines. The
# static CPU manager keeps CPU 0, the first node's, for the system, so an
# exclusive CPU can only come from node 1.
kubelet_policy_config() {
	printf '%s\n' "topologyManagerPolicy: $1" "topologyManagerScope: $2" "cpuManagerPolicy: $3"
	[[ $3 == static ]] && echo 'reservedSystemCPUs: "0"'
	return 0
}

setup() {
	prepare_standalone
	STANDIN=$(stub_plugin "$CACHE" "$HERE/gpu-standin" gpu-standin) || fail_setup "building gpu-standin failed"
	local host_nodes
	host_nodes=$(NODE_SYSFS=/proc/1/root$NODE_SYSFS numa_nodes_seen)
	make_two_node_tree "$T/numa" || fail_setup "cannot build the two-node tree"
	mount_two_node_tree "$T/numa" || fail_setup "cannot mount the two-node tree"
	[[ $(numa_nodes_seen) == "0 1" ]] || fail_setup "NUMA nodes seen in the namespace: [$(numa_nodes_seen)], want [0 1]"
	[[ $(NODE_SYSFS=/proc/1/root$NODE_SYSFS numa_nodes_seen) == "$host_nodes" ]] ||
		fail_setup "the mount leaked out of the namespace"
	make_fixtures || fail_setup "cannot build the fake EFA hosts"
	POLICY=single-numa-node SCOPE=container CPU_POLICY=none
	local -a config
	mapfile -t config < <(kubelet_policy_config "$POLICY" "$SCOPE" "$CPU_POLICY")
	start_standalone "${config[@]}"
	use_fixture p4d || fail_setup "$REASON"
	start_standin || fail_setup "gpu-standin did not register: $(tail -3 "$T/logs/gpu-standin.$STANDIN_STARTS.log" | paste -sd'|')"
}

# use_fixture NAME: our plugin serves the fake host NAME.
use_fixture() {
	[[ $FIXTURE == "$1" ]] && return 0
	[[ -n $PLUGIN_PID ]] && stop_pid "$PLUGIN_PID" 10
	start_plugin "$T/$1/sys" "$T/$1/dev" "${PLUGIN_FLAGS[@]}"
	if ! wait_until 30 registered_is "$(fixture_ids_of "$1")"; then
		REASON="fixture $1: checkpoint lists [$(registered_ids)], want [$(fixture_ids_of "$1")]; plugin log: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	FIXTURE=$1
}

# use_policy POLICY SCOPE [CPU_POLICY]: the kubelet runs with this Topology
# Manager policy and scope and CPU manager policy (default none), restarted
# (with no pods) if it did not; both plugins register with the new kubelet.
use_policy() {
	local cpu=${3:-none}
	[[ $POLICY == "$1" && $SCOPE == "$2" && $CPU_POLICY == "$cpu" ]] && return 0
	remove_pods || return 1
	stop_pid "$STANDIN_PID" 10
	stop_pid "$KUBELET_PID" 30
	local -a config
	mapfile -t config < <(kubelet_policy_config "$1" "$2" "$cpu")
	write_kubelet_config "${config[@]}"
	# The CPU manager refuses to start on a checkpoint of another policy.
	rm -f "$T/kubelet/root/cpu_manager_state"
	if ! start_kubelet; then
		REASON="kubelet ($1, $2, CPU manager $cpu) not healthy within 60s: $(tail -3 "$(kubelet_log)" | paste -sd'|')"
		return 1
	fi
	POLICY=$1 SCOPE=$2 CPU_POLICY=$cpu
	if ! wait_until 60 registered_since 0 "$(fixture_ids_of "$FIXTURE")"; then
		REASON="plugin did not register with the restarted kubelet: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	if ! start_standin; then
		REASON="gpu-standin did not register with the restarted kubelet"
		return 1
	fi
}

# ---------------------------------------------------------------- cleanup

cleanup() {
	[[ -n $STANDIN_PID ]] && stop_pid "$STANDIN_PID" 10
	stop_standalone
}

main() {
	# Every daemon has to inherit the namespace, so the whole suite runs in it;
	# exec keeps the PID, and the mounts go when its last process exits.
	if [[ -z ${EFA_DP_E2E_UNSHARED:-} ]]; then
		EFA_DP_E2E_UNSHARED=1 exec unshare --mount --propagation private -- bash "$0" "$@"
	fi
	run_suite run_topology_cases
}

main "$@"
