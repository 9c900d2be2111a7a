"""Compile kiln's ONNX Runtime custom-op library (MatMulQ4Min) into _build/ beside this file.

    python -m kiln.engines.ort.native.build          # scripts/setup.sh runs it; idempotent

g++ against ONNX Runtime's C API headers (onnxruntime_c_api.h, API 16 or later), which neither the
onnxruntime wheel nor any package this project installs ships: they come with an ONNX Runtime
release archive (its include/ folder) or a system package. The build looks in $KILN_ORT_INCLUDE_DIR,
then in the usual system folders. The library is built for plain x86-64 and picks its vector path at
run time, so one build serves AVX-512, AVX2 and older CPUs. No compiler, no headers or a failed
compile leave no library: kiln then builds int4 without the kernel (MatMulNBits only) and says so;
nothing else needs it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("q4min_kernel.cc", "q8_kernel.cc", "q4min_op.cc")
HEADERS = ("q4min_kernel.h",)
INCLUDE_ENV = "KILN_ORT_INCLUDE_DIR"
SYSTEM_INCLUDES = ("/usr/local/include/onnxruntime", "/usr/include/onnxruntime",
                   "/usr/local/include", "/usr/include")
OUT_DIR = HERE / "_build"
LIBRARY = OUT_DIR / "libkiln_ort_ops.so"
STAMP = OUT_DIR / "sources.sha256"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")


def sources_hash() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update((HERE / name).read_bytes())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()


def up_to_date() -> bool:
    return LIBRARY.is_file() and STAMP.is_file() and STAMP.read_text(encoding="utf-8").strip() == sources_hash()


def ort_include_dir() -> Path | None:
    """The first folder holding onnxruntime_c_api.h: $KILN_ORT_INCLUDE_DIR, then the system's."""
    candidates = [os.environ[INCLUDE_ENV]] if os.environ.get(INCLUDE_ENV) else []
    for folder in map(Path, [*candidates, *SYSTEM_INCLUDES]):
        if (folder / "onnxruntime_c_api.h").is_file():
            return folder
    return None


def build(compiler: str | None = None, force: bool = False) -> tuple[Path | None, str]:
    """(the library or None, what happened)."""
    if up_to_date() and not force:
        return LIBRARY, f"{LIBRARY} is up to date"
    cxx = compiler or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return None, "no C++ compiler (g++) found: int4 builds use MatMulNBits only"
    include = ort_include_dir()
    if include is None:
        return None, (f"no ONNX Runtime C API headers (onnxruntime_c_api.h) in ${INCLUDE_ENV} or "
                      f"{', '.join(SYSTEM_INCLUDES)}: int4 builds use MatMulNBits only. To build kiln's int4 "
                      f"kernel, point {INCLUDE_ENV} at the include/ folder of an ONNX Runtime release "
                      "archive and run `python -m kiln.engines.ort.native.build`")
    OUT_DIR.mkdir(exist_ok=True)
    tmp = LIBRARY.with_suffix(".so.tmp")
    cmd = [cxx, *FLAGS, f"-I{include}", *(str(HERE / s) for s in SOURCES), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        return None, f"compiling the MatMulQ4Min library failed (int4 builds use MatMulNBits only):\n{done.stderr}"
    tmp.replace(LIBRARY)       # NOTE: atomic, so a loader never sees half a library
    STAMP.write_text(sources_hash() + "\n")
    return LIBRARY, f"built {LIBRARY}"


def main() -> int:
    library, message = build(force="--force" in sys.argv)
    print(message)
    return 0      # a machine without a compiler keeps today's path: not an install failure


if __name__ == "__main__":
    raise SystemExit(main())
