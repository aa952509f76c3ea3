# shellcheck shell=bash
# The cluster suite's nodes: each one a containerd 2 and a kubelet of its own,
# registered with the suite's one control plane.
#
# The first node runs in the host's namespaces, on the real /var/lib/kubelet
# and /dev/infiniband, as a single-node cluster does. Every further node (the
# fleet, cluster/fleet.sh) runs in a mount namespace of its own, held open by
# a sleeping process, where the node's own directories are bound over the
# paths that the kubelet, the shipped DaemonSet and CDI fix: /var/lib/kubelet,
# /dev/infiniband, the fixtures, /run/cdi, /etc/cdi and the pod logs. What one
# node mounts there is visible neither to another node nor to the host. A
# further node also has:
#   - a cgroup root of its own, because a kubelet takes every pod cgroup under
#     its root that it does not know for an orphan and kills it;
#   - an address of its own on the suite's bridge, and a healthz port;
#   - a kubelet identity of its own (the Node authorizer checks it);
#   - a slice of the pod subnet, so a pod's IP names its node;
#   - NRI off in its containerd, because every containerd would otherwise take
#     over the one NRI socket.
# CPUs and memory are the host's: every kubelet reports all of them.
#
# Sourced by cluster.sh, which sets T, BIN, CONTAINERD_BIN, BRIDGE, POD_SUBNET,
# NODE_STATUS_PERIOD and the pki (make_node_identity signs with its CA).
# shellcheck disable=SC2034 # NODE_HOME and NODE_ADDR are read by the cases

declare -A NODE_ADDR=() NODE_HEALTHZ=() NODE_HOLDER=() NODE_SLOT=() NODE_MOUNTS=()
# The cgroup controllers a further node's root is made in (all v1 hierarchies).
NODE_CGROUP_PARENT=/sys/fs/cgroup

node_home() { echo "$T/nodes/$1"; }

# The paths a further node has of its own, each bound in its mount namespace
# from this dir under its home.
declare -A NODE_BINDS=([/var/lib/kubelet]=kubelet [/dev/infiniband]=dev/infiniband
	[/run/efa-device-plugin-e2e]=fixtures [/run/cdi]=cdi/run [/etc/cdi]=cdi/etc
	[/var/log/pods]=logs/pods [/var/log/containers]=logs/containers)

