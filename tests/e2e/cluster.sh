#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# End-to-end test of what users install: the container image, the kustomize
# manifests and the Helm chart, on a real single-node cluster on this host
# (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and
# containerd 2, all built from upstream), driven only through the Kubernetes
# API with kubectl and helm. The EFAs are a fake p4d-shaped sysfs tree plus
# real character devices at the real /dev/infiniband.
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

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
source "$HERE/lib/build.sh"
source "$HERE/lib/host.sh"
source "$HERE/lib/fake-efa.sh"
source "$HERE/cluster/prometheus.sh"
source "$HERE/cluster/migration.sh"
source "$HERE/cluster/cdi-restart.sh"
source "$HERE/cluster/dra.sh"
source "$HERE/cluster/arm64.sh"
NODE=efa-e2e
NS=kube-system
DS=efa-device-plugin
IMAGE=localhost/efa-device-plugin:e2e
# The fake sysfs trees the test overlays and values mount into the plugin pod.
FIXTURES=/run/efa-device-plugin-e2e
SYSFS_IN_POD=/e2e-sysfs
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
HOST_PATHS=(/var/lib/kubelet /var/log/containers /var/log/pods /run/containerd /run/netns /var/lib/cni /opt/containerd /etc/cni /run/efa-device-plugin-e2e /dev/infiniband /run/cdi /etc/cdi)
# The propagation of the /dev mount before the run; see make_dev_shared.
DEV_PROPAGATION=
TEST_VALUES=$HERE/cluster/values-e2e.yaml

SUITE=cluster
T=
BIN=
PLUGIN=
ARM64_PLUGIN=
KUBECONFIG=
declare -A PIDS=()
# Daemons in start order; cleanup stops them in reverse.
DAEMONS=()

k() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG" "$@"; }
kns() { k -n "$NS" "$@"; }
helm() { "$HELM" --kubeconfig "$KUBECONFIG" "$@"; }

# ---------------------------------------------------------------- setup

# start_daemon NAME CMD...: runs CMD in the background, logging to logs/NAME.
start_daemon() {
	local name=$1
	shift
	"$@" >"$T/logs/$name.log" 2>&1 9>&- &
	PIDS[$name]=$!
	DAEMONS+=("$name")
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
	for name in apiserver admin kubelet kubelet-client; do
		case $name in
		apiserver) subject=/CN=kube-apiserver ;;
		admin) subject=/O=system:masters/CN=efa-e2e-admin ;;
		kubelet) subject=/O=system:nodes/CN=system:node:$NODE ;;
		kubelet-client) subject=/O=system:masters/CN=kube-apiserver-kubelet-client ;;
		esac
		extensions=()
		[[ $name == apiserver ]] && extensions=(-extfile "$p/apiserver.ext")
		openssl req -newkey rsa:2048 -nodes -subj "$subject" -keyout "$p/$name.key" -out "$p/$name.csr" 2>/dev/null &&
			openssl x509 -req -in "$p/$name.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
				-days 2 -out "$p/$name.crt" "${extensions[@]}" 2>/dev/null ||
			return 1
	done
	write_kubeconfig admin && write_kubeconfig kubelet
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
	ip link add "$BRIDGE" type bridge &&
		ip addr add "$NODE_IP/24" dev "$BRIDGE" &&
		ip link set "$BRIDGE" up || return 1
	mkdir -p "$T/cni/net.d"
	cat >"$T/cni/net.d/10-efa-e2e.conflist" <<-EOF
		{"cniVersion": "0.4.0", "name": "efa-e2e", "plugins": [
		  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false,
		   "ipam": {"type": "host-local", "dataDir": "$T/cni/ipam",
		            "ranges": [[{"subnet": "$POD_SUBNET", "rangeStart": "${NODE_IP%.1}.10", "gateway": "$NODE_IP"}]]}},
		  {"type": "loopback"}]}
	EOF
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

