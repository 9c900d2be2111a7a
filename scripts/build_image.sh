#!/usr/bin/env bash
# Builds kiln's CPU image with podman and checks it the way a user runs it:
#
#   1. a base image made here from Debian's packages with mmdebstrap (bookworm: CPython 3.11, the
#      lock's), imported into podman (kept between runs; KILN_REBUILD_BASE=1 makes it again);
#      KILN_BASE=python:3.11-slim builds on the Dockerfile's default instead, where a registry is reachable
#   2. `podman build` of the repository's Dockerfile with BASE set to it: the builder stage compiles
#      kiln's op libraries with g++, pip installs requirements/image.lock and kiln from the package
#      index pip is configured with here (local mirrors are mounted into the build, read-only)
#   3. `podman run` with an engine artifact mounted read-only at /models/artifact (the argument, or
#      tiny-llama built now with .venv's kiln), then: /ready, a chat completion through the openai
#      client, the image's HEALTHCHECK (podman healthcheck run), the server's user (not root) and
#      the read-only mount
#   4. a report: image size, base and image build times, time to /ready, the chat answer
#
#   bash scripts/build_image.sh [ARTIFACT]
#
# Needs podman and mmdebstrap (Debian: apt-get install podman mmdebstrap). Settings: KILN_IMAGE (the
# tag, default kiln:cpu: the manifests' image), KILN_BASE (skip mmdebstrap, build on this image), DEBIAN_MIRROR,
# KILN_READY_TIMEOUT (seconds, default 300). The container runtime's options are probed (below): a
# sandbox or a VM may refuse podman's defaults (rlimits raised to the hard limit, crun on hybrid
# cgroups), and the first set that runs a container is used.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
IMAGE=${KILN_IMAGE:-kiln:cpu}   # podman names it localhost/kiln:cpu
BASE_TAG=localhost/kiln-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
READY_TIMEOUT=${KILN_READY_TIMEOUT:-300}
WORK=$(mktemp -d /tmp/kiln-image.XXXXXX)
chmod 755 "$WORK"                  # the container's user (uid 10001) reads the artifact built here
NAME=kiln-image-check-$$
cleanup() {
    podman rm -f "$NAME" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "build_image: $*"; }

for tool in podman mmdebstrap; do
    if ! command -v "$tool" >/dev/null && { [ "$tool" = podman ] || [ -z "${KILN_BASE:-}" ]; }; then
        echo "build_image: $tool is not installed (Debian: apt-get install podman mmdebstrap)" >&2
        exit 3
    fi
done

# --- 1. the base ------------------------------------------------------------------------------------
BASE_SECONDS=0
if [ -n "${KILN_BASE:-}" ]; then
    BASE=$KILN_BASE
elif [ -z "${KILN_REBUILD_BASE:-}" ] && podman image exists "$BASE_TAG"; then
    BASE=$BASE_TAG
    say "base: $BASE (kept from an earlier run; KILN_REBUILD_BASE=1 makes it again)"
else
    BASE=$BASE_TAG
    start=$SECONDS
    # minbase: dpkg, apt and the essential set; python3 is bookworm's CPython 3.11
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$WORK/base.tar" "$MIRROR"
    podman import --quiet --change 'CMD ["/bin/bash"]' "$WORK/base.tar" "$BASE_TAG" >/dev/null
    rm -f "$WORK/base.tar"
    BASE_SECONDS=$((SECONDS - start))
    say "base: $BASE from Debian bookworm with mmdebstrap in ${BASE_SECONDS}s"
fi

