# shellcheck shell=bash
# A p4d-shaped host with four EFAs, laid out as the kernel lays out sysfs
# (real directories under devices/, symlinks from class/ and for driver and
# device links), so the plugin is exercised on the same path walks it does
# on a real instance. Each EFA carries what a current efa driver writes
# (amzn-drivers kernel/linux/efa/RELEASENOTES.md), as testkit's simulated
# nodes do: a non-zero node_guid (r2.12), device/p2p naming the first P2P
# provider (NVIDIA: every host here is a GPU shape), and on Nitro v4 and later
# the port counters r2.17.0 added.

# The extended resource the plugin advertises them as.
# shellcheck disable=SC2034 # read by the suites
RESOURCE=vpc.amazonaws.com/efa
# PCI bus, NUMA node; the position in the list is the uverbs index.
EFA_BUSES=(10 20 90 a0)
EFA_NUMA=(0 0 1 1)
UVERBS_MAJOR=231
UVERBS_MINOR_BASE=192
# Port counters of every efa driver, a few of them: the metrics read them.
EFA_PORT_COUNTERS=(tx_bytes rx_bytes tx_pkts rx_pkts)
# The port counters only Nitro v4 and later show (r2.17.0).
EFA_NITRO_V4_PORT_COUNTERS=(retrans_bytes retrans_pkts retrans_timeout_events
	unresponsive_remote_events impaired_remote_conn_events)
# The device-level counters every efa driver exposes under hw_counters (efa_verbs.c,
# efa_fill_device_stats), as testkit's DEVICE_COUNTERS: a closed admin queue shows there.
EFA_DEVICE_COUNTERS=(submitted_cmds completed_cmds cmds_err no_completion_cmds keep_alive_rcvd)

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

# add_fake_efa SYSFS_ROOT DEV_ROOT PARENTS BDF IBDEV UVERBS NUMA DEVICE NITRO_V4:
# one EFA at devices/PARENTS/BDF (PARENTS: the slash-separated PCI path above
# it), with PCI device ID DEVICE, and its uverbs node; NITRO_V4 is 1 on Nitro v4
# and later (p4d and g5 are older).
add_fake_efa() {
	local sys=$1 dev=$2 parents=$3 bdf=$4 ibdev=$5 i=$6 numa=$7 device=$8 nitro_v4=$9 counter
	local fn=$sys/devices/$parents/$bdf uverbs=uverbs$6 counters=("${EFA_PORT_COUNTERS[@]}")
	((nitro_v4)) && counters+=("${EFA_NITRO_V4_PORT_COUNTERS[@]}")
	# BDF is DOMAIN:BUS:SLOT.FN; the GUID is testkit's: unique to the location.
	local domain=${bdf%%:*} bus=${bdf#*:} slot
	slot=${bus#*:} bus=${bus%%:*} slot=${slot%%.*}
	mkdir -p "$sys/bus/pci/drivers/efa" "$sys/class/infiniband" "$sys/class/infiniband_verbs" "$dev/infiniband"
	mkdir -p "$fn/infiniband/$ibdev/ports/1" "$fn/infiniband_verbs/$uverbs"
	ln -sr "$sys/bus/pci/drivers/efa" "$fn/driver"
	ln -sr "$fn" "$sys/bus/pci/drivers/efa/$bdf"
	echo "$numa" >"$fn/numa_node"
	echo 0x1d0f >"$fn/vendor"
	echo "$device" >"$fn/device"
	echo NVIDIA >"$fn/p2p"
	echo "4: ACTIVE" >"$fn/infiniband/$ibdev/ports/1/state"
	printf '0aef:%04x:%04x:%02x01\n' "$((16#$domain))" "$((16#$bus))" "$((16#$slot))" >"$fn/infiniband/$ibdev/node_guid"
	mkdir -p "$fn/infiniband/$ibdev/ports/1/hw_counters"
	for counter in "${counters[@]}"; do
		echo $((1000 * (i + 1))) >"$fn/infiniband/$ibdev/ports/1/hw_counters/$counter"
	done
	mkdir -p "$fn/infiniband/$ibdev/hw_counters"
	for counter in "${EFA_DEVICE_COUNTERS[@]}"; do
		echo 0 >"$fn/infiniband/$ibdev/hw_counters/$counter"
	done
	ln -s "../../../$bdf" "$fn/infiniband/$ibdev/device"
	ln -sr "$fn/infiniband/$ibdev" "$sys/class/infiniband/$ibdev"
	echo "$UVERBS_MAJOR:$((UVERBS_MINOR_BASE + i))" >"$fn/infiniband_verbs/$uverbs/dev"
	echo "$ibdev" >"$fn/infiniband_verbs/$uverbs/ibdev"
	ln -s "../../../$bdf" "$fn/infiniband_verbs/$uverbs/device"
	ln -sr "$fn/infiniband_verbs/$uverbs" "$sys/class/infiniband_verbs/$uverbs"
	make_uverbs_node "$dev" "$i"
}

# make_fake_efa_host SYSFS_ROOT DEV_ROOT [NUMA...]: the p4d host, each EFA on
# the NUMA node EFA_NUMA gives it, or the one NUMA... gives it.
make_fake_efa_host() {
	local sys=$1 dev=$2 i bus
	shift 2
	local -a numa=("${EFA_NUMA[@]}")
	(($# == 0)) || numa=("$@")
	for i in "${!EFA_BUSES[@]}"; do
		bus=${EFA_BUSES[$i]}
		add_fake_efa "$sys" "$dev" "pci0000:$bus/0000:$bus:01.0" "0000:$bus:1b.0" "$(efa_ibdev "$i")" \
			"$i" "${numa[$i]}" 0xefa1 0 || return 1
	done
}

# The PCIe switch above each EFA of the last make_fake_p5en_host, by ibdev name.
declare -A FAKE_SWITCH=()

# make_fake_p5en_host SYSFS_ROOT DEV_ROOT: a p5en-shaped host, laid out as
# testkit's simulated p5en: 16 EFAs on 8 root complexes, the 2 of a root behind
# one PCIe switch (each on its own downstream port), roots 0-3 on NUMA node 0
# and 4-7 on node 1.
make_fake_p5en_host() {
	local sys=$1 dev=$2 r k root bus upstream ibdev
	for r in 0 1 2 3 4 5 6 7; do
		root=$((0x10 + r * 0x10))
		upstream=$(printf '0000:%02x:00.0' $((root + 1)))
		for k in 0 1; do
			bus=$((root + 3 + k))
			ibdev=rdmap${bus}s0
			FAKE_SWITCH[$ibdev]=$upstream
			add_fake_efa "$sys" "$dev" \
				"$(printf 'pci0000:%02x/0000:%02x:01.0/%s/0000:%02x:%02x.0' "$root" "$root" "$upstream" $((root + 2)) "$k")" \
				"$(printf '0000:%02x:00.0' "$bus")" "$ibdev" $((r * 2 + k)) $((r / 4)) 0xefa2 1 || return 1
		done
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
