# shellcheck shell=bash
# A standalone kubelet (no API server, static pods) on a private containerd,
# with the plugin's release binary as its device plugin: the bring-up the
# kubelet and topology suites share, and what they read back from the
# kubelet. The caller sources suite.sh first and sets SUITE; T and the
# daemons' PIDs live here.
# shellcheck disable=SC2034 # the globals below are the sourcing suite's too

CHECKPOINT=$DP_DIR/kubelet_internal_checkpoint
PLUGIN_SOCKET=$DP_DIR/efa-device-plugin.sock
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
KUBELET_PID=
KUBELET_STARTS=0
CONTAINERD_PID=
PLUGIN_PID=
PLUGIN_STARTS=0

ctr_k8s() { ctr --address "$T/containerd/containerd.sock" --namespace k8s.io "$@"; }

# prepare_standalone: root, the lock, packages, the kubelet and plugin
# binaries, the temp dir and the record of the host; fails the setup
# otherwise. Nothing is started yet.
prepare_standalone() {
	claim_host
	# The image's only binary must not need a libc the image lacks.
	apt_install containerd:containerd runc:runc curl:curl python3:python3 busybox-static ||
		fail_setup "apt-get install failed"
	note "kubelet $KUBE_VERSION (cached in $CACHE)"
	KUBELET=$(kube_binaries "$CACHE" kubelet)/kubelet || fail_setup "kubelet $KUBE_VERSION build failed"
	PLUGIN=$(static_plugin_binary "$REPO") || fail_setup "static release build of the plugin failed"

	make_run_dir efa-dp-e2e
	remember_host_state "${HOST_PATHS[@]}"
	move_aside "$DP_DIR"
	require_free_ports kubelet "$KUBELET_PORT" "$KUBELET_RO_PORT" "$KUBELET_HEALTHZ_PORT"
}

# start_standalone [KUBELET_CONFIG_LINE...]: containerd, then the kubelet with
# the given lines added to its config; fails the setup otherwise.
start_standalone() {
	note "starting containerd"
	start_containerd || fail_setup "containerd did not start or import images (see $(tail -3 "$T/logs/containerd.log"))"
	write_kubelet_config "$@"
	note "starting kubelet"
	start_kubelet || fail_setup "kubelet not healthy within 60s: $(tail -3 "$(kubelet_log)")"
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
	wait_until 30 ctr_k8s version >/dev/null 2>&1 || return 1

	import_test_images "$BUSYBOX"
}

# write_kubelet_config [LINE...]: the kubelet's config, with LINE... (YAML
# fields) added at the end.
write_kubelet_config() {
	local cgroups extra
	cgroups=$(kubelet_cgroup_settings)
	extra=$(printf '%s\n' "$@")
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
		$extra
	EOF
}

start_kubelet() {
	KUBELET_STARTS=$((KUBELET_STARTS + 1))
	"$KUBELET" --config="$T/kubelet/config.yaml" --root-dir="$T/kubelet/root" \
		--cert-dir="$T/kubelet/pki" --hostname-override="$NODE" --v=2 \
		>"$(kubelet_log)" 2>&1 9>&- &
	KUBELET_PID=$!
	wait_until 60 curl -sf "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz" -o /dev/null
}

kubelet_log() { echo "$T/logs/kubelet.$KUBELET_STARTS.log"; }

# start_plugin SYSFS_ROOT DEV_ROOT [FLAG...]: the plugin on a fake host, with
# this kubelet's PodResources, FLAG... added.
start_plugin() {
	local sys=$1 dev=$2
	shift 2
	PLUGIN_STARTS=$((PLUGIN_STARTS + 1))
	"$PLUGIN" --sysfs-root "$sys" --dev-root "$dev" --device-plugin-dir "$DP_DIR" \
		--pod-resources-socket "$T/kubelet/root/pod-resources/kubelet.sock" \
		--rescan-interval 500ms "$@" >"$(plugin_log)" 2>&1 9>&- &
	PLUGIN_PID=$!
}

plugin_log() { echo "$T/logs/plugin.$PLUGIN_STARTS.log"; }

# plugin_metrics: the plugin's /metrics text (its default address).
plugin_metrics() { curl -sf --max-time 5 "http://127.0.0.1:9465/metrics"; }

# Tab-separated phase, reason, uid, message of a static pod, or "Absent".
pod_status() {
	python3 "$HERE/lib/kubeinfo.py" pod "http://127.0.0.1:$KUBELET_RO_PORT/pods" "$1-$NODE" 2>/dev/null ||
		echo "Unreachable"
}

pod_phase_is() { [[ $(pod_status "$1" | cut -f1) == "$2" ]]; }

remove_pod() {
	rm -f "$T/manifests/$1.json"
	wait_until 60 pod_phase_is "$1" Absent
}

# remove_pods [KEEP...]: every static pod but those named KEEP... gone, with
# its output dir.
# shellcheck disable=SC2120 # KEEP is optional
remove_pods() {
	local f name
	for f in "$T"/manifests/*.json; do
		[[ -e $f ]] || continue
		name=$(basename "$f" .json)
		named_in "$name" "$@" || rm -f "$f"
	done
	for f in "$T"/out/*/; do
		[[ -d $f ]] || continue
		name=$(basename "$f")
		named_in "$name" "$@" && continue
		if ! wait_until 60 pod_phase_is "$name" Absent; then
			REASON="pod $name still listed 60s after its manifest was removed"
			return 1
		fi
		# The kubelet stops listing a static pod before its container has
		# stopped, and a container still writing there fails a single rm.
		if ! wait_until 30 rm_quietly "$f"; then
			REASON="$f still written 30s after pod $name left the kubelet's list"
			return 1
		fi
	done
}

rm_quietly() { rm -rf "$1" 2>/dev/null; }

# named_in NAME WORD...: NAME is one of WORD...
named_in() {
	local name=$1 word
	shift
	for word in "$@"; do
		[[ $word == "$name" ]] && return 0
	done
	return 1
}

# registered_ids [RESOURCE]: the IDs the checkpoint lists for RESOURCE
# (default ours), space-separated.
registered_ids() {
	python3 "$HERE/lib/kubeinfo.py" registered "$CHECKPOINT" "${1:-$RESOURCE}" 2>/dev/null | paste -sd' '
}

# registered_is IDS [RESOURCE]
registered_is() { [[ $(registered_ids "${2:-}") == "$1" ]]; }

# allocated_ids UID [RESOURCE]
allocated_ids() {
	python3 "$HERE/lib/kubeinfo.py" allocated "$CHECKPOINT" "$1" "${2:-$RESOURCE}" 2>/dev/null | paste -sd' '
}

# Number of registrations of RESOURCE (default ours) in the current kubelet's log.
registrations() {
	grep -c "Got registration request from device plugin with resource.*\"${1:-$RESOURCE}\"" "$(kubelet_log)"
}

# registered_since COUNT IDS: the current kubelet logged more than COUNT
# registrations and its checkpoint lists IDS.
registered_since() { (($(registrations) > $1)) && registered_is "$2"; }

# stop_standalone: the plugin, the kubelet and containerd, by PID, then the
# host as it was. For the suite's cleanup.
stop_standalone() {
	[[ -n $PLUGIN_PID ]] && stop_pid "$PLUGIN_PID" 10
	[[ -n $KUBELET_PID ]] && stop_pid "$KUBELET_PID" 30
	[[ -n $CONTAINERD_PID ]] && kill_containerd "$T/containerd/state" "$CONTAINERD_PID" ctr_k8s
	restore_host_state "${HOST_PATHS[@]}"
}
