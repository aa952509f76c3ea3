# shellcheck shell=bash
# Builds the upstream components the end-to-end suites run (Kubernetes, etcd,
# containerd 2, helm) from source through the Go module proxy, and caches the
# binaries outside the clone so only the first run on a machine pays for them.
# All builds share one Go module cache and one build cache under the cache dir,
# so the control plane reuses what the kubelet build compiled and vice versa.

# One current minor for every Kubernetes component. EKS supports 1.33 to 1.36;
# v1.36.x passes too (EFA_DP_E2E_KUBE_VERSION=v1.36.3).
KUBE_VERSION=${EFA_DP_E2E_KUBE_VERSION:-v1.34.4}
ETCD_VERSION=${EFA_DP_E2E_ETCD_VERSION:-v3.6.16}
CONTAINERD_VERSION=${EFA_DP_E2E_CONTAINERD_VERSION:-v2.2.9}
HELM_VERSION=v3.22.0
# Where every build and its Go caches live, and where a suite keeps its logs.
# shellcheck disable=SC2034 # read by the suites and host.sh
CACHE=${EFA_DP_E2E_CACHE:-/var/cache/efa-device-plugin-e2e}

# go_env CACHE: points the Go toolchain at the shared caches. cgo off: nothing
# built here needs it, so no C toolchain is needed either. -modcacherw keeps
# the cache removable with a plain rm -rf.
go_env() {
	export GOPATH=$1/gopath GOMODCACHE=$1/gopath/pkg/mod GOCACHE=$1/gocache
	export GOTOOLCHAIN=local GOFLAGS="-mod=mod -modcacherw -buildvcs=false" CGO_ENABLED=0
}

# new_workdir CACHE NAME: a scratch module dir. Runs hold a host-wide lock, so
# a build dir left from before is an interrupted one.
new_workdir() {
	rm -rf "$1/build-$2".*
	mktemp -d "$1/build-$2.XXXXXX"
}

