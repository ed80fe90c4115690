#!/usr/bin/env bash
# Make the local base image from Debian packages (no registry needed), unless it already exists.
#
#   images/base.sh [TAG [PACKAGE...]]   default TAG: pdstack-base:bookworm
#
# debootstrap --variant=minbase bookworm + python3, python3-venv, ca-certificates (+ PACKAGE...), then
# `docker import`. The runtime's CPU base adds gcc and libc6-dev (build.sh): pdstack's CPU kernels are compiled for
# the CPU they run on, at first use in the pod.
# The mirror is the one apt uses on this host (PDSTACK_DEBIAN_MIRROR overrides it). Cached: when the
# image exists it is reused as is (`docker rmi` it, or PDSTACK_REBUILD_BASE=1, to rebuild).
set -euo pipefail
TAG="${1:-pdstack-base:bookworm}"
shift || true
INCLUDE=python3,python3-venv,ca-certificates
for pkg in "$@"; do INCLUDE="$INCLUDE,$pkg"; done
SUITE=bookworm

if [ "${PDSTACK_REBUILD_BASE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base: $TAG exists (cached)"
    exit 0
fi

mirror() {
    if [ -n "${PDSTACK_DEBIAN_MIRROR:-}" ]; then echo "$PDSTACK_DEBIAN_MIRROR"; return; fi
    # deb822 (sources.list.d/*.sources) or one-line format; the first main Debian URI wins.
    local uri
    uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1 || true)
    [ -z "$uri" ] && uri=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk '{for (i=2;i<=NF;i++) if ($i ~ /^https?:/) {print $i; exit}}' | grep -v security | head -1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

command -v debootstrap >/dev/null || { echo "base: debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }
MIRROR=$(mirror)
ROOT=$(mktemp -d /tmp/pdstack-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "base: debootstrap $SUITE from $MIRROR into $ROOT"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 \
    || { tail -30 "$ROOT.log" >&2; rm -f "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"
# Slim it: package lists, caches, docs and man pages are not needed at run time.
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/* "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* \
       "$ROOT"/usr/share/info/* "$ROOT"/var/log/*.log "$ROOT"/usr/share/locale/*
tar -C "$ROOT" --numeric-owner -c . | docker import \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' \
    -m "debootstrap --variant=minbase --include=$INCLUDE $SUITE $MIRROR" \
    - "$TAG" >/dev/null
echo "base: imported $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
