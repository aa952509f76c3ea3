# shellcheck shell=bash
# A p4d-shaped host with four EFAs, laid out as the kernel lays out sysfs
# (real directories under devices/, symlinks from class/ and for driver and
# device links), so the plugin is exercised on the same path walks it does
# on a real instance.

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

# make_fake_efa_host SYSFS_ROOT DEV_ROOT
make_fake_efa_host() {
	local sys=$1 dev=$2 i bus fn ibdev uverbs counter
	mkdir -p "$sys/bus/pci/drivers/efa" "$sys/class/infiniband" "$sys/class/infiniband_verbs" "$dev/infiniband"
	for i in "${!EFA_BUSES[@]}"; do
		bus=${EFA_BUSES[$i]}
		fn=$sys/devices/pci0000:$bus/0000:$bus:01.0/0000:$bus:1b.0
		ibdev=$(efa_ibdev "$i")
		uverbs=uverbs$i
		mkdir -p "$fn/infiniband/$ibdev/ports/1" "$fn/infiniband_verbs/$uverbs"
		ln -s ../../../../bus/pci/drivers/efa "$fn/driver"
		ln -s "../../../../devices/pci0000:$bus/0000:$bus:01.0/0000:$bus:1b.0" "$sys/bus/pci/drivers/efa/0000:$bus:1b.0"
		echo "${EFA_NUMA[$i]}" >"$fn/numa_node"
		echo 0x1d0f >"$fn/vendor"
		echo 0xefa1 >"$fn/device"
		echo "4: ACTIVE" >"$fn/infiniband/$ibdev/ports/1/state"
		# A few of the counters the efa driver exposes, for the metrics.
		mkdir -p "$fn/infiniband/$ibdev/ports/1/hw_counters"
		for counter in tx_bytes rx_bytes tx_pkts rx_pkts; do
			echo $((1000 * (i + 1))) >"$fn/infiniband/$ibdev/ports/1/hw_counters/$counter"
		done
		ln -s "../../../0000:$bus:1b.0" "$fn/infiniband/$ibdev/device"
		ln -s "../../devices/pci0000:$bus/0000:$bus:01.0/0000:$bus:1b.0/infiniband/$ibdev" "$sys/class/infiniband/$ibdev"
		echo "$UVERBS_MAJOR:$((UVERBS_MINOR_BASE + i))" >"$fn/infiniband_verbs/$uverbs/dev"
		echo "$ibdev" >"$fn/infiniband_verbs/$uverbs/ibdev"
		ln -s "../../../0000:$bus:1b.0" "$fn/infiniband_verbs/$uverbs/device"
		ln -s "../../devices/pci0000:$bus/0000:$bus:01.0/0000:$bus:1b.0/infiniband_verbs/$uverbs" "$sys/class/infiniband_verbs/$uverbs"
		make_uverbs_node "$dev" "$i"
	done
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