# kube_binaries CACHE NAME...: prints the dir holding the named binaries of
# k8s.io/kubernetes/cmd at $KUBE_VERSION, building the missing ones together.
kube_binaries() {
	local cache=$1
	shift
	local dir=$cache/kubernetes-$KUBE_VERSION name missing=()
	for name in "$@"; do
		[[ -x $dir/$name ]] || missing+=("$name")
	done
	if ((${#missing[@]} == 0)); then
		printf '%s\n' "$dir"
		return 0
	fi
	command -v go >/dev/null || { echo "go toolchain not found" >&2; return 1; }
	go_env "$cache"
	local work
	work=$(new_workdir "$cache" kubernetes) || return 1

	kube_gomod "$work" kubernetes || { rm -rf "$work"; return 1; }

	local pkg=k8s.io/component-base/version pkgs=()
	local ldflags="-s -w -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitTreeState=clean"
	ldflags+=" -X $pkg.gitMajor=1 -X $pkg.gitMinor=$(cut -d. -f2 <<<"$KUBE_VERSION")"
	for name in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$name"); done
	mkdir -p "$dir"
	if ! (cd "$work" && go get "k8s.io/kubernetes@$KUBE_VERSION" &&
		go build -trimpath -ldflags "$ldflags" -o "$work/bin/" "${pkgs[@]}") >&2; then
		rm -rf "$work"
		return 1
	fi
	for name in "${missing[@]}"; do mv "$work/bin/$name" "$dir/$name"; done
	rm -rf "$work"
	printf '%s\n' "$dir"
}

# The Go toolchain for a Kubernetes version whose go.mod asks for a newer Go
# than this machine's (v1.38 asks for 1.27): one the module proxy serves, which
# the go command fetches itself.
KUBE_NEWER_TOOLCHAIN=go1.27.3

# kube_module_gomod WORK: the path of k8s.io/kubernetes's own go.mod at
# $KUBE_VERSION, downloaded from WORK, a dir without a go.mod. The download
# may report an error and still fetch the go.mod (a newer Go asked for): only a
# go.mod that is not there fails, with the download's error on stderr.
kube_module_gomod() {
	local json gomod
	json=$(cd "$1" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION")
	gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"$json")
	if [[ ! -f $gomod ]]; then
		echo "no go.mod of k8s.io/kubernetes@$KUBE_VERSION: $(sed -n 's/^[[:space:]]*"Error": "\(.*\)",\{0,1\}$/\1/p' <<<"$json")" >&2
		return 1
	fi
	echo "$gomod"
}

# use_kube_toolchain GOMOD: GOTOOLCHAIN set to KUBE_NEWER_TOOLCHAIN for the
# rest of the calling (sub)shell when GOMOD (kube_module_gomod's) asks for a
# newer Go than the local one; left at go_env's "local" otherwise.
use_kube_toolchain() {
	local want have
	[[ -f $1 ]] || return 1
	want=$(sed -n 's/^go \([0-9.]*\).*/\1/p' "$1" | head -1)
	have=$(go env GOVERSION)
	have=${have#go}
	[[ -n $want && $(printf '%s\n' "$want" "$have" | sort -V | tail -1) != "$have" ]] || return 0
	export GOTOOLCHAIN=$KUBE_NEWER_TOOLCHAIN
}

# kube_gomod WORK NAME: a go.mod in WORK for module efa-device-plugin-e2e/NAME
# requiring k8s.io/kubernetes at $KUBE_VERSION. k8s.io/kubernetes points its
# staging modules at ./staging, which does not exist for a dependency; each one
# is published as v0.<minor>.<patch>.
kube_gomod() {
	local work=$1 name=$2 staging_version=v0.${KUBE_VERSION#v1.} gomod standin
	gomod=$(kube_module_gomod "$work") && use_kube_toolchain "$gomod" &&
		standin=$(iptables_standin_replace "$work" "$gomod") || return 1
	{
		echo "module efa-device-plugin-e2e/$name"
		echo "go 1.22.0"
		echo "require k8s.io/kubernetes $KUBE_VERSION"
		sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/.*#replace \1 => \1 '"$staging_version"'#p' "$gomod"
		[[ -z $standin ]] || echo "$standin"
	} >"$work/go.mod"
}

# iptables_standin_replace WORK GOMOD: prints a replace directive pointing
# sigs.k8s.io/iptables-wrappers at tests/e2e/iptables-standin when GOMOD
# (k8s.io/kubernetes's) requires the module and the module proxy refuses its
# source, as it does for v1.0.0, which the kubelet imports from 1.38 on.
# Prints nothing when the module is not required or is served; fails when the
# download fails for any other reason, so a network fault is not hidden.
iptables_standin_replace() {
	local work=$1 gomod=$2 module=sigs.k8s.io/iptables-wrappers version err
	version=$(awk -v module="$module" '$1 == module && $2 ~ /^v/ { print $2; exit }' "$gomod")
	[[ -n $version ]] || return 0
	err=$(cd "$work" && go mod download "$module@$version" 2>&1) && return 0
	if ! grep -qE '(403|404|410) |not available' <<<"$err"; then
		printf '%s\n' "$err" >&2
		return 1
	fi
	echo "# $module@$version: the module proxy refuses its source; building against tests/e2e/iptables-standin" >&2
	echo "replace $module => $(cd "$(dirname "${BASH_SOURCE[0]}")/../iptables-standin" && pwd)"
}

# The binary `go build` names for PKG: its last element, or the one before a
# major-version suffix (go.etcd.io/etcd/server/v3 builds "server").
binary_name() {
	local base=${1##*/}
	if [[ $base =~ ^v[0-9]+$ ]]; then
		base=${1%/*}
		base=${base##*/}
	fi
	printf '%s\n' "$base"
}

# go_tool_binaries CACHE NAME VERSION TAGS PKG...: prints the dir holding the
# binaries of the packages PKG... of one module at VERSION, building them first
# in a scratch module when the cache lacks them.
go_tool_binaries() {
	local cache=$1 name=$2 version=$3 tags=$4
	shift 4
	local dir=$cache/$name-$version pkg stale=0
	for pkg in "$@"; do
		[[ -x $dir/$(binary_name "$pkg") ]] || stale=1
	done
	if ((stale == 0)); then
		printf '%s\n' "$dir"
		return 0
	fi
	command -v go >/dev/null || { echo "go toolchain not found" >&2; return 1; }
	go_env "$cache"
	local work module=${1%%/cmd/*}
	mkdir -p "$cache" && work=$(new_workdir "$cache" "$name") || return 1
	mkdir -p "$dir"
	if ! (cd "$work" && go mod init "efa-device-plugin-e2e/$name" >/dev/null 2>&1 &&
		go get "$module@$version" &&
		go build -trimpath -tags "$tags" -ldflags "-s -w" -o "$work/bin/" "$@") >&2; then
		rm -rf "$work"
		return 1
	fi
	for pkg in "$@"; do mv "$work/bin/$(binary_name "$pkg")" "$dir/"; done
	rm -rf "$work"
	printf '%s\n' "$dir"
}

# etcd's server is the main package of go.etcd.io/etcd/server/v3.
etcd_binary() {
	local dir
	dir=$(go_tool_binaries "$1" etcd "$ETCD_VERSION" "" go.etcd.io/etcd/server/v3) || return 1
	printf '%s\n' "$dir/server"
}

containerd_binaries() {
	go_tool_binaries "$1" containerd "$CONTAINERD_VERSION" no_btrfs \
		github.com/containerd/containerd/v2/cmd/containerd \
		github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
		github.com/containerd/containerd/v2/cmd/ctr
}

helm_binary() {
	local dir
	dir=$(go_tool_binaries "$1" helm "$HELM_VERSION" "" helm.sh/helm/v3/cmd/helm) || return 1
	printf '%s\n' "$dir/helm"
}

# Prometheus 3.16.0 (its module tags releases v0.<minor><patch>) with only
# Kubernetes service discovery compiled in, which is all the suites use: the
# server for the cluster suite, promtool for the alert rules in the deploy tier.
PROMETHEUS_VERSION=v0.316.0
prometheus_binaries() {
	go_tool_binaries "$1" prometheus "$PROMETHEUS_VERSION" remove_all_sd,enable_kubernetes_sd \
		github.com/prometheus/prometheus/cmd/prometheus \
		github.com/prometheus/prometheus/cmd/promtool
}

# as_root CMD...: CMD as root, through sudo when not root (as on a CI runner);
# sudo -n, so a missing password fails instead of waiting.
as_root() {
	if ((EUID == 0)); then
		"$@"
	else
		sudo -n "$@"
	fi
}

# apt_install CMD:PACKAGE...: installs the packages whose command is missing;
# a bare PACKAGE is checked by its dpkg status instead.
apt_install() {
	local want missing=()
	for want in "$@"; do
		if [[ $want == *:* ]]; then
			command -v "${want%%:*}" >/dev/null || missing+=("${want#*:}")
		elif [[ $(dpkg-query -W -f='${Status}' "$want" 2>/dev/null) != "install ok installed" ]]; then
			missing+=("$want")
		fi
	done
	((${#missing[@]} == 0)) && return 0
	echo "# installing ${missing[*]}" >&2
	as_root apt-get update -qq >&2 &&
		as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

ARM64_TRIPLE=aarch64-unknown-linux-gnu
# What building and running the arm64 binary on another host takes: the cross
# linker and libc the Dockerfile's build stage installs, and the emulator
# (Debian's, which also ships its binfmt_misc entry in /usr/lib/binfmt.d).
ARM64_CROSS_PACKAGES=(aarch64-linux-gnu-gcc:gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-aarch64-static:qemu-user-static)

# arm64_toolchain: the rustup target and the cross packages, on the amd64
# hosts CI and the suites run on. Fails with one line saying what could not be
# installed.
arm64_toolchain() {
	local log
	if ! rustup target list --installed 2>/dev/null | grep -qx "$ARM64_TRIPLE"; then
		log=$(rustup target add "$ARM64_TRIPLE" 2>&1) ||
			{ echo "rustup target add $ARM64_TRIPLE failed: $(tail -n 1 <<<"$log")" >&2; return 1; }
	fi
	log=$(apt_install "${ARM64_CROSS_PACKAGES[@]}" 2>&1) ||
		{ echo "cannot install ${ARM64_CROSS_PACKAGES[*]#*:}: $(tail -n 1 <<<"$log")" >&2; return 1; }
}

# static_plugin_binary REPO [TRIPLE]: builds the plugin for TRIPLE (default:
# the host's) exactly as the image's build stage does, with the stage's own ENV
# (linkers, crt-static) read from the Dockerfile, release and locked, and
# prints its path. The deployment checks build the same targets, so a run
# after them reuses their build.
static_plugin_binary() {
	local triple=${2:-} env
	[[ -n $triple ]] || triple=$(rustc -vV | sed -n 's/^host: //p')
	env=$(python3 "$(dirname "${BASH_SOURCE[0]}")/dockerfile.py" build-env "$1/Dockerfile") || return 1
	mapfile -t env <<<"$env"
	(cd "$1" && env "${env[@]}" cargo build --release --locked --no-default-features --target "$triple" >&2) ||
		return 1
	printf '%s\n' "${CARGO_TARGET_DIR:-$1/target}/$triple/release/efa-device-plugin"
}

# oci_archive STORE TAG ARCHIVE BUD_ARG...: builds TAG with `buildah bud`
# (vfs storage under STORE, chroot isolation: no daemon, no registry) and
# writes it to ARCHIVE as an oci-archive, which `ctr images import` loads.
oci_archive() {
	local store=$1 tag=$2 archive=$3
	shift 3
	buildah_in "$store" bud --isolation chroot -t "$tag" "$@" &&
		buildah_in "$store" push "$tag" "oci-archive:$archive:$tag"
}

buildah_in() {
	local store=$1
	shift
	as_root buildah --root "$store/root" --runroot "$store/runroot" --storage-driver vfs "$@"
}

# plugin_image_index REPO STORE NAME DIR REVISION ARCH=BINARY...: the image
# for each ARCH from the unchanged Dockerfile (--platform linux/ARCH), its
# static BINARY through the build context "build", which stands in for the
# build stage so nothing is pulled; then one OCI index NAME of them all,
# written to DIR/index.tar (every platform), and each image alone to
# DIR/ARCH.tar as NAME-ARCH. Both are oci-archives `ctr images import` takes.
plugin_image_index() {
	local repo=$1 store=$2 name=$3 dir=$4 revision=$5 arg arch ctx
	shift 5
	buildah_in "$store" manifest create "$name" >/dev/null || return 1
	for arg in "$@"; do
		arch=${arg%%=*} ctx=$dir/context-$arch
		mkdir -p "$ctx" && cp "${arg#*=}" "$ctx/efa-device-plugin" || return 1
		(cd "$repo" && oci_archive "$store" "$name-$arch" "$dir/$arch.tar" --platform "linux/$arch" \
			--build-context "build=$ctx" --build-arg "TARGETARCH=$arch" --build-arg "BUILDARCH=$(dpkg --print-architecture)" \
			--build-arg "REVISION=$revision" -f Dockerfile .) &&
			buildah_in "$store" manifest add "$name" "$name-$arch" >/dev/null || return 1
	done
	buildah_in "$store" manifest push --all "$name" "oci-archive:$dir/index.tar:$name"
}

# runner_binary REPO: builds the e2e runner (debug: it waits on daemons, and
# its build reuses most of the lint and unit tiers') and prints its path.
runner_binary() {
	(cd "$1" && cargo build --locked -p efa-e2e-runner >&2) || return 1
	printf '%s\n' "${CARGO_TARGET_DIR:-$1/target}/debug/efa-e2e-runner"
}

# kubelet_cgroup_settings: what the kubelet config needs on this host. From
# 1.35 the kubelet refuses cgroup v1 unless told otherwise; 1.31 to 1.34 know
# the field and only warn.
kubelet_cgroup_settings() {
	echo "cgroupDriver: cgroupfs"
	if [[ ! -e /sys/fs/cgroup/cgroup.controllers ]] && (($(cut -d. -f2 <<<"$KUBE_VERSION") >= 31)); then
		echo "failCgroupV1: false"
	fi
}

# prometheus_operator_crds CACHE: prints the paths of the PodMonitor and
# PrometheusRule CRDs as prometheus-operator publishes them, from its module
# through the proxy, so the chart's optional objects meet the real schemas.
PROMETHEUS_OPERATOR_VERSION=v0.85.0
prometheus_operator_crds() {
	local dir kind
	go_env "$1"
	dir=$(cd "$1" && go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') || return 1
	for kind in podmonitors prometheusrules; do
		printf '%s\n' "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml"
	done
}

# go_program CACHE NAME HASH BUILD...: prints the path of the program NAME
# built for $KUBE_VERSION from sources hashing to HASH, running BUILD in a
# scratch dir holding go_env's settings (BUILD leaves the binary at ./NAME)
# when the cache lacks it. Builds of older sources are then removed.
go_program() {
	local cache=$1 name=$2 hash=$3 work
	shift 3
	local bin=$cache/kubernetes-$KUBE_VERSION/$name-$hash
	if [[ -x $bin ]]; then
		printf '%s\n' "$bin"
		return 0
	fi
	command -v go >/dev/null || { echo "go toolchain not found" >&2; return 1; }
	go_env "$cache"
	work=$(new_workdir "$cache" "$name") || return 1
	mkdir -p "${bin%/*}"
	if ! (cd "$work" && "$@") >&2; then
		rm -rf "$work"
		return 1
	fi
	rm -f "$cache/kubernetes-$KUBE_VERSION/$name"-*
	mv "$work/$name" "$bin"
	rm -rf "$work"
	printf '%s\n' "$bin"
}

# stub_plugin CACHE SRC NAME [DIR...]: prints the path of the Go program in
# the dir SRC, with the sources of the dirs DIR and the stub adapters of
# stubcompat/ beside it, built against
# k8s.io/kubernetes at $KUBE_VERSION (for the kubelet's device-plugin stub), in
# the kubelet build's module and build caches, so it compiles only what the
# kubelet build has not. The binary is cached per version and per hash of the
# sources, so an edit rebuilds it.
stub_plugin() {
	local cache=$1 src=$2 name=$3 compat hash
	compat=$(dirname "${BASH_SOURCE[0]}")/../stubcompat
	local -a files=("$src"/*.go)
	shift 3
	for src in "$@" "$compat"; do files+=("$src"/*.go); done
	hash=$(cat "${files[@]}" | sha256sum | cut -c1-16)
	go_program "$cache" "$name" "$hash" build_stub_plugin "$name" "${files[@]}"
}

build_stub_plugin() {
	local name=$1 stub tags=
	shift
	cp "$@" . || return 1
	# The stub's calls took a context from 1.35 on (stubcompat/stub_ctx.go).
	kube_gomod "$PWD" "$name" && go get "k8s.io/kubernetes@$KUBE_VERSION" &&
		stub=$(go list -f '{{.Dir}}' k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1) &&
		{ ! grep -q 'func (m \*Stub) Start(ctx context.Context)' "$stub/stub.go" || tags=stubctx; } &&
		go build -trimpath -tags "$tags" -ldflags "-s -w" -o "$name" .
}

# dra_driver CACHE SRC NAME [DIR...]: prints the path of the DRA driver in
# the dir SRC, with the sources of the dirs DIR beside it, built against k8s.io/dynamic-resource-allocation (its kubeletplugin helper)
# at the release matching $KUBE_VERSION, v0.<minor>.<patch>, cached as
# stub_plugin's programs are.
dra_driver() {
	local cache=$1 src=$2 name=$3 hash
	local -a files=("$src"/*.go)
	shift 3
	for src in "$@"; do files+=("$src"/*.go); done
	hash=$(cat "${files[@]}" | sha256sum | cut -c1-16)
	go_program "$cache" "$name" "$hash" build_dra_driver "$name" "${files[@]}"
}

build_dra_driver() {
	local name=$1 helper tags=
	shift
	# The helper's DRAPlugin asks for WatchHealthStatus from 1.37 on (the drahealth tag).
	use_kube_toolchain "$(kube_module_gomod "$PWD")" && cp "$@" . && go mod init "efa-device-plugin-e2e/$name" >/dev/null 2>&1 &&
		go get "k8s.io/dynamic-resource-allocation@v0.${KUBE_VERSION#v1.}" && go mod tidy &&
		helper=$(go list -f '{{.Dir}}' k8s.io/dynamic-resource-allocation/kubeletplugin) &&
		{ ! grep -q 'WatchHealthStatus(ctx context.Context' "$helper/draplugin.go" || tags=drahealth; } &&
		go build -trimpath -tags "$tags" -ldflags "-s -w" -o "$name" .
}
