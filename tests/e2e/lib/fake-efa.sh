# shellcheck shell=bash
# What the bash cases know of efa-a's fake p4d host, which the runner's
# efa-fake-host lays out from the test kit's simulated p4d (cluster.sh
# fake_host): each EFA's PCI bus, NUMA node, names and uverbs node. Goes with
# the last bash case that reads it.

# The extended resource the plugin advertises them as.
# shellcheck disable=SC2034 # read by the suites
RESOURCE=vpc.amazonaws.com/efa
# PCI bus, NUMA node; the position in the list is the uverbs index.
EFA_BUSES=(10 20 90 a0)
EFA_NUMA=(0 0 1 1)
UVERBS_MAJOR=231
UVERBS_MINOR_BASE=192
# PCI address of the EFA with uverbs index $1: its device ID under
# device-id-strategy pci.
efa_pci() { printf '0000:%s:1b.0\n' "${EFA_BUSES[$1]}"; }

# Name under class/infiniband of the EFA with uverbs index $1, as rdma-core
# names it from the PCI location: its device ID under the default strategy
# (ibdev), and the AWS plugin's.
efa_ibdev() { printf 'rdmap%ds27\n' "$((16#${EFA_BUSES[$1]}))"; }

# efa_ibdevs [INDEX...]: the ibdev names of the EFAs with those uverbs
# indexes (all by default), sorted as the kubelet's checkpoint lists IDs, on
# one line.
efa_ibdevs() {
	local i
	for i in "${@:-${!EFA_BUSES[@]}}"; do efa_ibdev "$i"; done | sort | paste -sd' '
}

# uverbs index of the EFA whose device ID, under either strategy, is $1.
efa_index() {
	local i
	for i in "${!EFA_BUSES[@]}"; do
		[[ $(efa_ibdev "$i") == "$1" || $(efa_pci "$i") == "$1" ]] && { echo "$i"; return 0; }
	done
	return 1
}

# Creates the device node the plugin hands out for uverbs index $2.
make_uverbs_node() {
	local dev=$1/infiniband/uverbs$2
	mknod -m 0666 "$dev" c "$UVERBS_MAJOR" $((UVERBS_MINOR_BASE + $2))
}

# "c MAJOR MINOR NAME" for each entry of a busybox `ls -l` listing on stdin;
# other output lines are skipped.
listing_entries() {
	awk '$1 != "total" && NF >= 6 { t = substr($1, 1, 1); maj = $5; sub(",", "", maj); print t, maj, $6, $NF }' | sort
}

# What /dev/infiniband must hold for the given device IDs, as listing_entries
# prints it.
expected_entries() {
	local id i
	for id in "$@"; do
		i=$(efa_index "$id") || return 1
		echo "c $UVERBS_MAJOR $((UVERBS_MINOR_BASE + i)) uverbs$i"
	done | sort
}
