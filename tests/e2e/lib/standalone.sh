# shellcheck shell=bash
# A standalone kubelet (no API server, static pods) on a private containerd,
# with the plugin's release binary as its device plugin: the bring-up the
# kubelet and topology suites share. Bash builds the binaries, records the
# host, starts containerd and writes the kubelet's config; the e2e runner
# (tests/e2e/runner) starts the kubelet and the plugins and runs the cases.
# The caller sources suite.sh first and sets SUITE; T lives here.
# shellcheck disable=SC2034 # the globals below are the sourcing suite's too

NODE=efa-e2e
KUBELET_PORT=10250
KUBELET_RO_PORT=10255
KUBELET_HEALTHZ_PORT=10248
BUSYBOX=/bin/busybox
# Host paths the kubelet or containerd create outside our temp dir whatever
# they are configured with; cleanup removes what was not there before.
HOST_PATHS=(/var/lib/kubelet /var/log/containers /run/containerd /run/netns /var/lib/cni /opt/containerd)

T=
KUBELET=
PLUGIN=
RUNNER=
CONTAINERD_PID=

ctr_k8s() { ctr --address "$T/containerd/containerd.sock" --namespace k8s.io "$@"; }

# prepare_standalone: root, the lock, packages, the kubelet, plugin and
# runner binaries, the temp dir and the record of the host; fails the setup
# otherwise. Nothing is started yet.
prepare_standalone() {
	claim_host
	# The image's only binary must not need a libc the image lacks.
	apt_install containerd:containerd runc:runc curl:curl python3:python3 busybox-static ||
		fail_setup "apt-get install failed"
	note "kubelet $KUBE_VERSION (cached in $CACHE)"
	KUBELET=$(kube_binaries "$CACHE" kubelet)/kubelet || fail_setup "kubelet $KUBE_VERSION build failed"
	PLUGIN=$(static_plugin_binary "$REPO") || fail_setup "static release build of the plugin failed"
	RUNNER=$(runner_binary "$REPO") || fail_setup "build of the e2e runner failed"

	make_run_dir efa-dp-e2e
	remember_host_state "${HOST_PATHS[@]}"
	move_aside "$DP_DIR"
	require_free_ports kubelet "$KUBELET_PORT" "$KUBELET_RO_PORT" "$KUBELET_HEALTHZ_PORT"
}

# start_standalone: containerd up with the test images, and the kubelet's
# config written; fails the setup otherwise. The runner starts the kubelet.
start_standalone() {
	note "starting containerd"
	start_containerd || fail_setup "containerd did not start or import images (see $(tail -3 "$T/logs/containerd.log"))"
	write_kubelet_config
}

start_containerd() {
	local c=$T/containerd
	mkdir -p "$c/root" "$c/state" "$c/opt" "$T/cni/bin" "$T/cni/net.d"
	# restrict_oom_score_adj: without CAP_SYS_RESOURCE (as in some VMs and
	# containers) nothing may lower oom_score_adj, which CRI otherwise does
	# for every sandbox, failing them all.
	# The CNI dirs stay empty: all test pods use the host network.
	cat >"$c/config.toml" <<-EOF
		version = 2
		root = "$c/root"
		state = "$c/state"
		disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
		[grpc]
		  address = "$c/containerd.sock"
		[plugins."io.containerd.internal.v1.opt"]
		  path = "$c/opt"
		[plugins."io.containerd.grpc.v1.cri"]
		  sandbox_image = "localhost/pause:1"
		  restrict_oom_score_adj = true
		  stream_server_address = "127.0.0.1"
		  [plugins."io.containerd.grpc.v1.cri".cni]
		    bin_dir = "$T/cni/bin"
		    conf_dir = "$T/cni/net.d"
	EOF
	containerd --config "$c/config.toml" >"$T/logs/containerd.log" 2>&1 9>&- &
	CONTAINERD_PID=$!
	remember_process "$CONTAINERD_PID"
	wait_until 30 ctr_k8s version >/dev/null 2>&1 || return 1

	import_test_images "$BUSYBOX"
}

# write_kubelet_config: the kubelet's config; a suite's runner adds its own
# fields at the end (the topology suite's policies).
write_kubelet_config() {
	local cgroups
	cgroups=$(kubelet_cgroup_settings)
	mkdir -p "$T/kubelet/root" "$T/manifests" "$T/manifests.tmp" "$T/out"
	# Standalone (no API server): pods come from staticPodPath and the test
	# reads their status from the read-only port, bound to loopback only.
	# Image GC and eviction are pushed out of reach so the imported images and
	# the test pods survive a busy CI disk.
	cat >"$T/kubelet/config.yaml" <<-EOF
		apiVersion: kubelet.config.k8s.io/v1beta1
		kind: KubeletConfiguration
		address: 127.0.0.1
		port: $KUBELET_PORT
		readOnlyPort: $KUBELET_RO_PORT
		healthzBindAddress: 127.0.0.1
		healthzPort: $KUBELET_HEALTHZ_PORT
		authentication:
		  anonymous: {enabled: true}
		  webhook: {enabled: false}
		authorization: {mode: AlwaysAllow}
		staticPodPath: $T/manifests
		fileCheckFrequency: 1s
		syncFrequency: 5s
		$cgroups
		containerRuntimeEndpoint: unix://$T/containerd/containerd.sock
		podLogsDir: $T/kubelet/pod-logs
		volumePluginDir: $T/kubelet/volume-plugins
		makeIPTablesUtilChains: false
		imageGCHighThresholdPercent: 100
		imageGCLowThresholdPercent: 99
		evictionHard: {memory.available: 1Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
	EOF
}

# run_runner SUITE [FLAG...]: the runner starts the kubelet and the plugins
# and runs SUITE's cases, printing their lines; its tally becomes the suite's
# last line.
run_runner() {
	local suite=$1 rc times
	shift
	"$RUNNER" --suite "$suite" --run-dir "$T" --kubelet "$KUBELET" --plugin "$PLUGIN" \
		--kube-version "$KUBE_VERSION" --node-name "$NODE" --device-plugin-dir "$DP_DIR" \
		--read-only-port "$KUBELET_RO_PORT" --healthz-port "$KUBELET_HEALTHZ_PORT" "$@" 9>&-
	rc=$?
	if ! read -r PASSED FAILED SKIPPED <"$T/tally" 2>/dev/null; then
		echo "FAIL (aborted) the runner exited with status $rc and no tally"
		FAILED=$((FAILED + 1))
	fi
	times=$(cut -f1,2 "$T/logs/case-times.tsv" 2>/dev/null) && note "case times (s): $(tr '\t' '=' <<<"$times" | paste -sd' ')"
}

# stop_standalone: whatever the runner started and did not stop (it was
# killed, or interrupted with the suite), by the PIDs it recorded, then
# containerd, then the host as it was. For the suite's cleanup.
stop_standalone() {
	local pid_file
	for pid_file in "$T"/pids/*; do
		[[ -f $pid_file ]] && stop_pid "$(cat "$pid_file")" 30
	done
	[[ -n $CONTAINERD_PID ]] && kill_containerd "$T/containerd/state" "$CONTAINERD_PID" ctr_k8s
	restore_host_state
}