start_containerd() {
	local c=$T/containerd
	mkdir -p "$c/root" "$c/state" "$c/opt"
	# restrict_oom_score_adj: without CAP_SYS_RESOURCE (as in some VMs and
	# containers) nothing may lower oom_score_adj, which CRI otherwise does
	# for every sandbox, failing them all. CDI is on, as by default in 2.x.
	cat >"$c/config.toml" <<-EOF
		version = 3
		root = "$c/root"
		state = "$c/state"
		[grpc]
		  address = "$c/containerd.sock"
		[plugins.'io.containerd.internal.v1.opt']
		  path = "$c/opt"
		[plugins.'io.containerd.grpc.v1.cri']
		  stream_server_address = "127.0.0.1"
		[plugins.'io.containerd.cri.v1.images'.pinned_images]
		  sandbox = "localhost/pause:1"
		[plugins.'io.containerd.cri.v1.runtime']
		  enable_cdi = true
		  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
		  restrict_oom_score_adj = true
		  [plugins.'io.containerd.cri.v1.runtime'.cni]
		    bin_dirs = ["/usr/lib/cni"]
		    conf_dir = "$T/cni/net.d"
	EOF
	# The shim is looked up on PATH: ours, not an older one the host has.
	start_daemon containerd env PATH="$CONTAINERD_BIN:$PATH" "$CONTAINERD_BIN/containerd" --config "$c/config.toml"
	wait_until 30 ctr_k8s version >/dev/null 2>&1 || return 1
	import_test_images /bin/busybox &&
		ctr_k8s images import --all-platforms "$T/images/index.tar" >&2
}

ctr_k8s() { "$CONTAINERD_BIN/ctr" --address "$T/containerd/containerd.sock" --namespace k8s.io "$@"; }

