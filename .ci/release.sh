#!/usr/bin/env bash
# What the release workflow checks and publishes, kept here so the deploy tier can test it:
#
#   bash .ci/release.sh version        prints Cargo.toml's version, the one the next tag must name
#   bash .ci/release.sh versions TAG   TAG (vX.Y.Z) must equal v + Cargo.toml's version, and the
#                                      chart's version and appVersion must equal that version
#   bash .ci/release.sh notes VERSION  prints the CHANGELOG.md section "## [VERSION]" (without its
#                                      heading); fails if it is missing or empty
set -euo pipefail
cd "$(dirname "$0")/.."

chart=manifests/helm/efa-device-plugin/Chart.yaml

usage() {
  echo "usage: .ci/release.sh version | versions TAG | notes VERSION" >&2
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

case $#:${1:-} in
1:version) cargo_version ;;
2:versions) versions "$2" ;;
2:notes) notes "$2" ;;
*) usage ;;
esac
