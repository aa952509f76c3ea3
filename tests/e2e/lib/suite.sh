# shellcheck shell=bash source-path=SCRIPTDIR/..
# The preamble of every end-to-end suite: where the suite and the repository
# are, the libraries all of them use, the claim on the host before anything
# is built or started, and the runner that cleans up on every exit path.
# A suite sources this file, sets SUITE, defines setup and cleanup, and hands
# its case list to run_suite.
# shellcheck disable=SC2034 # HERE, REPO and T are the sourcing suite's

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPO=$(cd "$HERE/../.." && pwd)
source "$HERE/lib/build.sh"
source "$HERE/lib/host.sh"

# claim_host: root and the host-wide lock, then the cache dir; fails the
# setup otherwise.
claim_host() {
	[[ $EUID -eq 0 ]] || fail_setup "must run as root"
	take_lock || fail_setup "another e2e run holds $LOCK"
	mkdir -p "$CACHE"
	undo_killed_runs
}

# require_free_ports WHAT PORT...: nothing listens on PORT... yet; WHAT names
# the likely other listener in the failure.
require_free_ports() {
	local what=$1 port
	shift
	for port in "$@"; do
		[[ -z $(ss -Hltn "sport = :$port") ]] || fail_setup "port $port is in use; is another $what running?"
	done
}

# make_run_dir PREFIX: the run's temp dir T, with T/host for the record of the
# host and T/logs for what keep_logs keeps.
make_run_dir() {
	T=$(mktemp -d "/tmp/$1.XXXXXX")
	mkdir -p "$T/host" "$T/logs"
}

# run_suite CASES...: setup, then the command CASES... that runs the cases;
# finish cleans up and prints the tally on every exit path.
run_suite() {
	trap finish EXIT
	trap 'exit 130' INT TERM
	setup
	"$@"
}
