#!/usr/bin/env bash
# Validates every CDI spec the plugin writes against the upstream specification:
# the JSON schema, and the Go library that containerd and CRI-O load specs with.
#
# The plugin binary writes the specs itself: an ignored test in tests/cdi.rs runs
# it in cdi mode on simulated p4d, p5 and 256-EFA nodes, with and without
# sharing, asks Allocate for every device, and keeps each spec next to the names
# Allocate answered. Both the schema and the library come through the Go module
# proxy at pinned versions; nothing of them is vendored.
#
# Prints one PASS or FAIL line per spec; exits non-zero if any fails.
#
# Environment: EFA_DP_E2E_CACHE (default /var/cache/efa-device-plugin-e2e), the
# Go caches the end-to-end builds share, and a venv for the schema validator.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cache=${EFA_DP_E2E_CACHE:-/var/cache/efa-device-plugin-e2e}
# The library version is go.mod's. The schema ships inside the root module up to
# v0.8.1; later releases moved it to a module the proxy does not serve. It covers
# every spec version up to 0.8.0, and the plugin writes 0.5.0.
cdi_module=tags.cncf.io/container-device-interface
schema_version=v0.8.1
python_tools=(jsonschema==4.23.0)
venv=$cache/cdi-schema-venv

# shellcheck source=SCRIPTDIR/../e2e/lib/build.sh
source "$repo/tests/e2e/lib/build.sh"
# shellcheck source=SCRIPTDIR/../../.ci/lib/pinned-venv.sh
source "$repo/.ci/lib/pinned-venv.sh"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

die() {
	echo "FAIL setup: $*"
	exit 1
}

install_python_tools() { pinned_venv "$venv" "${python_tools[@]}"; }

main() {
	command -v go >/dev/null || die "no go toolchain"
	mkdir -p "$cache"
	go_env "$cache"

	install_python_tools >"$work/venv.log" 2>&1 || die "installing ${python_tools[*]}: $(tail -n 3 "$work/venv.log")"
	local schema_dir
	schema_dir=$(cd "$work" && go mod download -json "$cdi_module@$schema_version" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')/schema
	[[ -f $schema_dir/schema.json ]] || die "no schema in $cdi_module@$schema_version"
	# -mod=readonly: the library is exactly what go.mod and go.sum pin.
	(cd "$repo/tests/cdi/validate" && go build -mod=readonly -o "$work/validate" .) >"$work/go.log" 2>&1 ||
		die "building the CDI library validator: $(tail -n 3 "$work/go.log")"

	local out=$work/specs
	EFA_DP_CDI_SPEC_OUT=$out cargo test --locked --manifest-path "$repo/Cargo.toml" --test cdi -- \
		--ignored --exact write_specs_for_validation >"$work/cargo.log" 2>&1 ||
		die "the plugin did not write the specs: $(tail -n 20 "$work/cargo.log")"

	local passed=0 failed=0 fixture spec schema library
	for fixture in "$out"/*/; do
		fixture=${fixture%/}
		spec=$(find "$fixture" -name '*.json' | head -n 1)
		schema=$("$venv/bin/python" "$repo/tests/cdi/schema_check.py" "$schema_dir" "$spec" 2>&1)
		local schema_ok=$?
		library=$("$work/validate" "$fixture" "$fixture/expected-devices.txt" 2>&1)
		local library_ok=$?
		if ((schema_ok == 0 && library_ok == 0)); then
			passed=$((passed + 1))
			echo "PASS ${fixture##*/}: schema $schema_version, library $(go_mod_version): $library"
		else
			failed=$((failed + 1))
			echo "FAIL ${fixture##*/}: schema: $(tail -n 1 <<<"$schema"); library: $library"
		fi
	done
	((passed + failed > 0)) || die "no spec written"
	echo "$passed specs passed, $failed failed"
	((failed == 0))
}

go_mod_version() {
	sed -n "s#^[[:space:]]*$cdi_module v\(.*\)#v\1#p" "$repo/tests/cdi/validate/go.mod"
}

main "$@"
