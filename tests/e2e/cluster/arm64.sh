# shellcheck shell=bash
# The arm64 image on the cluster, sourced by tests/e2e/cluster.sh, which
# provides the image; the runner's arm64 cases (A1-A4) install and use it.
#
# The amd64 node runs the arm64 plugin under qemu-aarch64 through binfmt_misc.
# The entry is Debian's own (qemu-user-static's binfmt.d file), whose F flag
# makes the kernel open the interpreter at registration, so it works inside
# containers, whose root has no qemu. The run registers it (and
# mounts binfmt_misc) only if it is not there yet, and the host's record
# (on_restore) undoes just that.

BINFMT=/proc/sys/fs/binfmt_misc
BINFMT_CONF=/usr/lib/binfmt.d/qemu-aarch64.conf
BINFMT_ENTRY=$BINFMT/qemu-aarch64

# arm64_setup: binfmt_misc ready for arm64 containers, and the arm64 image
# imported under its own name.
arm64_setup() {
	if ! mountpoint -q "$BINFMT"; then
		mount -t binfmt_misc binfmt_misc "$BINFMT" || return 1
		on_restore umount "$BINFMT"
	fi
	if [[ ! -e $BINFMT_ENTRY ]]; then
		[[ $(awk -F: '{ print $NF }' "$BINFMT_CONF") == *F* ]] ||
			{ echo "$BINFMT_CONF has no F flag" >&2; return 1; }
		cat "$BINFMT_CONF" >"$BINFMT/register" || return 1
		# shellcheck disable=SC2016 # $1 is the sh's argument
		on_restore sh -c 'echo -1 >"$1"' unregister "$BINFMT_ENTRY"
	fi
	# Someone else's entry serves only if it has F too.
	grep -q '^flags: .*F' "$BINFMT_ENTRY" || { echo "$BINFMT_ENTRY has no F flag" >&2; return 1; }
	ctr_k8s images import --all-platforms "$T/images/arm64.tar" >&2
}
