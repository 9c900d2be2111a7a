#!/usr/bin/env bash
# Resolves requirements/*.lock: exact versions with hashes of everything scripts/setup.sh installs,
# for CPython 3.11 on x86-64 Linux, with uv's pip-compatible resolver.
#
#   bash scripts/lock.sh             re-resolve after an input changed (pyproject.toml or
#                                    requirements/*.in), keeping every other pin where it is
#   bash scripts/lock.sh --upgrade   every package to the newest version the inputs allow, then set
#                                    up .venv from the new lock and run the whole suite on it
#
# Moving forward is a commit of requirements/*.lock that passed the suite: `git diff requirements/`
# shows what moved.
set -euo pipefail
cd "$(dirname "$0")/.."
UPGRADE=()
[ "${1:-}" = "--upgrade" ] && UPGRADE=(--upgrade)

PY=${PYTHON:-python3}
[ -x .venv-lock/bin/python ] || "$PY" -m venv .venv-lock
.venv-lock/bin/python -m pip install -q --require-hashes -r requirements/lock-tool.lock
UV=.venv-lock/bin/uv

# torch's CPU wheel (requirements/overrides.txt) is found where pip finds it: pip's find-links.
FIND_LINKS=()
for dir in $(.venv-lock/bin/python -m pip config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do
    FIND_LINKS+=(--find-links "$dir")
done

compile() {   # compile OUTPUT INPUT... [uv options]
    local out=$1; shift
    "$UV" pip compile --quiet "$@" "${UPGRADE[@]}" "${FIND_LINKS[@]}" --generate-hashes \
        --python-version 3.11 --python-platform x86_64-manylinux_2_35 \
        --custom-compile-command "bash scripts/lock.sh" -o "$out"
}
compile requirements/dev.lock pyproject.toml requirements/tools.in --extra dev \
    --override requirements/overrides.txt
# The container image's install (Dockerfile): kiln's own dependencies and the installers, at the
# versions of the dev lock the suite ran on.
compile requirements/image.lock pyproject.toml requirements/tools.in --constraint requirements/dev.lock
compile requirements/models.lock requirements/models.in --no-deps
compile requirements/openai2.lock requirements/openai2.in --no-deps
compile requirements/clients.lock requirements/clients.in requirements/tools.in
compile requirements/lock-tool.lock requirements/lock-tool.in
echo "requirements/*.lock resolved; git diff --stat requirements/ shows what moved"

if [ ${#UPGRADE[@]} -gt 0 ]; then
    bash scripts/test.sh
fi
