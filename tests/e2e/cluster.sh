#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# End-to-end test of what users install: the container image, the kustomize
# manifests and the Helm chart, on a real cluster on this host (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelets and
# containerd 2, all built from upstream), driven only through the Kubernetes
# API with kubectl and helm. Most cases run on one node, efa-a, whose EFAs are
# a fake p4d-shaped sysfs tree plus real character devices at the real
# /dev/infiniband; the fleet cases (cluster/fleet.sh brings the fleet up) then
# add nodes of other shapes, each in its own mount namespace (lib/nodes.sh).
#
# Needs root. Prints one line per case and "N passed, M failed" last; exits
# non-zero on any failure. Leaves the host as it found it, also on failure.
#
# Environment:
#   EFA_DP_E2E_CACHE         where builds and Go caches live
#                            (default /var/cache/efa-device-plugin-e2e)
#   EFA_DP_E2E_KUBE_VERSION  Kubernetes version of every component
#                            (default in lib/build.sh)
set -uo pipefail

# shellcheck source=SCRIPTDIR/lib/suite.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/suite.sh"
source "$HERE/lib/cluster.sh"
source "$HERE/lib/nodes.sh"
# The node every single-node case runs on; the fleet cases (cluster/fleet.sh) add more.
NODE=efa-a
# The case groups, by what they test.
source "$HERE/cluster/prometheus.sh"
source "$HERE/cluster/migration.sh"
source "$HERE/cluster/dra.sh"
source "$HERE/cluster/arm64.sh"
source "$HERE/cluster/fleet.sh"
NS=kube-system
DS=efa-device-plugin
IMAGE=localhost/efa-device-plugin:e2e
# The fake sysfs trees the test overlays and values mount into the plugin pod.
FIXTURES=/run/efa-device-plugin-e2e
# The pod network: a bridge on a benchmarking range that is routed nowhere.
# The node's address is the bridge's, so the API server reaches the kubelet
# without anything listening on the host's other interfaces.
BRIDGE=efa-e2e0
NODE_IP=198.18.0.1
POD_SUBNET=198.18.0.0/24
SERVICE_SUBNET=198.18.1.0/24
ETCD_PORT=23790
APISERVER_PORT=16443
KUBELET_HEALTHZ_PORT=10248
HOST_PATHS=(/var/lib/kubelet /var/log/containers /var/log/pods /run/containerd /run/nri /run/netns /var/lib/cni /opt/containerd /etc/cni /run/efa-device-plugin-e2e /dev/infiniband /run/cdi /etc/cdi)
TEST_VALUES=$HERE/cluster/values-e2e.yaml

SUITE=cluster
T=
BIN=
PLUGIN=
RUNNER=
ARM64_PLUGIN=
KUBECONFIG=
declare -A PIDS=()
# Daemons in start order; cleanup stops them in reverse.
DAEMONS=()

# ---------------------------------------------------------------- setup

# start_daemon NAME CMD...: runs CMD in the background, logging to logs/NAME
# (appended to, as a daemon started again after a stop adds to its log).
start_daemon() {
	local name=$1
	shift
	"$@" >>"$T/logs/$name.log" 2>&1 9>&- &
	[[ -n ${PIDS[$name]+set} ]] || DAEMONS+=("$name")
	PIDS[$name]=$!
	remember_process "$!"
}

# stop_daemon NAME: stops what start_daemon NAME started, if it runs; a
# node's containerd with every container and shim it started. A shim whose
# task is gone (a pod sandbox's, say) has no pid file left to find it by, so
# shims are also found by the containerd address they were started with.
stop_daemon() {
	local name=$1 node home
	[[ -n ${PIDS[$name]:-} ]] || return 0
	if [[ $name == containerd-* ]]; then
		node=${name#containerd-}
		home=$(node_home "$node")
		kill_containerd "$home/containerd/state" "${PIDS[$name]}" ctr_on "$node"
		pkill -KILL -f -- "-address $home/containerd/containerd.sock( |$)"
	else
		stop_pid "${PIDS[$name]}" 30
	fi
	PIDS[$name]=
}

# make_pki: a CA, the API server's serving certificate, client certificates
# for kubectl (also used by the controller manager and scheduler), the
# kubelet and the API server's kubelet client, and the service-account keys.
make_pki() {
	local p=$T/pki name subject
	local -a extensions
	mkdir -p "$p"
	openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=efa-e2e-ca \
		-keyout "$p/ca.key" -out "$p/ca.crt" 2>/dev/null || return 1
	openssl genrsa -out "$p/sa.key" 2048 2>/dev/null &&
		openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null || return 1
	printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default\n' \
		"$NODE_IP" "${SERVICE_SUBNET%.0/24}.1" >"$p/apiserver.ext"
	for name in apiserver admin kubelet-client; do
		case $name in
		apiserver) subject=/CN=kube-apiserver ;;
		admin) subject=/O=system:masters/CN=efa-e2e-admin ;;
		kubelet-client) subject=/O=system:masters/CN=kube-apiserver-kubelet-client ;;
		esac
		extensions=()
		[[ $name == apiserver ]] && extensions=(-extfile "$p/apiserver.ext")
		openssl req -newkey rsa:2048 -nodes -subj "$subject" -keyout "$p/$name.key" -out "$p/$name.csr" 2>/dev/null &&
			openssl x509 -req -in "$p/$name.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
				-days 2 -out "$p/$name.crt" "${extensions[@]}" 2>/dev/null ||
			return 1
	done
	write_kubeconfig admin && make_node_identity "$NODE"
}

