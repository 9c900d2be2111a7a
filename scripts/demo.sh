#!/usr/bin/env bash
# The main job on the defaults: build SmolLM2 with no flags (kiln picks the backend and the weights
# for this machine and says which), inspect it, generate. QUANT=none|int8|int4|w8a8|f16 overrides the weights.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kiln build smollm2-135m --out engines/smollm2 ${QUANT:+--quant "$QUANT"} --force
.venv/bin/kiln inspect engines/smollm2
.venv/bin/kiln generate engines/smollm2 --chat "What is the capital of Japan?" --max-tokens 64