# node_host_path NODE PATH: where the host sees what NODE sees at PATH: PATH
# itself for the first node, the bind's source under a further node's home.
node_host_path() {
	local node=$1 path=$2 target
	if [[ -n ${NODE_HOLDER[$node]:-} ]]; then
		for target in "${!NODE_BINDS[@]}"; do
			if [[ $path == "$target" || $path == "$target"/* ]]; then
				echo "$(node_home "$node")/${NODE_BINDS[$target]}${path#"$target"}"
				return 0
			fi
		done
	fi
	echo "$path"
}

# on_node NODE CMD...: CMD in NODE's mount namespace (in the host's for the
# first node).
on_node() {
	local node=$1
	shift
	if [[ -n ${NODE_HOLDER[$node]:-} ]]; then
		nsenter -t "${NODE_HOLDER[$node]}" -m -- "$@"
	else
		"$@"
	fi
}

# start_node_daemon NAME NODE CMD...: start_daemon NAME with CMD in NODE's
# mount namespace. nsenter execs CMD without forking, so the PID start_daemon
# keeps is CMD's own, as cleanup and stop_daemon need.
start_node_daemon() {
	local name=$1 node=$2
	shift 2
	if [[ -n ${NODE_HOLDER[$node]:-} ]]; then
		start_daemon "$name" nsenter -t "${NODE_HOLDER[$node]}" -m -- "$@"
	else
		start_daemon "$name" "$@"
	fi
}

ctr_on() {
	local node=$1
	shift
	"$CONTAINERD_BIN/ctr" --address "$(node_home "$node")/containerd/containerd.sock" --namespace k8s.io "$@"
}

node_ready() {
	[[ $(k get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}

# define_node NODE SLOT: NODE's address and healthz port and its slice of the
# pod subnet, from SLOT (0 for the first node, 1, 2, … for the fleet).
define_node() {
	local node=$1 slot=$2
	NODE_SLOT[$node]=$slot
	NODE_ADDR[$node]=${POD_SUBNET%.0/24}.$((slot + 1))
	NODE_HEALTHZ[$node]=$((10248 + 100 * slot))
}

# make_node_identity NODE: the kubelet's client certificate, in group
# system:nodes as system:node:NODE, and its kubeconfig.
make_node_identity() {
	local node=$1 p=$T/pki
	openssl req -newkey rsa:2048 -nodes -subj "/O=system:nodes/CN=system:node:$node" \
		-keyout "$p/kubelet-$node.key" -out "$p/kubelet-$node.csr" 2>/dev/null &&
		openssl x509 -req -in "$p/kubelet-$node.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
			-days 2 -out "$p/kubelet-$node.crt" 2>/dev/null &&
		write_kubeconfig "kubelet-$node"
}

# make_node_namespace NODE: the process that holds NODE's mount namespace, and
# NODE's directories bound in it. A slave of the host's mounts, so the shared
# /dev stays a slave inside (the shipped pod's HostToContainer propagation
# needs one or the other); each bind is made shared for the same reason.
make_node_namespace() {
	local node=$1 home target src
	home=$(node_home "$node")
	start_daemon "holder-$node" unshare --mount --propagation slave sleep infinity
	NODE_HOLDER[$node]=${PIDS[holder-$node]}
	wait_until 10 holder_has_own_mounts "$node" || return 1
	for target in "${!NODE_BINDS[@]}"; do
		src=$home/${NODE_BINDS[$target]}
		mkdir -p "$src" "$target" &&
			on_node "$node" mount --bind "$src" "$target" &&
			on_node "$node" mount --make-shared "$target" || return 1
	done
}

# holder_has_own_mounts NODE: sets NODE_MOUNTS[NODE] once NODE's holder is in a
# mount namespace of its own. One read decides: a link that cannot be read
# (the holder between fork and exec can refuse it) or that still names the
# suite's own namespace is no answer, since kill_in_mount_namespace later kills
# every process in the namespace recorded here.
holder_has_own_mounts() {
	local ns
	ns=$(readlink "/proc/${NODE_HOLDER[$1]}/ns/mnt" 2>/dev/null) || return 1
	[[ -n $ns && $ns != "$(readlink /proc/$$/ns/mnt)" ]] || return 1
	NODE_MOUNTS[$1]=$ns
}

# make_node_cgroup_root NODE: /efa-e2e-NODE in every v1 hierarchy, with the
# cpuset copied from the parent (a new cpuset holds no CPUs).
make_node_cgroup_root() {
	local node=$1 hierarchy dir
	for hierarchy in "$NODE_CGROUP_PARENT"/*/; do
		[[ ${hierarchy%/} == */unified ]] && continue
		dir=$hierarchy/efa-e2e-$node
		mkdir -p "$dir" || return 1
		if [[ -f $dir/cpuset.cpus ]]; then
			cat "$hierarchy/cpuset.cpus" >"$dir/cpuset.cpus" && cat "$hierarchy/cpuset.mems" >"$dir/cpuset.mems" || return 1
		fi
	done
}

# write_node_network NODE: NODE's CNI config: the suite's bridge, with NODE's
# slice of the pod subnet (60 addresses from .10 + 60 × slot).
write_node_network() {
	local node=$1 home first net=${POD_SUBNET%.0/24}
	home=$(node_home "$node")
	first=$((10 + 60 * NODE_SLOT[$node]))
	mkdir -p "$home/cni/net.d"
	cat >"$home/cni/net.d/10-efa-e2e.conflist" <<-EOF
		{"cniVersion": "0.4.0", "name": "efa-e2e", "plugins": [
		  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false,
		   "ipam": {"type": "host-local", "dataDir": "$home/cni/ipam",
		            "ranges": [[{"subnet": "$POD_SUBNET", "rangeStart": "$net.$first",
		                         "rangeEnd": "$net.$((first + 59))", "gateway": "$net.1"}]]}},
		  {"type": "loopback"}]}
	EOF
}

# start_node_containerd NODE: NODE's containerd, with the test images
# (import_test_images made them) and every image tar in IMAGES_FOR_NODES
# imported. CDI is on, as by default in 2.x.
IMAGES_FOR_NODES=()
start_node_containerd() {
	local node=$1 c image nri_off=false
	c=$(node_home "$node")/containerd
	mkdir -p "$c/root" "$c/state" "$c/opt"
	[[ -n ${NODE_HOLDER[$node]:-} ]] && nri_off=true
	# restrict_oom_score_adj: without CAP_SYS_RESOURCE (as in some VMs and
	# containers) nothing may lower oom_score_adj, which CRI otherwise does
	# for every sandbox, failing them all.
	cat >"$c/config.toml" <<-EOF
		version = 3
		root = "$c/root"
		state = "$c/state"
		[grpc]
		  address = "$c/containerd.sock"
		[plugins.'io.containerd.internal.v1.opt']
		  path = "$c/opt"
		[plugins.'io.containerd.nri.v1.nri']
		  disable = $nri_off
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
		    conf_dir = "$(node_home "$node")/cni/net.d"
	EOF
	# The shim is looked up on PATH: ours, not an older one the host has.
	start_node_daemon "containerd-$node" "$node" \
		env PATH="$CONTAINERD_BIN:$PATH" "$CONTAINERD_BIN/containerd" --config "$c/config.toml"
	wait_until 30 ctr_on "$node" version >/dev/null 2>&1 || return 1
	for image in "$T/images/busybox.tar" "$T/images/pause.tar" "${IMAGES_FOR_NODES[@]}"; do
		ctr_on "$node" images import --all-platforms "$image" >&2 || return 1
	done
}

# node_cgroup_root NODE: the cgroup root NODE's kubelet puts its pods under; a
# further node's own (make_node_cgroup_root), the first node's the default.
node_cgroup_root() { if [[ -n ${NODE_HOLDER[$1]:-} ]]; then echo "/efa-e2e-$1"; else echo /; fi; }

# start_node_kubelet NODE: NODE's kubelet, and NODE Ready. A further node's
# kubelet has its cgroup root; the first node's keeps the default.
start_node_kubelet() {
	local node=$1 home cgroups root=
	home=$(node_home "$node")
	cgroups=$(kubelet_cgroup_settings)
	[[ -n ${NODE_HOLDER[$node]:-} ]] && root="cgroupRoot: $(node_cgroup_root "$node")"
	mkdir -p "$home/kubelet-config"
	cat >"$home/kubelet-config/config.yaml" <<-EOF
		apiVersion: kubelet.config.k8s.io/v1beta1
		kind: KubeletConfiguration
		address: ${NODE_ADDR[$node]}
		port: 10250
		readOnlyPort: 0
		healthzBindAddress: 127.0.0.1
		healthzPort: ${NODE_HEALTHZ[$node]}
		authentication:
		  anonymous: {enabled: false}
		  webhook: {enabled: false}
		  x509: {clientCAFile: $T/pki/ca.crt}
		authorization: {mode: AlwaysAllow}
		$cgroups
		$root
		containerRuntimeEndpoint: unix://$home/containerd/containerd.sock
		featureGates: {ResourceHealthStatus: true}
		nodeStatusUpdateFrequency: ${NODE_STATUS_PERIOD}s
		syncFrequency: 5s
		makeIPTablesUtilChains: false
		resolvConf: ""
		imageGCHighThresholdPercent: 100
		imageGCLowThresholdPercent: 99
		evictionHard: {memory.available: 1Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
	EOF
	start_node_daemon "kubelet-$node" "$node" "$BIN/kubelet" --config "$home/kubelet-config/config.yaml" \
		--kubeconfig "$T/pki/kubelet-$node.kubeconfig" --cert-dir "$home/kubelet-config/pki" \
		--hostname-override "$node" --node-ip "${NODE_ADDR[$node]}" --v=2
	wait_until 60 curl -sf "http://127.0.0.1:${NODE_HEALTHZ[$node]}/healthz" -o /dev/null &&
		wait_until 120 node_ready "$node"
}

# start_node NODE: NODE's containerd and kubelet, for a node whose
# namespace, identity, network and cgroup root exist; prints why on failure.
start_node() { containerd_started "$1" && kubelet_started "$1"; }

# containerd_started NODE: start_node_containerd NODE; prints why on failure.
containerd_started() {
	start_node_containerd "$1" && return 0
	echo "containerd of $1 did not start: $(tail -3 "$T/logs/containerd-$1.log" | paste -sd'|')"
	return 1
}

# kubelet_started NODE: start_node_kubelet NODE; prints why on failure.
kubelet_started() {
	start_node_kubelet "$1" && return 0
	echo "node $1 not Ready within 120s: $(tail -3 "$T/logs/kubelet-$1.log" | paste -sd'|')"
	return 1
}

# stop_node NODE: what a power-off does to NODE: its kubelet stopped, every
# container and shim of its containerd killed, its containerd stopped. Disks
# stay (the kubelet's dir, containerd's root); what lives in /run goes
# (containerd's state dir, the CDI specs in /run/cdi).
stop_node() {
	local node=$1 home
	home=$(node_home "$node")
	stop_daemon "kubelet-$node"
	stop_daemon "containerd-$node"
	rm -rf "$home/containerd/state"
	on_node "$node" find /run/cdi -mindepth 1 -delete 2>/dev/null
	return 0
}

# add_node NODE SLOT: a further node in its own namespaces, with the fixtures
# make_node_fixtures NODE builds in its home (defined by the caller), started
# and Ready; prints why on failure.
add_node() {
	local node=$1 slot=$2
	define_node "$node" "$slot"
	make_node_fixtures "$node" || { echo "cannot build the fixtures of $node"; return 1; }
	ip addr add "${NODE_ADDR[$node]}/24" dev "$BRIDGE" || { echo "cannot add ${NODE_ADDR[$node]} to $BRIDGE"; return 1; }
	make_node_namespace "$node" || { echo "cannot make the mount namespace of $node"; return 1; }
	make_node_cgroup_root "$node" || { echo "cannot make the cgroup root of $node"; return 1; }
	make_node_identity "$node" || { echo "cannot make the identity of $node"; return 1; }
	write_node_network "$node"
	start_node "$node"
}

# remove_node NODE: NODE powered off for good, its Node object deleted, and
# its namespace, address and cgroup root gone.
remove_node() {
	local node=$1 hierarchy
	stop_node "$node"
	k delete node "$node" --ignore-not-found --wait=false >/dev/null 2>&1
	stop_daemon "holder-$node"
	kill_in_mount_namespace "${NODE_MOUNTS[$node]}"
	unset "NODE_HOLDER[$node]" "NODE_MOUNTS[$node]"
	ip addr del "${NODE_ADDR[$node]}/24" dev "$BRIDGE" 2>/dev/null
	# The next node in this slot hands out the same pod addresses: the host must
	# not keep sending to the MACs of this node's pods.
	ip neigh flush dev "$BRIDGE" 2>/dev/null
	for hierarchy in "$NODE_CGROUP_PARENT"/*/; do
		remove_cgroup_tree "$hierarchy/efa-e2e-$node"
	done
	rm -rf "$(node_home "$node")"
}

# kill_in_mount_namespace NS: kills whatever still runs in the mount namespace
# NS (as readlink /proc/PID/ns/mnt names it), so that the namespace goes, and
# with it the pod network namespaces bound in it: a network namespace that
# outlived its node would keep its pod's address on the bridge. The suite's own
# namespace is never NS: that would kill the suite and whatever runs it.
kill_in_mount_namespace() {
	local proc
	[[ -n $1 && $1 != "$(readlink /proc/$$/ns/mnt)" ]] || return 0
	for proc in /proc/[0-9]*; do
		[[ $(readlink "$proc/ns/mnt" 2>/dev/null) == "$1" ]] && kill -KILL "${proc#/proc/}" 2>/dev/null
	done
	return 0
}

# remove_cgroup_tree DIR: DIR and its children, deepest first.
remove_cgroup_tree() {
	[[ -d $1 ]] || return 0
	find "$1" -depth -type d -exec rmdir {} + 2>/dev/null
}
