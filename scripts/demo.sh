#!/usr/bin/env bash
# The main job on the embedded default (ONNX Runtime, CPU): build the SmolLM2 artifact, generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kiln build smollm2-135m --out engines/smollm2 --quant "${QUANT:-int4}" --force
.venv/bin/kiln inspect engines/smollm2
.venv/bin/kiln generate engines/smollm2 --chat "What is the capital of France?" --max-tokens 64
