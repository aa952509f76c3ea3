#!/usr/bin/env bash
# What the release workflow checks and publishes, kept here so the deploy tier can test it:
#
#   bash .ci/release.sh version        prints Cargo.toml's version, the one the next tag must name
#   bash .ci/release.sh versions TAG   TAG (vX.Y.Z) must equal v + Cargo.toml's version, and the
#                                      chart's version and appVersion must equal that version
#   bash .ci/release.sh notes VERSION  prints the CHANGELOG.md section "## [VERSION]" (without its
#                                      heading); fails if it is missing or empty
#   bash .ci/release.sh packages DIR   builds node mode's .deb and .rpm for amd64 and arm64 into
#                                      DIR from static release binaries, and prints their paths
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

chart=manifests/helm/efa-device-plugin/Chart.yaml

usage() {
  echo "usage: .ci/release.sh version | versions TAG | notes VERSION | packages DIR" >&2
  exit 2
}

# The first `version` key is the package's: Cargo.toml opens with [package].
cargo_version() { sed -n 's/^version *= *"\(.*\)"$/\1/p' Cargo.toml | head -n 1; }
chart_field() { sed -n "s/^$1: *\"\{0,1\}\([^\"]*\)\"\{0,1\} *\$/\1/p" "$chart"; }

versions() {
  local tag=$1 version chart_version app_version ok=0
  version=$(cargo_version)
  chart_version=$(chart_field version)
  app_version=$(chart_field appVersion)
  if [[ $tag != "v$version" ]]; then
    echo "tag $tag does not match Cargo.toml's version $version (expected v$version)" >&2
    ok=1
  fi
  if [[ $chart_version != "$version" ]]; then
    echo "$chart: version is '$chart_version', Cargo.toml's is $version" >&2
    ok=1
  fi
  if [[ $app_version != "$version" ]]; then
    echo "$chart: appVersion is '$app_version', Cargo.toml's is $version" >&2
    ok=1
  fi
  ((ok == 0)) && echo "tag $tag matches Cargo.toml and the chart ($version)"
  return "$ok"
}

notes() {
  local version=$1 body
  body=$(awk -v heading="## [$version]" '
    index($0, heading) == 1 { inside = 1; next }
    inside && /^## / { exit }
    inside && /^\[[^]]*\]: / { exit }
    inside { print }
  ' CHANGELOG.md | sed -e '/./,$!d')
  if [[ -z ${body//[[:space:]]/} ]]; then
    echo "CHANGELOG.md has no notes under '## [$version]'" >&2
    return 1
  fi
  printf '%s\n' "$body"
}

# nFPM builds both formats for every architecture from one file, with no rpmbuild or dpkg
# tooling: built once through the Go module proxy into the tools cache, like the deploy tier's
# Go tools. Bumping the pin builds it again.
nfpm_module=github.com/goreleaser/nfpm/v2/cmd/nfpm@v2.48.0
tools=${EFA_DP_TOOLS_CACHE:-/var/cache/efa-device-plugin-tools}

nfpm_binary() {
  local bin=$tools/bin/nfpm-${nfpm_module##*@}/nfpm
  if [[ ! -x $bin ]]; then
    GOBIN=$(dirname "$bin") GOMODCACHE=$tools/go/mod GOCACHE=$tools/go/build GOFLAGS=-modcacherw \
      GOTOOLCHAIN=local CGO_ENABLED=0 go install "$nfpm_module" >&2 || return 1
    rm -rf "$tools/go"
  fi
  printf '%s\n' "$bin"
}

# packages DIR: each architecture's static binary, as the image's build stage makes it, staged
# with the unit, its tmpfiles entry, the default config and the scripts, then packed by
# manifests/packages/nfpm.yaml as a .deb and an .rpm, named as each format names them.
packages() {
  local out=$1 version nfpm arch triple bin stage format
  # shellcheck source=SCRIPTDIR/../tests/e2e/lib/build.sh
  source tests/e2e/lib/build.sh
  version=$(cargo_version)
  nfpm=$(nfpm_binary) || return 1
  mkdir -p "$out" && out=$(cd "$out" && pwd) || return 1
  arm64_toolchain || return 1
  for arch in amd64 arm64; do
    triple=x86_64-unknown-linux-gnu
    [[ $arch == arm64 ]] && triple=$ARM64_TRIPLE
    bin=$(static_plugin_binary "$repo" "$triple") || return 1
    stage=$(mktemp -d)
    cp "$bin" "$stage/efa-device-plugin" &&
      cp manifests/systemd/efa-device-plugin.service manifests/systemd/efa-device-plugin.tmpfiles \
        manifests/systemd/config.yaml manifests/packages/*.sh "$stage/" || return 1
    for format in deb rpm; do
      (cd "$stage" && ARCH=$arch VERSION=$version "$nfpm" package --config "$repo/manifests/packages/nfpm.yaml" \
        --packager "$format" --target "$out/") >&2 || return 1
    done
    rm -rf "$stage"
  done
  ls -1 "$out"/efa-device-plugin[-_]"$version"*
}

case $#:${1:-} in
1:version) cargo_version ;;
2:versions) versions "$2" ;;
2:notes) notes "$2" ;;
2:packages) packages "$2" ;;
*) usage ;;
esac
