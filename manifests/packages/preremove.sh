#!/bin/sh
# On removal (not on an upgrade): stops the service, whose SIGTERM removes its socket and host
# files, and disables it. dpkg passes "remove", rpm the count of versions left (0 on removal).
set -e
case "$1" in
remove | purge | 0) ;;
*) exit 0 ;;
esac
root=${DPKG_ROOT:-}
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
	systemctl disable --now efa-device-plugin.service || true
fi
rm -f "$root/etc/systemd/system/multi-user.target.wants/efa-device-plugin.service"
