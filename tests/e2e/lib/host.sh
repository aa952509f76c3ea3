# shellcheck shell=bash
# What both end-to-end suites need to run daemons on this host and to leave it
# as they found it: process handling, polling, and a record of the host state
# that kubelets and containerd change whatever they are configured with.
# The record lives on disk, in T/host, and not in shell variables: a run that
# was killed leaves it behind, and the next run undoes that run with it
# (undo_killed_runs).
# The caller sets SUITE (its name) and T (its temp dir, with T/host for the
# records), sources build.sh (for CACHE) and defines cleanup, which finish runs
# on every exit path.
# shellcheck disable=SC2034 # the globals below are the sourcing suite's too

# The kubelet hard-codes this path; --root-dir does not move it.
DP_DIR=/var/lib/kubelet/device-plugins
# Host-wide, whatever the cache dir: two runs would fight over the kubelet's
# fixed device-plugin dir and ports.
LOCK=/run/lock/efa-device-plugin-e2e.lock
LOCK_HELD=
# Kernel tunables the kubelet rewrites at start (protectKernelDefaults would
# instead refuse to start on a host with other values).
SYSCTLS=(vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes)
# The suite's tally: the runner's, and a setup that failed.
PASSED=0
FAILED=0
SKIPPED=0

note() { printf '# %s\n' "$*" >&2; }

fail_setup() {
	echo "FAIL (setup) $*"
	FAILED=$((FAILED + 1))
	exit 1
}

# The EXIT trap of a suite: cleans up, keeps the logs, and prints "N passed, M failed" last.
finish() {
	local rc=$?
	trap - EXIT INT TERM
	if [[ -n $T && -d $T ]]; then
		cleanup >"$T/logs/cleanup.log" 2>&1
		keep_logs "$SUITE"
		rm -rf "$T"
	fi
	[[ -n $LOCK_HELD ]] && rm -f "$LOCK"
	if ((rc != 0 && FAILED == 0)); then
		echo "FAIL (aborted) exit status $rc"
		FAILED=1
	fi
	echo "$PASSED passed, $FAILED failed${EFA_DP_E2E_CASES:+, $SKIPPED skipped (EFA_DP_E2E_CASES)}"
	# A bare exit in an EXIT trap keeps the status from before the trap: 0 when the last
	# command succeeded, even if a case failed.
	((FAILED == 0)) && exit 0
	exit 1
}

# wait_until SECONDS CMD...: polls CMD until it succeeds or time runs out.
wait_until() {
	local end=$((SECONDS + $1))
	shift
	until "$@"; do
		((SECONDS >= end)) && return 1
		sleep 0.5
	done
}

alive() {
	[[ -r /proc/$1/stat ]] && [[ $(sed 's/.*) //' "/proc/$1/stat" | cut -d' ' -f1) != Z ]]
}

dead() { ! alive "$1"; }

# stop_pid PID GRACE: SIGTERM, then SIGKILL after GRACE seconds. Returns the
# exit status of PID, a child of this shell.
stop_pid() {
	local pid=$1 grace=$2
	if alive "$pid"; then
		kill -TERM "$pid" 2>/dev/null
		if ! wait_until "$grace" dead "$pid"; then
			note "pid $pid ignored SIGTERM for ${grace}s; killing it"
			kill -KILL "$pid" 2>/dev/null
			wait_until 10 dead "$pid"
		fi
	fi
	wait "$pid" 2>/dev/null
}

# take_lock: one end-to-end run per host. fd 9 stays closed in the daemons
# (start them with 9>&-) so a straggler cannot hold the lock.
take_lock() {
	exec 9>>"$LOCK"
	flock -n 9 || return 1
	LOCK_HELD=1
}

# make_test_images BUSYBOX: a busybox image and a pause image, both made from
# the static busybox binary BUSYBOX, as T/images/busybox.tar and pause.tar.
make_test_images() {
	mkdir -p "$T/images"
	python3 "$HERE/lib/oci-image.py" "$1" localhost/busybox:1 "$T/images/busybox.tar" sh &&
		python3 "$HERE/lib/oci-image.py" "$1" localhost/pause:1 "$T/images/pause.tar" sleep 2147483647
}

# import_test_images BUSYBOX: make_test_images, imported with the suite's ctr_k8s.
import_test_images() {
	make_test_images "$1" &&
		ctr_k8s images import "$T/images/busybox.tar" >&2 &&
		ctr_k8s images import "$T/images/pause.tar" >&2
}

