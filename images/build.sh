#!/usr/bin/env bash
# Build both images offline and smoke-run them. CI runs this after `make test` and `make test-slow`.
#
#   images/build.sh                  build pdstack-runtime:$TAG and pdstack-operator:$TAG, then smoke both
#   images/build.sh --no-smoke       build only
#   images/build.sh --push REGISTRY  also tag and push REGISTRY/runtime:$TAG and REGISTRY/operator:$TAG
#
# Environment: TAG (default: dev), PDSTACK_BASE_IMAGE (default: the local debootstrap bases, pdstack-base:bookworm
# for the operator and pdstack-base-cc:bookworm, the same with gcc, for the runtime, made by images/base.sh when
# missing; a base given here is used for both), PYTHON (default: .venv/bin/python).
# Installs docker.io and debootstrap when missing (apt-get, as root) and starts dockerd when it is not
# running. Cached between runs: the base images (docker) and the wheelhouse (.wheelhouse/, refetched only
# when the requirements change); docker's layer cache makes an unchanged rebuild quick.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
TAG="${TAG:-dev}"
PY="${PYTHON:-.venv/bin/python}"
BASE="${PDSTACK_BASE_IMAGE:-pdstack-base:bookworm}"
SMOKE=1
PUSH=""
while [ $# -gt 0 ]; do
    case "$1" in
        --no-smoke) SMOKE=0 ;;
        --push) PUSH="${2:?--push needs a registry, e.g. registry.example.com/pdstack}"; shift ;;
        *) echo "usage: $0 [--no-smoke] [--push REGISTRY]" >&2; exit 2 ;;
    esac
    shift
done
log() { echo "[images +$(( $(date +%s) - T0 ))s] $*"; }

apt_install() {
    [ "$(id -u)" = 0 ] || { echo "images: $* missing; install it (apt-get install $*) or run as root" >&2; exit 1; }
    log "installing $*"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# ---- docker engine
command -v dockerd >/dev/null || apt_install docker.io
command -v docker >/dev/null || apt_install docker.io
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: /tmp/pdstack-dockerd.log, pid: /tmp/pdstack-dockerd.pid)"
    nohup dockerd >/tmp/pdstack-dockerd.log 2>&1 &
    echo $! >/tmp/pdstack-dockerd.pid
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 /tmp/pdstack-dockerd.log >&2; echo "images: dockerd did not start" >&2; exit 1; }
fi
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"  # the classic builder: no buildx plugin needed

# ---- base images (cached): the operator's, and the runtime's with a C compiler (pdstack's CPU kernels are built
# for the pod's own CPU at first use; without one they fall back to torch, and --weights auto to fp32)
RUNTIME_BASE="$BASE"
if [ "$BASE" = pdstack-base:bookworm ]; then
    RUNTIME_BASE=pdstack-base-cc:bookworm
    command -v debootstrap >/dev/null || { docker image inspect "$BASE" >/dev/null 2>&1 \
        && docker image inspect "$RUNTIME_BASE" >/dev/null 2>&1; } || apt_install debootstrap
    images/base.sh "$BASE"
    images/base.sh "$RUNTIME_BASE" gcc libc6-dev
fi

# ---- wheelhouses (cached) and images
VERSION=$("$PY" -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])")
REVISION=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || REVISION="$REVISION-dirty"
CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
for image in operator runtime; do
    "$PY" images/wheelhouse.py "$image" ".wheelhouse/$image"
    log "building pdstack-$image:$TAG"
    # The build stage is tagged too, so the layer cache it holds survives the prune below.
    for target in build final; do
        if [ $target = build ]; then args=(--target build -t "pdstack-$image-build:cache"); else args=(-t "pdstack-$image:$TAG"); fi
        docker build -q -f "images/$image/Dockerfile" "${args[@]}" \
            --build-arg BASE_IMAGE="$(if [ "$image" = runtime ]; then echo "$RUNTIME_BASE"; else echo "$BASE"; fi)" \
            --build-arg VERSION="$VERSION" \
            --build-arg REVISION="$REVISION" --build-arg CREATED="$CREATED" \
            ".wheelhouse/$image" 2> >(grep -v -e DEPRECATED -e 'legacy builder' -e buildx -e BuildKit -e 'environment-variable' -e '^ *$' >&2) >/dev/null
    done
done
# earlier builds' images, now untagged (only ours: they carry the source label)
docker image prune -f --filter "label=org.opencontainers.image.source=https://github.com/pdstack/pdstack" >/dev/null 2>&1 || true
for image in operator runtime; do
    log "pdstack-$image:$TAG $(docker image inspect -f '{{.Size}}' "pdstack-$image:$TAG" | awk '{printf "%.0f MB", $1/1e6}')"
done

# ---- smoke (non-root, read-only root filesystem)
if [ "$SMOKE" = 1 ]; then
    log "smoke: operator"
    "$PY" images/smoke.py operator "pdstack-operator:$TAG"
    log "smoke: runtime"
    "$PY" images/smoke.py runtime "pdstack-runtime:$TAG"
fi

# ---- push
if [ -n "$PUSH" ]; then
    for image in operator runtime; do
        docker tag "pdstack-$image:$TAG" "$PUSH/$image:$TAG"
        docker push "$PUSH/$image:$TAG"
    done
fi
log "done in $(( $(date +%s) - T0 ))s"
