#!/usr/bin/env bash
# Creates llama.cpp's peer environment (bench/.cache/venv-llamacpp): llama-cpp-python compiled from
# source for this machine's vector extensions (about 10 minutes on 2 cores).
# Idempotent: a second run only checks the pin. bench_gguf_peers.py calls it when llama.cpp is asked for.
#
# Why not GGML_NATIVE: the flags come from /proc/cpuinfo instead, one by one, so the build log says
# what the kernels use. AMX stays off: a build with it died on an illegal instruction on one of these
# machines, and the ggml AMX path only serves Q4_0/Q4_1/Q8_0 on CPUs that have it.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${KILN_LLAMACPP_VENV:-.cache/venv-llamacpp}
PY=${PYTHON:-python3}
PIN="0.3.36"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-python') != '$PIN')" 2>/dev/null; then
    exit 0
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]]; }
args=(-DGGML_NATIVE=OFF)
declare -A GGML=([avx]=GGML_AVX [avx2]=GGML_AVX2 [fma]=GGML_FMA [f16c]=GGML_F16C [avx_vnni]=GGML_AVX_VNNI
                 [avx512f]=GGML_AVX512 [avx512vbmi]=GGML_AVX512_VBMI [avx512_vnni]=GGML_AVX512_VNNI
                 [avx512_bf16]=GGML_AVX512_BF16)
for cpu_flag in "${!GGML[@]}"; do
    has "$cpu_flag" && args+=("-D${GGML[$cpu_flag]}=ON") || args+=("-D${GGML[$cpu_flag]}=OFF")
done
echo "building llama-cpp-python $PIN with: ${args[*]}"
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
CMAKE_ARGS="${args[*]}" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/python" -m pip install -q --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$PIN" numpy
echo "llama.cpp peer environment ready: $(cd "$VENV" && pwd)"
