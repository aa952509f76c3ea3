#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# End-to-end test of efa-device-plugin against a real kubelet and containerd
# on this host. The EFAs are a fake p4d-shaped sysfs tree plus real character
# device nodes, so everything from discovery to the container's /dev is real
# except the hardware behind the nodes.
#
# Needs root. Prints one line per case and "N passed, M failed" last; exits
# non-zero on any failure. Leaves the host as it found it, also on failure.
#
# Environment:
#   EFA_DP_E2E_CACHE         where the kubelet build and its Go caches live
#                            (default /var/cache/efa-device-plugin-e2e)
#   EFA_DP_E2E_KUBE_VERSION  kubelet version to build (default in lib/build.sh)
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
source "$HERE/lib/build.sh"
source "$HERE/lib/host.sh"
source "$HERE/lib/fake-efa.sh"
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

SUITE=kubelet
T=
KUBELET=
PLUGIN=
KUBELET_PID=
KUBELET_STARTS=0
CONTAINERD_PID=
PLUGIN_PID=
PLUGIN_STARTS=0

ctr_k8s() { ctr --address "$T/containerd/containerd.sock" --namespace k8s.io "$@"; }

# ---------------------------------------------------------------- setup

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

start_kubelet() {
	KUBELET_STARTS=$((KUBELET_STARTS + 1))
	"$KUBELET" --config="$T/kubelet/config.yaml" --root-dir="$T/kubelet/root" \
		--cert-dir="$T/kubelet/pki" --hostname-override="$NODE" --v=2 \
		>"$(kubelet_log)" 2>&1 9>&- &
	KUBELET_PID=$!
	wait_until 60 curl -sf "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz" -o /dev/null
}

kubelet_log() { echo "$T/logs/kubelet.$KUBELET_STARTS.log"; }

start_plugin() {
	PLUGIN_STARTS=$((PLUGIN_STARTS + 1))
	"$PLUGIN" --sysfs-root "$T/sys" --dev-root "$T/dev" --device-plugin-dir "$DP_DIR" \
		--rescan-interval 500ms >"$(plugin_log)" 2>&1 9>&- &
	PLUGIN_PID=$!
}

plugin_log() { echo "$T/logs/plugin.$PLUGIN_STARTS.log"; }

setup() {
	[[ $EUID -eq 0 ]] || fail_setup "must run as root"
	take_lock || fail_setup "another e2e run holds $LOCK"
	mkdir -p "$CACHE"
	# The image's only binary must not need a libc the image lacks.
	apt_install containerd:containerd runc:runc curl:curl python3:python3 busybox-static ||
		fail_setup "apt-get install failed"
	note "kubelet $KUBE_VERSION (cached in $CACHE)"
	KUBELET=$(kube_binaries "$CACHE" kubelet)/kubelet || fail_setup "kubelet $KUBE_VERSION build failed"
	PLUGIN=$(static_plugin_binary "$REPO") || fail_setup "static release build of the plugin failed"

	T=$(mktemp -d /tmp/efa-dp-e2e.XXXXXX)
	mkdir -p "$T/host" "$T/logs"
	remember_host_state "${HOST_PATHS[@]}"
	move_aside "$DP_DIR"

	local port
	for port in "$KUBELET_PORT" "$KUBELET_RO_PORT" "$KUBELET_HEALTHZ_PORT"; do
		[[ -z $(ss -Hltn "sport = :$port") ]] || fail_setup "port $port is in use; is another kubelet running?"
	done
	make_fake_efa_host "$T/sys" "$T/dev" || fail_setup "cannot build the fake EFA host"
	note "starting containerd"
	start_containerd || fail_setup "containerd did not start or import images (see $(tail -3 "$T/logs/containerd.log"))"
	write_kubelet_config
	note "starting kubelet"
	start_kubelet || fail_setup "kubelet not healthy within 60s: $(tail -3 "$(kubelet_log)")"
}

# ---------------------------------------------------------------- pods

