# shellcheck shell=bash disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# The arm64 image on the cluster, sourced by tests/e2e/cluster.sh, which
# provides the image; the cases this group runs again with it are
# cluster/workloads.sh's and cluster/health.sh's.
#
# The amd64 node runs the arm64 plugin under qemu-aarch64 through binfmt_misc.
# The entry is Debian's own (qemu-user-static's binfmt.d file), whose F flag
# makes the kernel open the interpreter at registration, so it works inside
# containers, whose root has no qemu. The run registers it (and
# mounts binfmt_misc) only if it is not there yet, and undoes just that.

BINFMT=/proc/sys/fs/binfmt_misc
BINFMT_CONF=/usr/lib/binfmt.d/qemu-aarch64.conf
BINFMT_ENTRY=$BINFMT/qemu-aarch64
BINFMT_MOUNTED=
BINFMT_REGISTERED=

# arm64_setup: binfmt_misc ready for arm64 containers, and the arm64 image
# imported under its own name.
arm64_setup() {
	if ! mountpoint -q "$BINFMT"; then
		mount -t binfmt_misc binfmt_misc "$BINFMT" || return 1
		BINFMT_MOUNTED=1
	fi
	if [[ ! -e $BINFMT_ENTRY ]]; then
		[[ $(awk -F: '{ print $NF }' "$BINFMT_CONF") == *F* ]] ||
			{ echo "$BINFMT_CONF has no F flag" >&2; return 1; }
		cat "$BINFMT_CONF" >"$BINFMT/register" || return 1
		BINFMT_REGISTERED=1
	fi
	# Someone else's entry serves only if it has F too.
	grep -q '^flags: .*F' "$BINFMT_ENTRY" || { echo "$BINFMT_ENTRY has no F flag" >&2; return 1; }
	ctr_k8s images import --all-platforms "$T/images/arm64.tar" >&2
}

# Also on failure: cleanup runs it once the daemons are stopped.
arm64_cleanup() {
	[[ -z $BINFMT_REGISTERED ]] || echo -1 >"$BINFMT_ENTRY"
	[[ -z $BINFMT_MOUNTED ]] || umount "$BINFMT"
}

# The cases of this group; each after the first reuses the arm64 plugin it
# installs, through ensure_arm64_plugin.
arm64_cases() {
	local start=$SECONDS
	run_case "(A1) arm64 image: kustomize install, the plugin runs as arm64, Ready, allocatable 4" case_arm64_install
	run_case "(A2) arm64 plugin: Job limited to 2 is scheduled, sees exactly its 2 uverbs nodes, completes" case_arm64_job
	run_case "(A3) arm64 plugin: kubectl exec list in the plugin pod prints 4 devices" case_arm64_operator_cli
	run_case "(A4) arm64 plugin: metrics over the pod IP, efa_device_allocation names the holder" case_arm64_metrics
	k delete pod holder --ignore-not-found --wait >/dev/null 2>&1
	k delete -k "$HERE/cluster/kustomize/p4d-arm64" --ignore-not-found --wait >/dev/null 2>&1
	note "arm64 cases took $((SECONDS - start))s under qemu-aarch64 emulation"
}

case_arm64_install() {
	local pod exe
	uninstall_plugin || return 1
	kustomize_install p4d-arm64 || return 1
	pod=$(ready_plugin_pod)
	if ! runs_arm64_image "$pod"; then
		REASON="plugin pod $pod runs $(pod_field "$pod" '{.status.containerStatuses[0].image}' "$NS"), want $IMAGE-arm64"
		return 1
	fi
	# What the kernel runs for the container's process: qemu for an arm64 binary, which shows the
	# pod did not get the amd64 image.
	exe=$(plugin_process_exe) || { REASON="no plugin process on the host"; return 1; }
	if [[ $exe != */qemu-aarch64-static ]]; then
		REASON="the plugin pod's process runs $exe, not qemu-aarch64"
		return 1
	fi
	CASE_DETAIL="the plugin process is $exe"
}

case_arm64_job() { ensure_arm64_plugin && case_job; }
case_arm64_operator_cli() { ensure_arm64_plugin && case_operator_cli; }
case_arm64_metrics() { ensure_arm64_plugin && case_metrics; }

# ensure_arm64_plugin: the arm64 plugin Ready with 4 EFAs allocatable, installed
# (after whatever else is there is gone) if not.
ensure_arm64_plugin() {
	local pod
	pod=$(ready_plugin_pod)
	[[ -n $pod ]] && runs_arm64_image "$pod" && allocatable_is 4 && return 0
	uninstall_plugin || return 1
	kustomize_install p4d-arm64
}

# runs_arm64_image POD: the arm64 image alone, as plugin_image_index names it.
runs_arm64_image() { [[ $(pod_field "$1" '{.status.containerStatuses[0].image}' "$NS") == "$IMAGE-arm64" ]]; }

# The executable the kernel runs for the plugin container's process.
plugin_process_exe() {
	local pid
	pid=$(ctr_k8s tasks ls 2>/dev/null | awk -v id="$(plugin_container_id)" '$1 == id { print $2 }')
	[[ -n $pid ]] && readlink -f "/proc/$pid/exe"
}