write_kubeconfig() {
	cat >"$T/pki/$1.kubeconfig" <<-EOF
		apiVersion: v1
		kind: Config
		clusters:
		- name: e2e
		  cluster: {server: "https://127.0.0.1:$APISERVER_PORT", certificate-authority: $T/pki/ca.crt}
		users:
		- name: $1
		  user: {client-certificate: $T/pki/$1.crt, client-key: $T/pki/$1.key}
		contexts:
		- name: e2e
		  context: {cluster: e2e, user: $1}
		current-context: e2e
	EOF
}

# The bridge exists before the kubelet so the node can take its address; the
# CNI bridge plugin then attaches pods to it. No masquerade and no routes:
# pods reach the host over the bridge and nothing else.
make_pod_network() {
	ip link add "$BRIDGE" type bridge || return 1
	on_restore ip link del "$BRIDGE"
	ip addr add "$NODE_IP/24" dev "$BRIDGE" &&
		ip link set "$BRIDGE" up || return 1
	write_node_network "$NODE"
}

start_etcd() {
	start_daemon etcd "$ETCD" --name efa-e2e --data-dir "$T/etcd" \
		--listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
		--listen-peer-urls http://127.0.0.1:$((ETCD_PORT + 1)) --initial-advertise-peer-urls http://127.0.0.1:$((ETCD_PORT + 1)) \
		--initial-cluster "efa-e2e=http://127.0.0.1:$((ETCD_PORT + 1))" --listen-metrics-urls "" --log-level warn
	wait_until 30 curl -sf "http://127.0.0.1:$ETCD_PORT/health" -o /dev/null
}

# ResourceHealthStatus copies device-plugin health into pod status; alpha
# before 1.36, so it is switched on explicitly on every component that has it.
FEATURE_GATES=ResourceHealthStatus=true

start_control_plane() {
	local p=$T/pki
	# Privileged pods are allowed, as on EKS: the AWS plugin's chart (the
	# migration cases' stand-in) runs privileged.
	start_daemon kube-apiserver "$BIN/kube-apiserver" \
		--etcd-servers "http://127.0.0.1:$ETCD_PORT" \
		--bind-address 127.0.0.1 --secure-port "$APISERVER_PORT" --advertise-address "$NODE_IP" \
		--tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
		--client-ca-file "$p/ca.crt" \
		--kubelet-client-certificate "$p/kubelet-client.crt" --kubelet-client-key "$p/kubelet-client.key" \
		--kubelet-preferred-address-types InternalIP \
		--service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key" \
		--service-account-issuer https://kubernetes.default.svc \
		--service-cluster-ip-range "$SERVICE_SUBNET" \
		--authorization-mode Node,RBAC --feature-gates "$FEATURE_GATES" --profiling=false \
		--allow-privileged=true
	wait_until 90 k get --raw /readyz >/dev/null 2>&1 || return 1
	start_daemon kube-controller-manager "$BIN/kube-controller-manager" \
		--kubeconfig "$p/admin.kubeconfig" --bind-address 127.0.0.1 --leader-elect=false \
		--service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
		--use-service-account-credentials=false --feature-gates "$FEATURE_GATES" --profiling=false
	start_daemon kube-scheduler "$BIN/kube-scheduler" \
		--kubeconfig "$p/admin.kubeconfig" --bind-address 127.0.0.1 --leader-elect=false --profiling=false
	# Pods need their namespace's default service account before they can be
	# created; the controller manager makes it.
	wait_until 60 k -n "$NS" get serviceaccount default >/dev/null 2>&1 &&
		wait_until 60 k -n default get serviceaccount default >/dev/null 2>&1
}

