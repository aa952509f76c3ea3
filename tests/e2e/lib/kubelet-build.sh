# shellcheck shell=bash
# Builds the upstream kubelet from the Go module proxy and caches the binary
# outside the clone, so only the first run on a machine pays for the build.

# v1.30 (1.30.14 is its last patch release) still treats cgroup v1 as fully
# supported (1.31 put it in maintenance mode, 1.35 refuses it by default) and
# is the newest minor still close to the containerd 1.6 line Debian 12 ships;
# it runs against containerd 1.6.20 here without workarounds.
KUBE_VERSION=${EFA_DP_E2E_KUBE_VERSION:-v1.30.14}

# Prints the path of a cached kubelet binary for $KUBE_VERSION, building it
# first when the cache lacks it.
kubelet_binary() {
	local cache=$1
	local bin=$cache/kubelet-$KUBE_VERSION
	if [[ -x $bin ]]; then
		printf '%s\n' "$bin"
		return 0
	fi
	command -v go >/dev/null || { echo "go toolchain not found" >&2; return 1; }

	# The module cache and build cache live beside the binary so a rebuild
	# (e.g. of another version) reuses downloaded modules and compiled packages.
	export GOPATH=$cache/gopath GOMODCACHE=$cache/gopath/pkg/mod GOCACHE=$cache/gocache
	# cgo off: the kubelet needs none of it here and the build then needs no
	# C toolchain. -modcacherw keeps the cache removable with a plain rm -rf.
	export GOTOOLCHAIN=local GOFLAGS="-mod=mod -modcacherw" CGO_ENABLED=0
	# Runs hold a host-wide lock, so a build dir left here is an interrupted one.
	rm -rf "$cache"/kubelet-build.*
	local work
	work=$(mktemp -d "$cache/kubelet-build.XXXXXX")

	# k8s.io/kubernetes points its staging modules at ./staging, which does
	# not exist for a dependency; each one is published as v0.<minor>.<patch>.
	local staging_version=v0.${KUBE_VERSION#v1.}
	local gomod
	gomod=$(cd "$work" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" |
		sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p') || return 1
	{
		echo "module efa-device-plugin-e2e/kubelet"
		echo "go 1.22.0"
		echo "require k8s.io/kubernetes $KUBE_VERSION"
		sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/.*#replace \1 => \1 '"$staging_version"'#p' "$gomod"
	} >"$work/go.mod"

	local pkg=k8s.io/component-base/version
	local ldflags="-s -w -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitTreeState=clean"
	ldflags+=" -X $pkg.gitMajor=1 -X $pkg.gitMinor=$(cut -d. -f2 <<<"$KUBE_VERSION")"
	if ! (cd "$work" && go get "k8s.io/kubernetes/cmd/kubelet@$KUBE_VERSION" &&
		go build -trimpath -ldflags "$ldflags" -o "$bin.tmp" k8s.io/kubernetes/cmd/kubelet) >&2; then
		rm -rf "$work" "$bin.tmp"
		return 1
	fi
	mv "$bin.tmp" "$bin"
	rm -rf "$work"
	printf '%s\n' "$bin"
}
