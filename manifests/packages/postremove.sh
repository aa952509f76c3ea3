#!/bin/sh
# After removal: a socket left by a plugin that did not stop cleanly would have the kubelet dial
# a dead endpoint, so it goes with the package; systemd forgets the unit.
set -e
case "$1" in
remove | purge | 0) ;;
*) exit 0 ;;
esac
root=${DPKG_ROOT:-}
rm -f "$root/var/lib/kubelet/device-plugins/efa-device-plugin.sock"
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi
