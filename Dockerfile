# syntax=docker/dockerfile:1
# One Dockerfile for linux/amd64 and linux/arm64. The build stage always runs on
# the builder's own platform and cross-compiles, so an arm64 image builds at
# native speed on an amd64 builder instead of under QEMU emulation.
ARG RUST_VERSION=1.95

FROM --platform=$BUILDPLATFORM rust:${RUST_VERSION}-trixie AS build
ARG TARGETARCH
ARG BUILDARCH
# Debian's packages carry both triple-prefixed linkers; naming them for both
# targets costs nothing on a native build. crt-static on the gnu target gives a
# fully static binary with the stock toolchain (no musl toolchain to install).
ENV CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER=x86_64-linux-gnu-gcc \
    RUSTFLAGS="-C target-feature=+crt-static"
# The cross gcc and libc versions follow the base image's Debian release;
# pinning them would break the build at Debian's next point release.
# hadolint ignore=DL3008
RUN set -eu; \
    case "$TARGETARCH" in \
      amd64) triple=x86_64-unknown-linux-gnu; gcc="gcc-x86-64-linux-gnu"; libc="libc6-dev-amd64-cross" ;; \
      arm64) triple=aarch64-unknown-linux-gnu; gcc="gcc-aarch64-linux-gnu"; libc="libc6-dev-arm64-cross" ;; \
      *) echo "unsupported TARGETARCH '$TARGETARCH'" >&2; exit 1 ;; \
    esac; \
    if [ "$TARGETARCH" != "$BUILDARCH" ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends "$gcc" "$libc"; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    rustup target add "$triple"; \
    echo "$triple" > /rust-target
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=efa-device-plugin-target-${TARGETARCH} \
    set -eu; \
    triple="$(cat /rust-target)"; \
    cargo build --release --locked --no-default-features --target "$triple"; \
    cp "target/$triple/release/efa-device-plugin" /efa-device-plugin

# The binary is static and talks only over unix sockets and plain HTTP, so it
# needs no libc, CA bundle or shell at run time.
FROM scratch
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="efa-device-plugin" \
      org.opencontainers.image.description="Kubernetes device plugin for AWS Elastic Fabric Adapter (EFA)" \
      org.opencontainers.image.source="https://github.com/efa-device-plugin/efa-device-plugin" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --from=build /efa-device-plugin /efa-device-plugin
# No USER: the kubelet's device-plugin directory is root-owned, so the pod runs
# as uid 0 by its manifest's securityContext, with every capability dropped.
ENTRYPOINT ["/efa-device-plugin"]
CMD ["run"]
