#!/bin/sh
# Makes the unit's dirs, then enables the unit and (re)starts it where systemd runs, so an
# upgrade's new binary serves at once; the kubelet keeps its allocations across the restart.
# With no running systemd (an image build, a chroot, DPKG_ROOT's scratch root) the unit is
# enabled by the link systemctl would make, and the next boot starts it.
set -e
root=${DPKG_ROOT:-}
if command -v systemd-tmpfiles >/dev/null 2>&1; then
	systemd-tmpfiles --root="${root:-/}" --create efa-device-plugin.conf || true
fi
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
	systemctl daemon-reload
	systemctl enable efa-device-plugin.service
	systemctl restart efa-device-plugin.service
else
	mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
	ln -sf /usr/lib/systemd/system/efa-device-plugin.service \
		"$root/etc/systemd/system/multi-user.target.wants/efa-device-plugin.service"
fi
