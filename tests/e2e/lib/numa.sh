# shellcheck shell=bash
# A two-node NUMA view for a kubelet on a host with one node. cAdvisor, the
# kubelet's only reader of NUMA topology, reads /sys/devices/system/node once
# at start; a fake tree bind-mounted there in a private mount namespace gives
# the kubelet two nodes, each with a share of the real CPUs (their cpuN links
# resolve through the real /sys/devices/system/cpu), half the memory, the
# hugepage sizes the host has and a distance table. Nothing outside the
# namespace sees the mount, and it goes with the namespace; the e2e runner
# checks both before the kubelet starts.

NODE_SYSFS=/sys/devices/system/node

# in_private_mount_namespace: this shell's mount namespace is not the one the
# suite was started in (EFA_DP_E2E_OUTER_MOUNTS, set before its unshare). Init's
# is no reference: its link cannot always be read, and "" differs from any.
in_private_mount_namespace() {
	local own
	own=$(readlink /proc/self/ns/mnt) || return 1
	[[ -n ${EFA_DP_E2E_OUTER_MOUNTS:-} && $own != "$EFA_DP_E2E_OUTER_MOUNTS" ]]
}

# make_two_node_tree DIR: the fake tree, from the real one: the first half of
# the CPUs on node 0, the rest on node 1. Needs at least two CPUs.
make_two_node_tree() {
	local dir=$1 cpu total node size half
	local -a cpus
	mapfile -t cpus < <(for cpu in "$NODE_SYSFS"/node*/cpu[0-9]*; do echo "${cpu##*/cpu}"; done | sort -n)
	((${#cpus[@]} >= 2)) || { echo "need at least 2 CPUs for two NUMA nodes, have ${#cpus[@]}" >&2; return 1; }
	total=$(awk '/MemTotal/ {kb += $4} END {print kb}' "$NODE_SYSFS"/node*/meminfo)
	half=$((${#cpus[@]} / 2))
	for node in 0 1; do
		local -a mine=("${cpus[@]:node*half:node == 0 ? half : ${#cpus[@]}}")
		mkdir -p "$dir/node$node"
		for cpu in "${mine[@]}"; do
			ln -s "../../cpu/cpu$cpu" "$dir/node$node/cpu$cpu"
		done
		(
			IFS=,
			echo "${mine[*]}" >"$dir/node$node/cpulist"
		)
		printf 'Node %d MemTotal:       %d kB\n' "$node" $((total / 2)) >"$dir/node$node/meminfo"
		if ((node == 0)); then echo "10 20"; else echo "20 10"; fi >"$dir/node$node/distance"
		for size in "$NODE_SYSFS"/node0/hugepages/hugepages-*; do
			[[ -d $size ]] || continue
			mkdir -p "$dir/node$node/hugepages/${size##*/}"
			echo 0 >"$dir/node$node/hugepages/${size##*/}/nr_hugepages"
		done
	done
	local f
	for f in online possible has_cpu has_memory has_normal_memory; do echo 0-1 >"$dir/$f"; done
}

# mount_two_node_tree DIR: DIR over the real tree; in a private mount
# namespace only.
mount_two_node_tree() {
	in_private_mount_namespace || { echo "not in a private mount namespace" >&2; return 1; }
	mount --bind "$1" "$NODE_SYSFS"
}