# write_pod NAME COUNT: a static pod asking for COUNT EFAs whose container
# records what it sees in /dev/infiniband, once at start and then every
# second, into $T/out/NAME/{ls,now}.
write_pod() {
	local name=$1 count=$2
	mkdir -p "$T/out/$name"
	cat >"$T/manifests.tmp/$name.json" <<-EOF
		{"apiVersion": "v1", "kind": "Pod",
		 "metadata": {"name": "$name", "namespace": "default"},
		 "spec": {
		  "hostNetwork": true, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
		  "containers": [{
		   "name": "probe", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
		   "command": ["sh", "-c", "ls -l /dev/infiniband >/out/ls 2>&1; while true; do ls -l /dev/infiniband >/out/now.tmp 2>&1; mv /out/now.tmp /out/now; sleep 1; done"],
		   "resources": {"limits": {"$RESOURCE": $count}},
		   "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
		  "volumes": [{"name": "out", "hostPath": {"path": "$T/out/$name", "type": "Directory"}}]}}
	EOF
	# A rename, so the kubelet never reads a half-written manifest.
	mv "$T/manifests.tmp/$name.json" "$T/manifests/$name.json"
}

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

registered_ids() {
	python3 "$HERE/lib/kubeinfo.py" registered "$CHECKPOINT" "$RESOURCE" 2>/dev/null | paste -sd' '
}

registered_is() { [[ $(registered_ids) == "$1" ]]; }

allocated_ids() {
	python3 "$HERE/lib/kubeinfo.py" allocated "$CHECKPOINT" "$1" "$RESOURCE" 2>/dev/null | paste -sd' '
}

# wait_pod_running NAME COUNT: the pod runs, the checkpoint gives it COUNT
# devices, and its container saw exactly their nodes. Sets POD_IDS.
wait_pod_running() {
	local name=$1 count=$2 uid got want
	if ! wait_until 60 pod_phase_is "$name" Running; then
		REASON="pod $name not Running within 60s: $(pod_status "$name")"
		return 1
	fi
	uid=$(pod_status "$name" | cut -f3)
	read -ra POD_IDS <<<"$(allocated_ids "$uid")"
	if ((${#POD_IDS[@]} != count)); then
		REASON="checkpoint gives pod $name ${#POD_IDS[@]} devices [${POD_IDS[*]}], want $count"
		return 1
	fi
	if ! wait_until 20 test -s "$T/out/$name/ls"; then
		REASON="pod $name wrote no listing of /dev/infiniband"
		return 1
	fi
	got=$(listing_entries <"$T/out/$name/ls")
	want=$(expected_entries "${POD_IDS[@]}")
	if [[ $got != "$want" ]]; then
		REASON="pod $name sees [$(paste -sd';' <<<"$got")] in /dev/infiniband, want [$(paste -sd';' <<<"$want")]; raw: $(paste -sd'|' "$T/out/$name/ls")"
		return 1
	fi
}

# wait_pod_rejected NAME COUNT: admission rejects the pod, naming the resource.
wait_pod_rejected() {
	local name=$1 count=$2 status reason message
	if ! wait_until 60 pod_phase_is "$name" Failed; then
		REASON="pod $name asking for $count not Failed within 60s: $(pod_status "$name")"
		return 1
	fi
	status=$(pod_status "$name")
	reason=$(cut -f2 <<<"$status")
	message=$(cut -f4 <<<"$status")
	if [[ $reason != UnexpectedAdmissionError || $message != *"$RESOURCE"* ]]; then
		REASON="pod $name rejected with reason $reason, message: $message"
		return 1
	fi
	note "pod $name: $reason: $message"
}

# Number of registrations of our resource in the current kubelet's log.
registrations() {
	grep -c "Got registration request from device plugin with resource.*\"$RESOURCE\"" "$(kubelet_log)"
}

# registered_since COUNT IDS: the current kubelet logged more than COUNT
# registrations and its checkpoint lists IDS.
registered_since() { (($(registrations) > $1)) && registered_is "$2"; }

# modified_since FILE EPOCH: FILE was written in a later second than EPOCH.
modified_since() { [[ -e $1 ]] && (($(stat -c %Y "$1") > $2)); }

# ---------------------------------------------------------------- cases

case_a() {
	start_plugin
	if ! wait_until 30 registered_is "$(efa_ibdevs)"; then
		REASON="checkpoint lists [$(registered_ids)] under $RESOURCE after 30s, want [$(efa_ibdevs)]; kubelet registrations: $(registrations); plugin log: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	if (($(registrations) != 1)); then
		REASON="kubelet logged $(registrations) registrations of $RESOURCE, want 1"
		return 1
	fi
}

case_b() {
	write_pod b 2
	wait_pod_running b 2
}

case_c() {
	write_pod c 5
	wait_pod_rejected c 5 || return 1
	remove_pod c
}

case_d() {
	stop_pid "$KUBELET_PID" 30
	if ! start_kubelet; then
		REASON="kubelet not healthy within 60s after restart: $(tail -3 "$(kubelet_log)" | paste -sd'|')"
		return 1
	fi
	# The restarted kubelet deleted the plugin's socket; the plugin has to
	# notice the new kubelet.sock and register again.
	if ! wait_until 60 registered_since 0 "$(efa_ibdevs)"; then
		REASON="plugin did not register with the restarted kubelet within 60s (registrations: $(registrations), checkpoint: [$(registered_ids)], dir: [$(find "$DP_DIR" -mindepth 1 -printf '%f ')]); plugin log: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	write_pod d 2
	wait_pod_running d 2
}

case_e() {
	local ids_before b_ids status restarted listing registrations_before
	local -a b_devices
	remove_pod d || { REASON="pod d still listed 60s after its manifest was removed"; return 1; }
	ids_before=$(registered_ids)
	read -ra b_devices <<<"$(allocated_ids "$(pod_status b | cut -f3)")"
	b_ids=$(expected_entries "${b_devices[@]}")
	if ! alive "$PLUGIN_PID"; then
		stop_pid "$PLUGIN_PID" 0
		REASON="plugin had already exited with status $?: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	stop_pid "$PLUGIN_PID" 10
	status=$?
	if ((status != 0)); then
		REASON="plugin exited with status $status on SIGTERM: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	if [[ -e $PLUGIN_SOCKET ]]; then
		REASON="plugin left $PLUGIN_SOCKET behind on SIGTERM"
		return 1
	fi
	registrations_before=$(registrations)
	restarted=$(date +%s)
	start_plugin
	if ! wait_until 30 registered_since "$registrations_before" "$ids_before"; then
		REASON="after plugin restart: registrations $(registrations) (before $registrations_before), checkpoint [$(registered_ids)], want [$ids_before]"
		return 1
	fi
	if ! pod_phase_is b Running; then
		REASON="pod b no longer Running after plugin restart: $(pod_status b)"
		return 1
	fi
	# The container rewrites "now" every second; wait for a rewrite that
	# started after the restart.
	if ! wait_until 10 modified_since "$T/out/b/now" "$restarted"; then
		REASON="pod b stopped refreshing its listing after plugin restart"
		return 1
	fi
	listing=$(listing_entries <"$T/out/b/now")
	if [[ $listing != "$b_ids" ]]; then
		REASON="pod b now sees [$(paste -sd';' <<<"$listing")], had [$(paste -sd';' <<<"$b_ids")]"
		return 1
	fi
	write_pod e 2
	wait_pod_running e 2
}

case_f() {
	local last_id three p
	last_id=$(efa_ibdev 3)
	for p in b e; do
		remove_pod "$p" || { REASON="pod $p still listed 60s after its manifest was removed"; return 1; }
	done
	three=$(efa_ibdevs 0 1 2)
	rm "$T/dev/infiniband/uverbs3"
	if ! wait_until 30 registered_is "$three"; then
		REASON="with $T/dev/infiniband/uverbs3 gone, checkpoint still lists [$(registered_ids)] after 30s, want [$three]"
		return 1
	fi
	write_pod f1 4
	wait_pod_rejected f1 4 || return 1
	remove_pod f1
	make_uverbs_node "$T/dev" 3
	if ! wait_until 30 registered_is "$(efa_ibdevs)"; then
		REASON="with uverbs3 restored, checkpoint lists [$(registered_ids)] after 30s, want [$(efa_ibdevs)] ($last_id healthy again)"
		return 1
	fi
	write_pod f2 4
	wait_pod_running f2 4
}

# ---------------------------------------------------------------- cleanup

cleanup() {
	[[ -n $PLUGIN_PID ]] && stop_pid "$PLUGIN_PID" 10
	[[ -n $KUBELET_PID ]] && stop_pid "$KUBELET_PID" 30
	[[ -n $CONTAINERD_PID ]] && kill_containerd "$T/containerd/containerd.sock" "$T/containerd/state" "$CONTAINERD_PID"
	restore_host_state "${HOST_PATHS[@]}"
}

main() {
	trap finish EXIT
	trap 'exit 130' INT TERM
	setup
	run_case "(a) plugin registers; checkpoint lists 4 IDs" case_a
	run_case "(b) pod limited to 2 sees exactly its 2 uverbs nodes" case_b
	run_case "(c) pod asking for 5 is rejected at admission" case_c
	run_case "(d) after a kubelet restart the plugin re-registers; new pod runs" case_d
	run_case "(e) after a plugin restart IDs and running pod are intact; new pod runs" case_e
	run_case "(f) missing device node makes 4 unschedulable; restored node admits 4" case_f
}

main "$@"
