#!/usr/bin/env bash
# Creates the OpenVINO GenAI peer's own virtual environment (bench/.cache/venv-openvino).
# Idempotent: a second run only checks what is there. bench_runtime.py calls it when the peer is asked for.
#
# Why a separate environment: optimum-intel 2.2.0 (the exporter) declares transformers<5.6, and kiln
# runs on transformers 5.x. The registry's torchvision does not match torch 2.13 (its nms operator
# fails to register and the exporter then cannot import transformers), so it is removed after install.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${KILN_PEER_VENV:-.cache/venv-openvino}
PY=${PYTHON:-python3}
PACKAGES=(
    "openvino==2026.4.1" "openvino-genai==2026.4.1.0" "openvino-tokenizers==2026.4.1.0"
    "torch==2.13.0" "optimum-intel==2.2.0" "nncf>=3.4" "transformers<5.6" "numpy"
)
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
pins = {"openvino": "2026.4.1", "openvino-genai": "2026.4.1.0", "openvino-tokenizers": "2026.4.1.0",
        "optimum-intel": "2.2.0"}
sys.exit(any(md.version(k) != v for k, v in pins.items()))
PY
then
    "$VENV/bin/python" -m pip show -q torchvision >/dev/null 2>&1 && "$VENV/bin/python" -m pip uninstall -q -y torchvision
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${PACKAGES[@]}"
"$VENV/bin/python" -m pip uninstall -q -y torchvision || true
echo "peer environment ready: $(cd "$VENV" && pwd)"
