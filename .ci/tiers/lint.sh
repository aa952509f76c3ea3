#!/usr/bin/env bash
# Lint tier: formatting, clippy with warnings as errors, and the dependency policy in deny.toml
# (licences, bans, sources), all without running any code of the project.
#
# Environment: EFA_DP_TOOLS_CACHE (default /var/cache/efa-device-plugin-tools) keeps cargo-deny
# between runs, so only the first run on a machine builds it.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Bumping the pin installs the new version next to the old one on the next run.
cargo_deny_version=0.20.2
cache="${EFA_DP_TOOLS_CACHE:-/var/cache/efa-device-plugin-tools}"
cargo_deny_root="$cache/cargo-deny-$cargo_deny_version"

# Builds into a private directory and renames it into place, so a run that is interrupted, or
# one racing another run on the same cache, never leaves a half-installed tool behind.
install_cargo_deny() {
  [[ -x $cargo_deny_root/bin/cargo-deny ]] && return 0
  mkdir -p "$cache"
  local staging
  staging="$(mktemp -d "$cache/.cargo-deny-XXXXXX")"
  if cargo install --locked --quiet --root "$staging" "cargo-deny@$cargo_deny_version" &&
    mv -T "$staging" "$cargo_deny_root" 2>/dev/null; then
    return 0
  fi
  rm -rf "$staging"
  # Another run may have won the rename; its copy is as good as ours.
  [[ -x $cargo_deny_root/bin/cargo-deny ]]
}

rustup component add rustfmt clippy >/dev/null 2>&1 || true
cargo --version

echo "--> cargo fmt --check"
cargo fmt --all -- --check

echo "--> cargo clippy (the plugin and the end-to-end runner)"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The plugin alone, as the image builds it: the runner's dependency on the test kit would turn the
# test kit on.
echo "--> cargo clippy --no-default-features (the image's build: no demo, no test kit)"
cargo clippy --all-targets --locked --no-default-features -p efa-device-plugin -- -D warnings

echo "--> cargo deny $cargo_deny_version"
install_cargo_deny
# The licence check reads every crate's manifest, for every target platform, while a build
# downloads only this one's: fetch them all first, so the check itself can stay offline.
cargo fetch --locked --quiet
# --workspace: the root is a package, so without it only the plugin's graph would be checked and
# not the end-to-end runner's.
# --offline: the check reads only Cargo.lock and the local registry, so it needs no network.
# Advisories are left out because they need the network (see deny.toml). A duplicate-version
# warning names both versions; `cargo deny check bans` without the flag shows who pulls each in.
"$cargo_deny_root/bin/cargo-deny" --workspace --offline --locked check --hide-inclusion-graph licenses bans sources
