#!/usr/bin/env bash
# Make this machine able to build and run docker-compose.yml with Podman, no Docker engine:
# what `make test-compose` needs on a fresh Debian 12 host (and what a user without Docker can run).
#
#   deploy/docker/podman-setup.sh            # idempotent: each step is skipped when already done
#
# 1. Podman 4.3 and its helpers from Debian (apt), as root or through sudo.
# 2. /etc/containers/containers.conf with runc and explicit ulimits: without them every container
#    fails here ("setrlimit RLIMIT_NOFILE: Operation not permitted"; crun: "cgroups in hybrid mode
#    not supported"). An existing file that already names runc is left alone.
# 3. A base image, localhost/stargym-base:bookworm, made with debootstrap (Debian 12 minbase with
#    python3.11, venv and curl): the Dockerfiles take it as BASE_IMAGE where no registry is
#    reachable (the default, python:3.11-slim, comes from Docker Hub). It trusts the CAs this host
#    adds (/usr/local/share/ca-certificates): where egress goes through a TLS-inspecting proxy,
#    pip inside a build fails certificate checks without them.
# Recipe measured on this machine: ../shared/notes/podman-compose.md.
set -euo pipefail

BASE_IMAGE="${BASE_IMAGE:-localhost/stargym-base:bookworm}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    echo "podman-setup: installing podman and debootstrap (apt)"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        podman uidmap slirp4netns fuse-overlayfs runc debootstrap >/dev/null
fi

CONF=/etc/containers/containers.conf
if ! grep -qs '^runtime *= *"runc"' "$CONF"; then
    echo "podman-setup: writing $CONF (runc, ulimits)"
    $SUDO mkdir -p /etc/containers
    printf '[containers]\ndefault_ulimits = ["nofile=16384:16384", "nproc=16384:16384"]\n[engine]\nruntime = "runc"\n' |
        $SUDO tee "$CONF" >/dev/null
fi

if ! podman image exists "$BASE_IMAGE"; then
    # The host's own Debian mirror: the one apt already reaches.
    MIRROR="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
    ROOTFS="$(mktemp -d "${TMPDIR:-/tmp}/stargym-rootfs.XXXXXX")"
    trap '$SUDO rm -rf "$ROOTFS"' EXIT
    echo "podman-setup: building $BASE_IMAGE with debootstrap from $MIRROR"
    $SUDO debootstrap --variant=minbase --include=python3,python3-venv,curl,ca-certificates \
        bookworm "$ROOTFS" "$MIRROR" >/dev/null
    $SUDO rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        $SUDO cp /usr/local/share/ca-certificates/*.crt "$ROOTFS"/usr/local/share/ca-certificates/
        $SUDO chroot "$ROOTFS" update-ca-certificates >/dev/null 2>&1
    fi
    $SUDO tar -C "$ROOTFS" -c . | podman import --quiet --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
fi
echo "podman-setup: ready ($(podman --version), base image $BASE_IMAGE)"