# remember_host_state PATH...: records which of PATH... exist and what they
# hold, the kubelet's tunables, cgroups, mounts and firewall rules.
remember_host_state() {
	local p s
	for p in "$@"; do
		[[ -e $p ]] && find "$p" -mindepth 1 -maxdepth 1 | sort >"$(host_listing "$p")"
	done
	for s in "${SYSCTLS[@]}"; do
		printf '%s %s\n' "$s" "$(cat "/proc/sys/$s")"
	done >"$T/host/sysctls"
	find /sys/fs/cgroup -mindepth 1 -type d | sort >"$T/host/cgroups"
	awk '{print $5}' /proc/self/mountinfo | sort >"$T/host/mounts"
	if command -v iptables-save >/dev/null; then
		iptables-save >"$T/host/iptables" 2>/dev/null
		ip6tables-save >"$T/host/ip6tables" 2>/dev/null
	fi
	# Last: undo_killed_runs takes a record without it for one that never began,
	# since every path missing its listing would be removed.
	printf '%s\n' "$@" >"$T/host/paths"
}

# host_listing PATH: where remember_host_state lists what PATH held; there is
# none if PATH did not exist.
host_listing() { echo "$T/host/listing$(tr / _ <<<"$1")"; }

# on_restore CMD...: restore_host_state runs CMD, the last recorded first,
# before it unmounts anything: for what a setup step changed outside the
# paths, cgroups and mounts the record covers (a bridge, a mount's propagation).
on_restore() {
	printf '%q ' "$@" >>"$T/host/undo"
	echo >>"$T/host/undo"
}

# remember_process PID: a daemon the run started, stopped by undo_killed_runs
# if the run is killed; its start time tells it from a later process that got
# the same PID.
remember_process() {
	printf '%s %s\n' "$1" "$(process_start "$1")" >>"$T/host/processes"
}

process_start() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20; }

# move_aside PATH: keeps what is at PATH out of the run (a checkpoint or
# socket left by anything else would leak into the kubelet's state and our
# assertions) and restore_host_state puts it back.
move_aside() {
	local keep
	[[ -e $1 || -L $1 ]] || return 0
	keep=$T/host/aside$(tr / _ <<<"$1")
	mv "$1" "$keep" && printf '%s\t%s\n' "$1" "$keep" >>"$T/host/aside"
}

# kill_containerd STATE_DIR PID CTR...: kills every task in the k8s.io
# namespace, then containerd, then the shims that outlive it. CTR... is the
# suite's ctr for that containerd (ctr_k8s, ctr_on NODE), which knows its
# address and the build of ctr that matches it. Every step is best effort
# (a task may end between the listing and the kill), so ctr's complaints, and
# containerd 2's cgroup v1 notice on each call, stay out of the suite's output.
kill_containerd() {
	local state=$1 pid=$2 id pidfile shim
	shift 2
	for id in $("$@" tasks ls -q 2>/dev/null); do
		"$@" tasks kill -s SIGKILL "$id" 2>/dev/null
	done
	for id in $("$@" tasks ls -q 2>/dev/null); do
		"$@" tasks delete -f "$id" 2>/dev/null
	done
	for id in $("$@" containers ls -q 2>/dev/null); do
		"$@" containers delete "$id" 2>/dev/null
	done
	stop_pid "$pid" 15
	# Shims' PIDs are in each task's bundle dir.
	for pidfile in "$state"/io.containerd.runtime.v2.task/*/*/{init,shim}.pid; do
		[[ -f $pidfile ]] || continue
		shim=$(cat "$pidfile")
		if alive "$shim" && grep -qF "$T" "/proc/$shim/cmdline" "/proc/$shim/cgroup" 2>/dev/null; then
			kill -KILL "$shim"
		fi
	done
}

# remove_new_cgroups: the cgroups the run's kubelets made (kubepods, and each
# node's cgroup root), deepest first, with whatever still runs in them. Only
# those: anything else on the host may make cgroups while a run lasts, and a
# killed run is undone long after its record was taken.
remove_new_cgroups() {
	local dir pid
	find /sys/fs/cgroup -mindepth 1 -type d | sort >"$T/host/cgroups.after"
	comm -13 "$T/host/cgroups" "$T/host/cgroups.after" | grep -E '^/sys/fs/cgroup/([^/]+/)?(kubepods|efa-e2e-)' |
		awk -F/ '{print NF, $0}' | sort -rn | cut -d' ' -f2- >"$T/host/cgroups.new"
	for _ in 1 2 3 4 5; do
		while read -r dir; do
			[[ -d $dir ]] || continue
			while read -r pid; do
				kill -KILL "$pid" 2>/dev/null
			done <"$dir/cgroup.procs"
			rmdir "$dir" 2>/dev/null
		done <"$T/host/cgroups.new"
		grep -q . <(while read -r dir; do [[ -d $dir ]] && echo "$dir"; done <"$T/host/cgroups.new") || return 0
		sleep 1
	done
	note "cgroups left behind: $(while read -r dir; do [[ -d $dir ]] && echo "$dir"; done <"$T/host/cgroups.new" | paste -sd' ')"
}