# --- the container runtime's options ----------------------------------------------------------------
# podman's defaults first; then runc (crun refuses hybrid cgroup v1/v2 hosts) with the rlimits kept
# within this process's own hard limits (podman raises them, which a sandbox may refuse).
OPTION_SETS=(
    ""
    "--ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=4096:4096"
    "--runtime runc --ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=4096:4096"
)
GLOBAL=() RUN_OPTS=()
found=""
for set in "${OPTION_SETS[@]}"; do
    read -r -a opts <<< "$set"
    global=() local_opts=()
    i=0
    while [ $i -lt ${#opts[@]} ]; do
        if [ "${opts[$i]}" = --runtime ]; then global+=(--runtime "${opts[$((i + 1))]}"); i=$((i + 2))
        else local_opts+=("${opts[$i]}"); i=$((i + 1)); fi
    done
    if podman "${global[@]}" run --rm "${local_opts[@]}" "$BASE" true >/dev/null 2>&1; then
        GLOBAL=("${global[@]}") RUN_OPTS=("${local_opts[@]}") found=yes
        break
    fi
done
if [ -z "$found" ]; then
    echo "build_image: podman cannot run a container here; the last try said:" >&2
    podman "${global[@]}" run --rm "${local_opts[@]}" "$BASE" true >&2 || true
    exit 4
fi
say "podman options: ${GLOBAL[*]} ${RUN_OPTS[*]}"

# --- 2. the image -----------------------------------------------------------------------------------
# pip's configuration here (pip config, PIP_* variables) goes into the build: local folders and
# file:// indexes are mounted read-only and named as they are here, a CA bundle too.
PIP_BUILD=() MOUNTS=()
pip_setting() {     # pip_setting NAME ENV_VALUE: the environment's value, else pip config's
    [ -n "$2" ] && { echo "$2"; return; }
    "$PY" -m pip config get "global.$1" 2>/dev/null || true
}
mount_of() {        # a simple index's pages link to files beside it: its parent folder goes in
    local p=${1#file://}
    p=${p%/}
    case $p in */simple) p=${p%/simple} ;; esac
    [ -e "$p" ] && MOUNTS+=(-v "$p:$p:ro")
    return 0
}
for setting in index-url:PIP_INDEX_URL extra-index-url:PIP_EXTRA_INDEX_URL find-links:PIP_FIND_LINKS cert:PIP_CERT; do
    var=${setting#*:}
    value=$(pip_setting "${setting%%:*}" "${!var:-}")
    value=$(echo $value)     # one line, single spaces
    [ -n "$value" ] || continue
    for item in $value; do
        case $item in file://* | /*) mount_of "$item" ;; esac
    done
    PIP_BUILD+=(--build-arg "$var=$value")
done

start=$SECONDS
# --format docker: OCI images drop HEALTHCHECK; --network host: apt-get and pip reach what this
# machine reaches
if ! podman "${GLOBAL[@]}" build --format docker --network host "${RUN_OPTS[@]}" "${MOUNTS[@]}" \
    --build-arg "BASE=$BASE" "${PIP_BUILD[@]}" -t "$IMAGE" -f Dockerfile . > "$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log" >&2
    echo "build_image: podman build failed" >&2
    exit 5
fi
IMAGE_SECONDS=$((SECONDS - start))
steps=$(grep -c ' STEP ' "$WORK/build.log" || true)
cached=$(grep -c 'Using cache' "$WORK/build.log" || true)
say "build: $steps steps, $cached of them from podman's layer cache"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "image: $IMAGE built in ${IMAGE_SECONDS}s, $((size / 1000000)) MB"

# --- 3. run it --------------------------------------------------------------------------------------
ARTIFACT=${1:-}
if [ -z "$ARTIFACT" ]; then
    ARTIFACT=$WORK/tiny-llama
    say "artifact: building tiny-llama with .venv's kiln (give an artifact folder to serve another)"
    "$PY" -m kiln.cli build tiny-llama --out "$ARTIFACT" >/dev/null
    chmod -R a+rX "$ARTIFACT"
fi
ARTIFACT=$(cd "$ARTIFACT" && pwd)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
podman "${GLOBAL[@]}" run -d --name "$NAME" "${RUN_OPTS[@]}" -p "127.0.0.1:$PORT:8000" \
    -v "$ARTIFACT:/models/artifact:ro" "$IMAGE" >/dev/null
start=$SECONDS
until curl -fsS --max-time 5 "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1; do
    if [ "$(podman inspect --format '{{.State.Status}}' "$NAME")" != running ] \
        || [ $((SECONDS - start)) -gt "$READY_TIMEOUT" ]; then
        podman logs "$NAME" 2>&1 | tail -30 >&2
        echo "build_image: the container did not become ready in ${READY_TIMEOUT}s" >&2
        exit 6
    fi
    sleep 1
done
READY_SECONDS=$((SECONDS - start))
say "ready: /ready answered 200 after ${READY_SECONDS}s"

answer=$("$PY" - "$PORT" <<'EOF'
import sys

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused", max_retries=0)
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
assert reply.choices[0].finish_reason in ("stop", "length"), reply
assert reply.usage.completion_tokens > 0, reply
print(f"{model}: {reply.choices[0].message.content!r} ({reply.usage.completion_tokens} tokens)")
EOF
)
say "chat: $answer"

podman "${GLOBAL[@]}" healthcheck run "$NAME" >/dev/null \
    || { echo "build_image: the image's HEALTHCHECK failed" >&2; exit 7; }
say "healthcheck: healthy"
uid=$(podman "${GLOBAL[@]}" exec "$NAME" python -c 'import os; print(os.getuid())')
server_user=$(podman "${GLOBAL[@]}" top "$NAME" user 2>/dev/null | awk 'NR == 2 {print $1}' || true)
if [ "$uid" = 0 ] || [ "$server_user" = root ] || [ "$server_user" = 0 ]; then
    echo "build_image: the server runs as root (uid $uid, user $server_user)" >&2
    exit 8
fi
if podman "${GLOBAL[@]}" exec "$NAME" touch /models/artifact/.written 2>/dev/null; then
    echo "build_image: the artifact's mount is writable" >&2
    exit 9
fi
say "user: uid $uid ($server_user), not root; the artifact's mount is read-only"
say "summary: image_mb=$((size / 1000000)) base_build_s=$BASE_SECONDS image_build_s=$IMAGE_SECONDS ready_s=$READY_SECONDS"