# ctr in the k8s.io namespace of the single-node cases' node.
ctr_k8s() { ctr_on "$NODE" "$@"; }

# How often every kubelet of the suite reports node status; cases wait on it.
NODE_STATUS_PERIOD=10

# build_image: the multi-arch image, the Dockerfile's final stage run by
# buildah for amd64 and arm64 on the static binaries the build stage would make
# (lib/build.sh), checked against the Dockerfile.
build_image() {
	local revision
	revision=$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)
	plugin_image_index "$REPO" "$T/buildah" "$IMAGE" "$T/images" "$revision" "amd64=$PLUGIN" "arm64=$ARM64_PLUGIN" &&
		python3 "$HERE/lib/dockerfile.py" check-image "$REPO/Dockerfile" "$T/images/index.tar" "$IMAGE" \
			"amd64=$PLUGIN" "arm64=$ARM64_PLUGIN" --build-arg "REVISION=$revision"
} >"$T/logs/buildah.log" 2>&1

setup() {
	local start=$SECONDS
	claim_host
	apt_install runc:runc curl:curl python3:python3 openssl:openssl buildah:buildah iptables:iptables \
		busybox-static containernetworking-plugins python3-yaml || fail_setup "apt-get install failed"
	require_free_ports cluster "$ETCD_PORT" $((ETCD_PORT + 1)) "$APISERVER_PORT" 10250 "$KUBELET_HEALTHZ_PORT" 10257 10259
	! ip link show "$BRIDGE" >/dev/null 2>&1 || fail_setup "interface $BRIDGE exists already"
	note "Kubernetes $KUBE_VERSION, etcd $ETCD_VERSION, containerd $CONTAINERD_VERSION (cached in $CACHE)"
	BIN=$(kube_binaries "$CACHE" kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl) ||
		fail_setup "Kubernetes $KUBE_VERSION build failed"
	ETCD=$(etcd_binary "$CACHE") || fail_setup "etcd $ETCD_VERSION build failed"
	CONTAINERD_BIN=$(containerd_binaries "$CACHE") || fail_setup "containerd $CONTAINERD_VERSION build failed"
	HELM=$(helm_binary "$CACHE") || fail_setup "helm $HELM_VERSION build failed"
	mapfile -t OPERATOR_CRDS < <(prometheus_operator_crds "$CACHE") && [[ -f ${OPERATOR_CRDS[0]} && -f ${OPERATOR_CRDS[1]} ]] ||
		fail_setup "cannot fetch the PodMonitor and PrometheusRule CRDs of prometheus-operator $PROMETHEUS_OPERATOR_VERSION"
	PLUGIN=$(static_plugin_binary "$REPO") || fail_setup "static release build of the plugin failed"
	RUNNER=$(runner_binary "$REPO") || fail_setup "build of the e2e runner failed"
	arm64_toolchain || fail_setup "the arm64 toolchain could not be installed"
	ARM64_PLUGIN=$(static_plugin_binary "$REPO" "$ARM64_TRIPLE") || fail_setup "static release build of the arm64 plugin failed"
	prometheus_build

	make_run_dir efa-dp-cluster
	mkdir -p "$T/images"
	define_node "$NODE" 0
	IMAGES_FOR_NODES=("$T/images/index.tar")
	KUBECONFIG=$T/pki/admin.kubeconfig
	export HELM_CACHE_HOME=$T/helm/cache HELM_CONFIG_HOME=$T/helm/config HELM_DATA_HOME=$T/helm/data
	remember_host_state "${HOST_PATHS[@]}"
	move_aside "$DP_DIR"
	move_aside /dev/infiniband
	make_dev_shared || fail_setup "cannot make /dev a shared mount"

	note "building the amd64 and arm64 images with buildah"
	build_image || fail_setup "image build failed: $(tail -3 "$T/logs/buildah.log" | paste -sd'|')"
	make_test_images /bin/busybox || fail_setup "cannot make the busybox and pause images"
	make_fixtures || fail_setup "cannot build the fake EFA host"
	make_pki || fail_setup "cannot make certificates"
	make_pod_network || fail_setup "cannot create bridge $BRIDGE"
	note "starting etcd, the control plane, containerd and the kubelet"
	start_etcd || fail_setup "etcd not healthy within 30s: $(tail -3 "$T/logs/etcd.log" | paste -sd'|')"
	start_control_plane || fail_setup "control plane not ready: $(tail -3 "$T/logs/kube-apiserver.log" | paste -sd'|')"
	start_node_containerd "$NODE" || fail_setup "containerd did not start or import images: $(tail -3 "$T/logs/containerd-$NODE.log" | paste -sd'|')"
	arm64_setup || fail_setup "cannot register qemu-aarch64 in binfmt_misc or import the arm64 image"
	start_node_kubelet "$NODE" || fail_setup "node $NODE not Ready within 120s: $(tail -3 "$T/logs/kubelet-$NODE.log" | paste -sd'|')"
	note "cluster up in $((SECONDS - start))s"
}