start_kubelet() {
	local cgroups
	cgroups=$(kubelet_cgroup_settings)
	mkdir -p "$T/kubelet"
	# The kubelet's root is the real /var/lib/kubelet: the shipped manifests
	# mount its pod-resources and plugins_registry dirs from there.
	cat >"$T/kubelet/config.yaml" <<-EOF
		apiVersion: kubelet.config.k8s.io/v1beta1
		kind: KubeletConfiguration
		address: $NODE_IP
		port: 10250
		readOnlyPort: 0
		healthzBindAddress: 127.0.0.1
		healthzPort: $KUBELET_HEALTHZ_PORT
		authentication:
		  anonymous: {enabled: false}
		  webhook: {enabled: false}
		  x509: {clientCAFile: $T/pki/ca.crt}
		authorization: {mode: AlwaysAllow}
		$cgroups
		containerRuntimeEndpoint: unix://$T/containerd/containerd.sock
		featureGates: {ResourceHealthStatus: true}
		nodeStatusUpdateFrequency: ${NODE_STATUS_PERIOD}s
		syncFrequency: 5s
		makeIPTablesUtilChains: false
		resolvConf: ""
		imageGCHighThresholdPercent: 100
		imageGCLowThresholdPercent: 99
		evictionHard: {memory.available: 1Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
	EOF
	start_daemon kubelet "$BIN/kubelet" --config "$T/kubelet/config.yaml" \
		--kubeconfig "$T/pki/kubelet.kubeconfig" --cert-dir "$T/kubelet/pki" \
		--hostname-override "$NODE" --node-ip "$NODE_IP" --v=2
	wait_until 60 curl -sf "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz" -o /dev/null &&
		wait_until 120 node_ready
}
NODE_STATUS_PERIOD=10

node_ready() {
	[[ $(k get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}

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
	local port
	[[ $EUID -eq 0 ]] || fail_setup "must run as root"
	take_lock || fail_setup "another e2e run holds $LOCK"
	mkdir -p "$CACHE"
	apt_install runc:runc curl:curl python3:python3 openssl:openssl buildah:buildah iptables:iptables \
		busybox-static containernetworking-plugins python3-yaml || fail_setup "apt-get install failed"
	for port in "$ETCD_PORT" $((ETCD_PORT + 1)) "$APISERVER_PORT" 10250 "$KUBELET_HEALTHZ_PORT" 10257 10259; do
		[[ -z $(ss -Hltn "sport = :$port") ]] || fail_setup "port $port is in use; is another cluster running?"
	done
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
	arm64_toolchain || fail_setup "the arm64 toolchain could not be installed"
	ARM64_PLUGIN=$(static_plugin_binary "$REPO" "$ARM64_TRIPLE") || fail_setup "static release build of the arm64 plugin failed"
	prometheus_build

	T=$(mktemp -d /tmp/efa-dp-cluster.XXXXXX)
	mkdir -p "$T/host" "$T/logs" "$T/images"
	KUBECONFIG=$T/pki/admin.kubeconfig
	export HELM_CACHE_HOME=$T/helm/cache HELM_CONFIG_HOME=$T/helm/config HELM_DATA_HOME=$T/helm/data
	remember_host_state "${HOST_PATHS[@]}"
	move_aside "$DP_DIR"
	move_aside /dev/infiniband
	make_dev_shared || fail_setup "cannot make /dev a shared mount"

	note "building the amd64 and arm64 images with buildah"
	build_image || fail_setup "image build failed: $(tail -3 "$T/logs/buildah.log" | paste -sd'|')"
	make_fixtures || fail_setup "cannot build the fake EFA host"
	make_pki || fail_setup "cannot make certificates"
	make_pod_network || fail_setup "cannot create bridge $BRIDGE"
	note "starting etcd, the control plane, containerd and the kubelet"
	start_etcd || fail_setup "etcd not healthy within 30s: $(tail -3 "$T/logs/etcd.log" | paste -sd'|')"
	start_control_plane || fail_setup "control plane not ready: $(tail -3 "$T/logs/kube-apiserver.log" | paste -sd'|')"
	start_containerd || fail_setup "containerd did not start or import images: $(tail -3 "$T/logs/containerd.log" | paste -sd'|')"
	arm64_setup || fail_setup "cannot register qemu-aarch64 in binfmt_misc or import the arm64 image"
	start_kubelet || fail_setup "node $NODE not Ready within 120s: $(tail -3 "$T/logs/kubelet.log" | paste -sd'|')"
}

# The p4d tree the overlay and values mount as the plugin's sysfs, the empty
# one of a node without EFA, and the real device nodes at /dev/infiniband.
make_fixtures() {
	mkdir -p "$FIXTURES/no-efa/class" /dev/infiniband &&
		make_fake_efa_host "$FIXTURES/sys" /dev
}

# The shipped pod mounts /dev/infiniband with HostToContainer propagation,
# which the runtime refuses unless the host mount holding it is shared or a
# slave. systemd hosts (Amazon Linux, Bottlerocket) make every mount shared;
# a host without systemd may keep /dev private, so the run shares it and
# restores it afterwards.
make_dev_shared() {
	DEV_PROPAGATION=$(findmnt -no PROPAGATION /dev) || return 1
	[[ $DEV_PROPAGATION == shared* ]] || mount --make-shared /dev
}

# ---------------------------------------------------------------- helpers

allocatable() {
	k get node "$NODE" -o jsonpath="{.status.allocatable.${RESOURCE//./\\.}}" 2>/dev/null
}

allocatable_is() { [[ $(allocatable) == "$1" ]]; }

# The one plugin pod that is Ready and not terminating; empty otherwise.
ready_plugin_pod() {
	kns get pods -l app.kubernetes.io/name=efa-device-plugin -o json 2>/dev/null | python3 -c '
import json, sys
pods = [p for p in json.load(sys.stdin)["items"]
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
print(pods[0]["metadata"]["name"] if len(pods) == 1 else "")'
}

has_ready_plugin_pod() { [[ -n $(ready_plugin_pod) ]]; }

no_plugin_pod() { [[ -z $(kns get pods -l app.kubernetes.io/name=efa-device-plugin -o name 2>/dev/null) ]]; }

pod_field() { k -n "${3:-default}" get pod "$1" -o jsonpath="$2" 2>/dev/null; }

pod_phase_is() { [[ $(pod_field "$1" '{.status.phase}') == "$2" ]]; }

# The device IDs the kubelet's checkpoint records for a pod.
allocated_ids() {
	python3 "$HERE/lib/kubeinfo.py" allocated "$DP_DIR/kubelet_internal_checkpoint" "$1" "$RESOURCE" 2>/dev/null |
		paste -sd' '
}

# workload NAME KIND COUNT: a Job (KIND=job) or a long-running Pod (KIND=pod)
# whose container lists /dev/infiniband and prints FI_PROVIDER, then waits:
# the Job long enough for its allocation to be read, the Pod until deleted.
workload() {
	local name=$1 kind=$2 count=$3 wait=5
	[[ $kind == pod ]] && wait=100000
	local container
	container=$(
		cat <<-EOF
			{"name": "probe", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
			 "command": ["sh", "-c", "ls -l /dev/infiniband; echo FI_PROVIDER=\${FI_PROVIDER:-unset}; sleep $wait"],
			 "resources": {"limits": {"$RESOURCE": $count}}}
		EOF
	)
	if [[ $kind == job ]]; then
		k apply -f - <<-EOF
			{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "$name", "namespace": "default"},
			 "spec": {"backoffLimit": 0, "template": {"spec": {
			   "restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [$container]}}}}
		EOF
	else
		k apply -f - <<-EOF
			{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "$name", "namespace": "default"},
			 "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [$container]}}
		EOF
	fi
}

job_pod() { k get pods -l "job-name=$1" -o jsonpath='{.items[0].metadata.name}' 2>/dev/null; }
no_job_pod() { [[ -z $(k get pods -l "job-name=$1" -o name 2>/dev/null) ]]; }

# check_devices POD COUNT: the pod's container saw exactly the uverbs nodes
# of the COUNT devices the kubelet allocated to it.
check_devices() {
	local pod=$1 count=$2 uid ids got want
	uid=$(pod_field "$pod" '{.metadata.uid}')
	read -ra ids <<<"$(allocated_ids "$uid")"
	if ((${#ids[@]} != count)); then
		REASON="checkpoint gives pod $pod ${#ids[@]} devices [${ids[*]}], want $count"
		return 1
	fi
	wait_until 20 has_listing "$pod"
	POD_LOG=$T/logs/pod-$pod.log
	k logs "$pod" >"$POD_LOG"
	got=$(listing_entries <"$POD_LOG")
	want=$(expected_entries "${ids[@]}")
	if [[ $got != "$want" ]]; then
		REASON="pod $pod sees [$(paste -sd';' <<<"$got")] in /dev/infiniband, want [$(paste -sd';' <<<"$want")]"
		return 1
	fi
	POD_IDS=("${ids[@]}")
}

# The container prints FI_PROVIDER after the listing, so the listing is whole.
has_listing() { k logs "$1" 2>/dev/null | grep -q '^FI_PROVIDER='; }

# run_job NAME COUNT: the scheduler places a Job asking for COUNT EFAs, its
# container sees exactly its devices, and the Job completes.
run_job() {
	local name=$1 count=$2 pod
	k delete job "$name" --ignore-not-found --wait >/dev/null 2>&1
	workload "$name" job "$count" >/dev/null || { REASON="Job $name not accepted"; return 1; }
	wait_until 60 job_pod_running "$name" || { REASON="Job $name has no Running pod within 60s: $(k get pods -l "job-name=$name" -o wide 2>&1 | tail -1)"; return 1; }
	pod=$(job_pod "$name")
	check_devices "$pod" "$count" || return 1
	if ! k wait --for=condition=Complete "job/$name" --timeout=60s >/dev/null; then
		REASON="Job $name not Complete within 60s"
		return 1
	fi
	k delete job "$name" --wait >/dev/null
	# The kubelet lists a finished pod's EFAs as held until the pod is gone, which the garbage
	# collector does after the Job: later cases must not see it.
	wait_until 60 no_job_pod "$name" || { REASON="Job $name's pod still there 60s after the Job"; return 1; }
}

job_pod_running() { local p; p=$(job_pod "$1") && [[ -n $p ]] && pod_phase_is "$p" Running; }

# The plugin pod's metrics endpoint, scraped over the pod network.
scrape() {
	local ip
	ip=$(pod_field "$1" '{.status.podIP}' "$NS")
	curl -sf --max-time 5 "http://$ip:9465/metrics"
}

# plugin_installed_ok: a Ready plugin pod on the pod network, with the
# securityContext as shipped, and the node advertising 4 EFAs.
plugin_installed_ok() {
	local shipped=$1 pod ip want got
	if ! wait_until 120 has_ready_plugin_pod; then
		REASON="no Ready plugin pod within 120s: $(kns get pods -o wide 2>&1 | tail -n +2 | paste -sd'|'); $(plugin_events)"
		return 1
	fi
	pod=$(ready_plugin_pod)
	ip=$(pod_field "$pod" '{.status.podIP}' "$NS")
	if [[ $ip != "${NODE_IP%.1}".* || $ip == "$NODE_IP" ]]; then
		REASON="plugin pod $pod has IP '$ip', want one on the pod network $POD_SUBNET"
		return 1
	fi
	want=$(python3 "$HERE/lib/pod_spec.py" security-context <"$shipped")
	got=$(kns get pod "$pod" -o json | python3 "$HERE/lib/pod_spec.py" security-context)
	if [[ $got != "$want" ]]; then
		REASON="plugin pod's securityContext differs from the shipped one: got $got, want $want"
		return 1
	fi
	if ! wait_until $((NODE_STATUS_PERIOD + 30)) allocatable_is 4; then
		REASON="node allocatable $RESOURCE is '$(allocatable)', want 4"
		return 1
	fi
}

plugin_events() {
	kns get events --field-selector involvedObject.kind=Pod -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null |
		tail -3 | paste -sd'|'
}

# ---------------------------------------------------------------- cases

# case_kustomize_install [OVERLAY]: the p4d install, or another overlay of it under cluster/kustomize.
case_kustomize_install() {
	local overlay=${1:-p4d}
	k kustomize "$HERE/cluster/kustomize/$overlay" >"$T/$overlay.yaml" || { REASON="kustomize build failed"; return 1; }
	k kustomize "$REPO/manifests" >"$T/shipped.yaml" || { REASON="kustomize build of manifests failed"; return 1; }
	# The overlay may add only the fake tree: anything else would mean the
	# suite tests a pod spec users do not get.
	if ! REASON=$(python3 "$HERE/lib/pod_spec.py" compare "$T/shipped.yaml" "$T/$overlay.yaml" 2>&1); then
		return 1
	fi
	k apply -k "$HERE/cluster/kustomize/$overlay" >/dev/null || { REASON="kubectl apply -k rejected the overlay"; return 1; }
	plugin_installed_ok "$T/shipped.yaml"
}

case_job() { run_job efa-job 2; }

case_over_ask() {
	local events
	workload over-ask pod 5 >/dev/null || { REASON="pod over-ask not accepted"; return 1; }
	if ! wait_until 60 failed_scheduling over-ask; then
		REASON="no FailedScheduling event naming Insufficient $RESOURCE within 60s: phase $(pod_field over-ask '{.status.phase}'), events: $(pod_events over-ask)"
		return 1
	fi
	if ! pod_phase_is over-ask Pending; then
		REASON="pod over-ask is $(pod_field over-ask '{.status.phase}'), want Pending"
		return 1
	fi
	events=$(pod_events over-ask)
	note "over-ask: $events"
	k delete pod over-ask --wait >/dev/null
}

pod_events() {
	k get events --field-selector "involvedObject.name=$1" -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null |
		paste -sd'|'
}

failed_scheduling() { pod_events "$1" | grep -q "FailedScheduling: .*Insufficient $RESOURCE"; }

case_operator_cli() {
	local pod out n=0 i
	pod=$(ready_plugin_pod)
	if ! out=$(kns exec "$pod" -- /efa-device-plugin --sysfs-root "$SYSFS_IN_POD" list 2>&1); then
		REASON="kubectl exec $pod -- /efa-device-plugin list failed: $out"
		return 1
	fi
	# One row per EFA, naming it by its ID (the ibdev name) and its PCI address.
	for i in "${!EFA_BUSES[@]}"; do
		grep -E "^$(efa_ibdev "$i") .*$(efa_pci "$i")" <<<"$out" >/dev/null && n=$((n + 1))
	done
	if ((n != 4)); then
		REASON="list printed $n devices, want 4: $(paste -sd'|' <<<"$out")"
		return 1
	fi
	# The image is the binary alone: there is no shell to exec.
	if kns exec "$pod" -- sh -c true >/dev/null 2>&1; then
		REASON="the plugin image has a shell"
		return 1
	fi
}

# holder_metrics POD: one scrape of POD into METRICS; true once it shows 4 healthy EFAs and, for
# each of the holder's EFAs, its counters and the info series naming the holder (HELD counts
# them).
holder_metrics() {
	local id ibdev
	HELD=0
	METRICS=$(scrape "$1") || return 1
	grep -qx 'efa_device_plugin_devices{health="healthy"} 4' <<<"$METRICS" || return 1
	for id in "${HOLDER_IDS[@]}"; do
		# An ID is the ibdev name, or with --device-id-strategy=pci the PCI address.
		ibdev=$id
		[[ $id == *:* ]] && ibdev=rdmap$((16#$(cut -d: -f2 <<<"$id")))s27
		if grep -E "^efa_[a-z_]+_total\{" <<<"$METRICS" | grep "device=\"$id\"" | grep -q "ibdev=\"$ibdev\"" &&
			grep -qxF "efa_device_allocation{device=\"$id\",namespace=\"default\",pod=\"holder\",container=\"probe\"} 1" <<<"$METRICS"; then
			HELD=$((HELD + 1))
		fi
	done
	((HELD == 2)) && (($(grep '^efa_device_allocation{' <<<"$METRICS" | grep -c 'pod="holder"') == 2))
}

case_metrics() {
	# holder_metrics sets these, in this scope.
	local pod METRICS='' HELD=0
	workload holder pod 2 >/dev/null || { REASON="pod holder not accepted"; return 1; }
	if ! wait_until 60 pod_phase_is holder Running; then
		REASON="pod holder not Running within 60s: $(pod_events holder)"
		return 1
	fi
	check_devices holder 2 || return 1
	HOLDER_IDS=("${POD_IDS[@]}")
	pod=$(ready_plugin_pod)
	# The plugin learns holders from the kubelet once per rescan interval (5 s), so a scrape
	# right after the pod starts may still show the pods before it.
	if ! wait_until 15 holder_metrics "$pod"; then
		if [[ -z $METRICS ]]; then
			REASON="no answer from http://$(pod_field "$pod" '{.status.podIP}' "$NS"):9465/metrics"
		elif ! grep -qx 'efa_device_plugin_devices{health="healthy"} 4' <<<"$METRICS"; then
			REASON="metrics lack efa_device_plugin_devices{health=\"healthy\"} 4: $(grep '^efa_device_plugin_devices' <<<"$METRICS" | paste -sd'|')"
		else
			REASON="after 15s $HELD of the holder's 2 EFAs have counters and an efa_device_allocation naming its namespace, pod and container: $(grep -E '^efa_device_allocation\{' <<<"$METRICS" | head -3 | paste -sd'|')"
		fi
		return 1
	fi
}

now_ms() { date +%s%3N; }

case_rolling_update() {
	local old new n low=4 below_since=0 below_ms=0 deadline
	old=$(ready_plugin_pod)
	kns rollout restart "daemonset/$DS" >/dev/null || { REASON="rollout restart rejected"; return 1; }
	deadline=$(($(now_ms) + 180000))
	# Sample allocatable until a new pod is Ready and 4 are back, adding up
	# the time the node showed fewer.
	while :; do
		n=$(allocatable)
		if [[ $n != 4 ]]; then
			((below_since == 0)) && below_since=$(now_ms)
			[[ $n =~ ^[0-9]+$ ]] && ((n < low)) && low=$n
		elif ((below_since != 0)); then
			below_ms=$((below_ms + $(now_ms) - below_since))
			below_since=0
		fi
		new=$(ready_plugin_pod)
		[[ -n $new && $new != "$old" && $n == 4 ]] && break
		if (($(now_ms) > deadline)); then
			REASON="rollout did not finish within 180s: ready pod '$new' (old $old), allocatable '$n'"
			return 1
		fi
		sleep 0.2
	done
	if ! pod_phase_is holder Running; then
		REASON="holder is $(pod_field holder '{.status.phase}') after the rollout"
		return 1
	fi
	if [[ $(allocated_ids "$(pod_field holder '{.metadata.uid}')") != "${HOLDER_IDS[*]}" ]]; then
		REASON="holder's devices changed across the rollout"
		return 1
	fi
	if ((below_ms > 0)); then
		CASE_DETAIL="node showed fewer than 4 allocatable for $((below_ms / 1000)).$(printf '%03d' $((below_ms % 1000)))s, lowest $low"
	else
		CASE_DETAIL="node never showed fewer than 4 allocatable"
	fi
}

case_device_loss() {
	local gone=${HOLDER_IDS[0]} i start status
	i=$(efa_index "$gone")
	rm "/dev/infiniband/uverbs$i"
	start=$SECONDS
	if ! wait_until $((NODE_STATUS_PERIOD + 2)) allocatable_is 3; then
		make_uverbs_node /dev "$i"
		REASON="allocatable is '$(allocatable)' $((SECONDS - start))s after uverbs$i went, want 3 within $((NODE_STATUS_PERIOD + 2))s"
		return 1
	fi
	CASE_DETAIL="3 after $((SECONDS - start))s"
	status=unavailable
	if health_gate_on; then
		if wait_until 30 holder_device_health "$gone" Unhealthy; then
			status="holder's $gone Unhealthy in allocatedResourcesStatus"
		else
			make_uverbs_node /dev "$i"
			REASON="holder's allocatedResourcesStatus does not show $gone Unhealthy: $(pod_field holder '{.status.containerStatuses[0].allocatedResourcesStatus}')"
			return 1
		fi
	fi
	make_uverbs_node /dev "$i"
	if ! wait_until $((NODE_STATUS_PERIOD + 2)) allocatable_is 4; then
		REASON="allocatable is '$(allocatable)' after uverbs$i came back, want 4"
		return 1
	fi
	if [[ $status == unavailable ]]; then
		status="pod-status health not shown: ResourceHealthStatus is not available in $KUBE_VERSION"
	elif ! wait_until 30 holder_device_health "$gone" Healthy; then
		REASON="holder's $gone not Healthy again: $(pod_field holder '{.status.containerStatuses[0].allocatedResourcesStatus}')"
		return 1
	fi
	CASE_DETAIL+="; $status"
}

# Whether this Kubernetes version has the gate at all.
health_gate_on() { grep -q 'ResourceHealthStatus=' <("$BIN/kubelet" --help 2>&1); }

holder_device_health() {
	pod_field holder '{range .status.containerStatuses[0].allocatedResourcesStatus[*].resources[*]}{.resourceID}={.health}{"\n"}{end}' |
		grep -qx "$1=$2"
}

case_no_efa() {
	k apply -k "$HERE/cluster/kustomize/no-efa" >/dev/null || { REASON="kubectl apply -k rejected the no-efa overlay"; return 1; }
	if ! wait_until 120 plugin_on_tree "$FIXTURES/no-efa"; then
		REASON="no Ready plugin pod on the empty tree within 120s: $(kns get pods -o wide 2>&1 | tail -n +2 | paste -sd'|')"
		return 1
	fi
	if ! wait_until $((NODE_STATUS_PERIOD + 30)) allocatable_is_none; then
		REASON="allocatable $RESOURCE is '$(allocatable)' on a node without EFA, want 0 or absent"
		return 1
	fi
	CASE_DETAIL="allocatable '$(allocatable)'"
}

allocatable_is_none() { [[ $(allocatable) == "" || $(allocatable) == 0 ]]; }

# plugin_on_tree DIR: the Ready plugin pod mounts DIR as its sysfs.
plugin_on_tree() {
	local pod
	pod=$(ready_plugin_pod) && [[ -n $pod ]] &&
		[[ $(pod_field "$pod" '{.spec.volumes[?(@.name=="e2e-sysfs")].hostPath.path}' "$NS") == "$1" ]]
}

case_helm() {
	local rendered old new
	k delete -k "$HERE/cluster/kustomize/no-efa" --wait >/dev/null || { REASON="kubectl delete -k failed"; return 1; }
	wait_until 60 no_plugin_pod || { REASON="plugin pod still there 60s after kubectl delete -k"; return 1; }
	# The API server must accept every object the chart renders, with the
	# defaults and with every switch on (the PodMonitor and PrometheusRule
	# need their CRDs).
	if ! k apply --server-side "${OPERATOR_CRDS[@]/#/-f}" >/dev/null ||
		! k wait --for condition=Established crd/podmonitors.monitoring.coreos.com crd/prometheusrules.monitoring.coreos.com --timeout=60s >/dev/null; then
		REASON="the PodMonitor and PrometheusRule CRDs were not established"
		return 1
	fi
	for values in "" "$REPO/tests/deploy/values-variant.yaml"; do
		if ! helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" ${values:+-f "$values"} >"$T/helm-render.yaml"; then
			REASON="helm template failed with ${values:-default values}"
			return 1
		fi
		if ! rendered=$(k apply --dry-run=server -f "$T/helm-render.yaml" 2>&1); then
			REASON="API server rejected the chart rendered with ${values:-default values}: $(tail -2 <<<"$rendered" | paste -sd'|')"
			return 1
		fi
	done
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" >"$T/helm-default.yaml"
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" >"$T/helm-e2e.yaml"
	if ! REASON=$(python3 "$HERE/lib/pod_spec.py" compare "$T/helm-default.yaml" "$T/helm-e2e.yaml" 2>&1); then
		return 1
	fi
	helm install efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" >/dev/null ||
		{ REASON="helm install failed"; return 1; }
	plugin_installed_ok "$T/helm-default.yaml" || return 1
	run_job helm-job 2 || return 1
	old=$(ready_plugin_pod)
	helm upgrade efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" \
		--set config.log-level=debug >/dev/null || { REASON="helm upgrade failed"; return 1; }
	if ! wait_until 120 rolled_from "$old"; then
		REASON="plugin pod did not roll after helm upgrade (still $old)"
		return 1
	fi
	helm uninstall efa -n "$NS" --wait >/dev/null || { REASON="helm uninstall failed"; return 1; }
	if ! wait_until 60 no_plugin_pod; then
		REASON="plugin pod still there 60s after helm uninstall"
		return 1
	fi
	if [[ -e $DP_DIR/efa-device-plugin.sock ]]; then
		REASON="$DP_DIR/efa-device-plugin.sock remains after helm uninstall"
		return 1
	fi
}

# The spec file the plugin writes in cdi mode, where containerd 2 reads it.
CDI_SPEC=/var/run/cdi/vpc.amazonaws.com-efa.json

case_cdi() {
	local pod env spec_ids want_ids
	local -a cdi=(--set cdi.enabled=true --set-string config.allocate.env.FI_PROVIDER=efa)
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" "${cdi[@]}" >"$T/helm-cdi.yaml"
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" "${cdi[@]}" >"$T/helm-cdi-e2e.yaml"
	if ! REASON=$(python3 "$HERE/lib/pod_spec.py" compare "$T/helm-cdi.yaml" "$T/helm-cdi-e2e.yaml" 2>&1); then
		return 1
	fi
	helm install efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" "${cdi[@]}" >/dev/null ||
		{ REASON="helm install with cdi.enabled failed"; return 1; }
	plugin_installed_ok "$T/helm-cdi.yaml" || return 1
	if ! wait_until 10 test -s "$CDI_SPEC"; then
		REASON="no CDI spec at $CDI_SPEC"
		return 1
	fi
	spec_ids=$(python3 -c 'import json, sys; print(" ".join(sorted(d["name"] for d in json.load(open(sys.argv[1]))["devices"])))' "$CDI_SPEC")
	want_ids=$(efa_ibdevs)
	if [[ $spec_ids != "$want_ids" ]]; then
		REASON="CDI spec devices [$spec_ids], want [$want_ids]"
		return 1
	fi
	run_job cdi-job 2 || return 1
	env=$(grep '^FI_PROVIDER=' "$POD_LOG")
	if [[ $env != FI_PROVIDER=efa ]]; then
		REASON="the Job's container has ${env:-no FI_PROVIDER line}, want FI_PROVIDER=efa"
		return 1
	fi
	# The spec goes with the plugin only once the kubelet lists no container holding an EFA:
	# case 5's holder still holds two.
	k delete pods --all -n default --wait >/dev/null
	helm uninstall efa -n "$NS" --wait >/dev/null || { REASON="helm uninstall failed"; return 1; }
	wait_until 60 no_plugin_pod || { REASON="plugin pod still there 60s after helm uninstall"; return 1; }
	if [[ -e $CDI_SPEC ]]; then
		REASON="$CDI_SPEC remains after the plugin stopped with no holder left"
		return 1
	fi
}

rolled_from() { local p; p=$(ready_plugin_pod) && [[ -n $p && $p != "$1" ]] && allocatable_is 4; }

# ---------------------------------------------------------------- cleanup

cleanup() {
	local i name
	# The pods first, while the kubelet can still stop them, so the plugin
	# gets its SIGTERM and nothing is left to kill by force.
	[[ -n ${PIDS[kubelet]:-} ]] && alive "${PIDS[kubelet]}" &&
		k delete pods,jobs,daemonsets --all -A --wait --timeout=60s >/dev/null 2>&1
	for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
		name=${DAEMONS[$i]}
		if [[ $name == containerd ]]; then
			kill_containerd "$T/containerd/containerd.sock" "$T/containerd/state" "${PIDS[$name]}"
		else
			stop_pid "${PIDS[$name]}" 30
		fi
	done
	ip link del "$BRIDGE" 2>/dev/null
	# Before restore_host_state, which unmounts what the run mounted.
	arm64_cleanup
	restore_host_state "${HOST_PATHS[@]}"
	[[ -z $DEV_PROPAGATION || $DEV_PROPAGATION == shared* ]] || mount "--make-$DEV_PROPAGATION" /dev
}

main() {
	trap finish EXIT
	trap 'exit 130' INT TERM
	local start=$SECONDS
	setup
	note "cluster up in $((SECONDS - start))s"
	run_case "(1) kustomize install: Ready over the pod IP, shipped securityContext, allocatable 4" case_kustomize_install
	run_case "(2) Job limited to 2 is scheduled, sees exactly its 2 uverbs nodes, completes" case_job
	run_case "(3) pod asking for 5 stays Pending with Insufficient $RESOURCE" case_over_ask
	run_case "(4) kubectl exec list in the plugin pod prints 4 devices" case_operator_cli
	run_case "(5) metrics over the pod IP: 4 healthy, efa_device_allocation names the holder of its 2 EFAs" case_metrics
	run_case "(6) rollout restart: new pod Ready, holder keeps its devices, allocatable 4" case_rolling_update
	run_case "(7) device loss: allocatable 3 within the status period + 2s, then 4" case_device_loss
	run_case "(P1) Prometheus discovers the plugin pod by its prometheus.io/* annotations; target up" case_prometheus_target
	run_case "(P2) Prometheus has every metric family the README lists" case_prometheus_families
	run_case "(P3) Prometheus: the holder's counters carry its namespace, pod and container" case_prometheus_holder_labels
	run_case "(P4) device loss: EfaDeviceUnhealthy fires, every dashboard query has data, the alert resolves" case_prometheus_alert_lifecycle
	run_case "(P5) every PromQL example in the README returns a result" case_readme_promql
	run_case "(8) node without EFA: plugin Ready, allocatable 0 or absent" case_no_efa
	run_case "(9) helm: server-side accepted, install, Job, upgrade rolls, uninstall clean" case_helm
	run_case "(10) CDI mode: Job sees exactly its 2 uverbs nodes through CDI, with FI_PROVIDER=efa" case_cdi
	run_case "(11) CDI mode: with the plugin gone, a holder's killed container restarts with its EFA" case_cdi_spec_outlives_the_plugin
	run_case "(12) Migration, README order: AWS plugin out, this chart in; holder intact, new pod gets the free EFAs" case_migration_readme
	run_case "(13) Migration, this plugin first: 60s beside the AWS plugin without a fight, then it leaves" case_migration_ours_first
	run_case "(14) Migration with device-id-strategy: pci: foreign IDs counted, new pods get the free EFAs 3 times" case_migration_pci
	run_case "(15) CloudWatch's lookup: PodResources names the holder of each ibdev" case_migration_cloudwatch
	dra_cases
	arm64_cases
}

main "$@"