unmount_new() {
	local m
	awk '{print $5}' /proc/self/mountinfo | sort -u | comm -13 "$T/host/mounts" - |
		awk '{print length, $0}' | sort -rn | cut -d' ' -f2- |
		while read -r m; do
			umount -R "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
		done
}

# restore_host_state: undoes what remember_host_state recorded, on_restore's
# commands first, then puts back what move_aside kept. Also for a killed run's
# record, so it reads nothing but T/host.
restore_host_state() {
	local p entry s value keep
	# A setup that failed before remember_host_state finished changed nothing yet.
	[[ -f $T/host/paths ]] || return 0
	[[ -f $T/host/undo ]] && tac "$T/host/undo" | while read -r entry; do eval "$entry"; done
	remove_new_cgroups
	unmount_new
	while read -r p; do
		if [[ ! -f $(host_listing "$p") ]]; then
			rm -rf "$p"
		elif [[ -d $p ]]; then
			find "$p" -mindepth 1 -maxdepth 1 | sort | comm -13 "$(host_listing "$p")" - |
				while read -r entry; do rm -rf "$entry"; done
		fi
	done <"$T/host/paths"
	# A cleanup that was itself killed may have put some back already.
	[[ -f $T/host/aside ]] && while IFS=$'\t' read -r p keep; do
		[[ -e $keep || -L $keep ]] || continue
		rm -rf "$p"
		mkdir -p "$(dirname "$p")"
		mv "$keep" "$p"
	done <"$T/host/aside"
	while read -r s value; do
		[[ $(cat "/proc/sys/$s") == "$value" ]] || echo "$value" >"/proc/sys/$s"
	done <"$T/host/sysctls"
	if [[ -f $T/host/iptables ]]; then
		rules_changed iptables && iptables-restore <"$T/host/iptables"
		rules_changed ip6tables && ip6tables-restore <"$T/host/ip6tables"
	fi
	return 0
}

# undo_killed_runs: with the lock held no other run is alive, so a run dir that
# still holds a record of the host is a killed run's (a run that ends cleans up
# and removes its dir): its processes are killed and the host is put back as
# that run found it.
undo_killed_runs() {
	local dir
	for dir in /tmp/efa-dp-*.*/; do
		[[ -f $dir/host/paths ]] || continue
		note "undoing what a killed run left in ${dir%/}"
		undo_run "${dir%/}" >>"$CACHE/undo-killed-runs.log" 2>&1
		rm -rf "$dir"
	done
}

# undo_run DIR: kill_leftovers and restore_host_state for the run whose temp
# dir was DIR, which they see as T.
undo_run() {
	local T=$1
	kill_leftovers
	restore_host_state
}

# kill_leftovers: the processes of the run at T: the daemons it remembered,
# and anything else it started, which names T on its command line (the
# runner, kubelets, containerd, shims, plugins in node mode).
kill_leftovers() {
	local pid start proc
	[[ -f $T/host/processes ]] && while read -r pid start; do
		[[ $(process_start "$pid") == "$start" ]] && kill -KILL "$pid"
	done <"$T/host/processes"
	for proc in /proc/[0-9]*; do
		grep -qaF -- "$T" "$proc/cmdline" 2>/dev/null && kill -KILL "${proc#/proc/}" 2>/dev/null
	done
	sleep 1
}

# rules_changed iptables|ip6tables: the rules differ from the recorded ones,
# comments and packet counters aside.
rules_changed() {
	local strip='/^#/d; s/\[[0-9]*:[0-9]*\]//'
	[[ $("$1-save" 2>/dev/null | sed "$strip") != $(sed "$strip" "$T/host/$1") ]]
}

# keep_logs: the temp dir goes, the logs stay in the cache, so a failed run
# can be read afterwards.
keep_logs() {
	rm -rf "$CACHE/logs-$1"
	cp -r "$T/logs" "$CACHE/logs-$1"
	note "logs: $CACHE/logs-$1"
}