# The p4d tree the overlay and values mount as the plugin's sysfs, the empty
# one of a node without EFA, and the real device nodes at /dev/infiniband.
make_fixtures() {
	mkdir -p "$FIXTURES/no-efa/class" /dev/infiniband &&
		fake_host p4d "$FIXTURES/sys" /dev
}

# fake_host SHAPE SYSFS DEV: the test kit's SHAPE laid out at SYSFS, its uverbs
# nodes under DEV/infiniband (the runner's efa-fake-host).
fake_host() { "$(dirname "$RUNNER")/efa-fake-host" --shape "$1" --sysfs "$2" --dev "$3"; }

# The shipped pod mounts /dev/infiniband with HostToContainer propagation,
# which the runtime refuses unless the host mount holding it is shared or a
# slave. systemd hosts (Amazon Linux, Bottlerocket) make every mount shared;
# a host without systemd may keep /dev private, so the run shares it and
# restores it afterwards.
make_dev_shared() {
	local propagation
	propagation=$(findmnt -no PROPAGATION /dev) || return 1
	[[ $propagation == shared* ]] && return 0
	mount --make-shared /dev || return 1
	on_restore mount "--make-${propagation%%,*}" /dev
}

# ---------------------------------------------------------------- cleanup

cleanup() {
	local i pid_file
	# What the runner started and did not stop (it was killed): node mode's plugin.
	for pid_file in "$T"/pids/*; do
		[[ -f $pid_file ]] && stop_pid "$(cat "$pid_file")" 30
	done
	# The pods first, while the kubelet can still stop them, so the plugin
	# gets its SIGTERM and nothing is left to kill by force.
	[[ -n ${PIDS[kubelet-$NODE]:-} ]] && alive "${PIDS[kubelet-$NODE]}" &&
		k delete pods,jobs,daemonsets --all -A --wait --timeout=60s >/dev/null 2>&1
	for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
		stop_daemon "${DAEMONS[$i]}"
	done
	for i in "${NODE_MOUNTS[@]}"; do
		kill_in_mount_namespace "$i"
	done
	restore_host_state
}

cluster_cases() { runner_cases; }

# runner_cases: the cases, which the typed runner (tests/e2e/runner) holds, on the
# cluster setup brought up. The runner asks the suite for the infrastructure it
# keeps through two FIFOs, one request at a time (see host_request); its tally
# is the suite's.
runner_cases() {
	local dir=$T/runner line partial='' rc pid passed failed skipped
	if ! { mkdir -p "$dir" && { [[ -p $dir/requests ]] || mkfifo "$dir/requests"; } &&
		{ [[ -p $dir/replies ]] || mkfifo "$dir/replies"; }; }; then
		echo "FAIL (runner) cannot make its FIFOs in $dir"
		FAILED=$((FAILED + 1))
		return
	fi
	rm -f "$T/tally"
	# Held open for reading and writing, so that neither side's open waits for
	# the other's and a runner that dies early leaves nothing blocked.
	exec 7<>"$dir/requests" 8<>"$dir/replies"
	"$RUNNER" --suite cluster --run-dir "$T" --repo "$REPO" --kubelet "$BIN/kubelet" --plugin "$PLUGIN" \
		--kube-version "$KUBE_VERSION" --kubectl "$BIN/kubectl" --kubeconfig "$KUBECONFIG" \
		--requests "$dir/requests" --replies "$dir/replies" 7<&- 8<&- 9>&- &
	pid=$!
	while alive "$pid"; do
		# A read its timeout cuts short leaves what it had of the line in line:
		# the start of the next request, kept for it rather than lost.
		if ! IFS= read -r -t 1 -u 7 line; then
			partial+=$line
			continue
		fi
		line=$partial$line partial=''
		# shellcheck disable=SC2086 # a request is words: VERB ARG...
		host_request $line >"$dir/reply" 2>>"$T/logs/host-requests.log"
		rc=$?
		((rc == 0)) || [[ -s $dir/reply ]] || echo "${line%% *} failed" >"$dir/reply"
		printf '%s %s\n' "$rc" "$(paste -sd'|' "$dir/reply")" >&8
	done
	wait "$pid"
	rc=$?
	exec 7<&- 8<&-
	if ! read -r passed failed skipped <"$T/tally" 2>/dev/null; then
		echo "FAIL (runner) exited with status $rc and no tally"
		FAILED=$((FAILED + 1))
		return
	fi
	PASSED=$((PASSED + passed)) FAILED=$((FAILED + failed)) SKIPPED=$((SKIPPED + skipped))
}

# host_request VERB ARG...: what the runner may ask of the suite. Prints the
# answer; on failure, the reason, which each infrastructure function prints
# itself on stdout (runner_cases replies "VERB failed" when none did).
host_request() {
	local verb=$1
	shift
	case $verb in
	# The fleet up and the chart installed anew with the suite's values and ARG...
	chart) fleet_chart "$@" ;;
	# helm upgrade of the chart's release with the suite's values and ARG...
	upgrade) ours_helm upgrade "$@" >/dev/null ;;
	uninstall) uninstall_plugin ;;
	# Every release of this chart uninstalled; a kustomize install stays.
	uninstall_releases) uninstall_releases ;;
	# The kustomize overlay ARG1 (cluster/kustomize/ARG1) applied over whatever is installed.
	kustomize) k apply -k "$HERE/cluster/kustomize/$1" >/dev/null ;;
	# The PodMonitor and PrometheusRule CRDs of prometheus-operator, established.
	operator_crds) operator_crds >/dev/null ;;
	# The chart rendered by helm template (release efa) with ARG... into a new file: its path.
	template) chart_template "$@" ;;
	# The chart installed, or upgraded, as release ARG1 with the suite's values and ARG2...
	helm_install | helm_upgrade) chart_helm "${verb#helm_}" "$1" -f "$TEST_VALUES" "${@:2}" >/dev/null ;;
	helm_uninstall) helm uninstall "$1" -n "$NS" --wait >/dev/null ;;
	# The pid on the host of the task ARG2 of node ARG1's containerd (left running).
	task_pid) ctr_on "$1" tasks ls | awk -v id="$2" '$1 == id { print $2; found = 1 } END { exit !found }' ;;
	# The AWS plugin's stand-in installed as the AWS chart installs it, nothing awaited.
	standin_chart) standin_image && standin_chart ;;
	# The plugin anew from the labelled kustomize overlay.
	labelled_kustomize) install_labelled_kustomize ;;
	# Node ARG1's kubelet stopped (whatever its exit status) and started again, and the node Ready.
	restart_kubelet) stop_daemon "kubelet-$1"; kubelet_started "$1" ;;
	# SIGKILL to the task ARG2 of node ARG1's containerd, as a crash would end it.
	kill_container) ctr_on "$1" tasks kill -s SIGKILL "$2" >/dev/null ;;
	# Prometheus running (the runner installed the plugin first and waits for its
	# targets); prints its URL.
	prometheus) ensure_prometheus && echo "$PROMETHEUS_URL" ;;
	# A p4d node ARG1 joined and Ready; it stays until `leave`.
	join) join_node "$1" ;;
	# Node ARG1 powered off for good, its Node object and its namespaces gone.
	leave) remove_node "$1" >/dev/null ;;
	# The AWS plugin's stand-in in this plugin's place on every node, also on
	# nodes that join, until standin_uninstall.
	standin) fleet_standin ;;
	# The stand-in's release uninstalled, if there is one, its pods gone, and
	# its image no longer given to nodes that start.
	standin_uninstall) fleet_standin_uninstall ;;
	# The DRA driver stand-in's DaemonSet applied (its image built and imported first, once a
	# run); its pod comes up and registers by itself and stays until dra_standin_down.
	dra_standin_up) dra_standin_up ;;
	# The stand-in's DaemonSet and RBAC deleted, if there; its pod may still be terminating.
	dra_standin_down) dra_standin_down ;;
	# Where the host sees what node ARG1 sees at path ARG2.
	host_path) node_host_path "$@" ;;
	# The cgroup root node ARG1's kubelet puts its pods under.
	cgroup_root) node_cgroup_root "$1" ;;
	# A power cycle of node ARG1 in steps, so that the runner can start node
	# mode between containerd and the kubelet: everything stopped (the
	# containers killed, /run emptied), then containerd, then the kubelet
	# until the node is Ready.
	stop_node) stop_node "$@" ;;
	start_containerd) containerd_started "$1" ;;
	start_kubelet) kubelet_started "$1" ;;
	*)
		echo "no such request"
		return 1
		;;
	esac
}

run_suite cluster_cases
