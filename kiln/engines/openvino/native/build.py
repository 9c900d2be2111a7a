"""Compile kiln's OpenVINO extension library (kiln.LinearI8, kiln.GateUpI8) into _build/ beside this file.

    python -m kiln.engines.openvino.native.build          # scripts/setup.sh runs it; idempotent

g++ against the headers and libraries the openvino wheel ships (openvino/include, openvino/libs).
The kernel file is compiled for AVX-512 with VNNI and the registration file for plain x86-64, so the
library loads anywhere and only runs its kernel where a build chose it (kiln/engines/openvino/native).
No compiler, or a failed compile, leave no library: openvino int8 builds then keep the plugin's own
linears, and say so.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL = "linear_i8_kernel.cpp"
OP = "linear_i8_op.cpp"
HEADERS = ("linear_i8_kernel.h",)
OUT_DIR = HERE / "_build"
LIBRARY = OUT_DIR / "libkiln_ov_ops.so"
STAMP = OUT_DIR / "sources.sha256"
COMMON = ("-O3", "-std=c++17", "-fPIC", "-DOV_THREAD=OV_THREAD_TBB", "-Wall", "-Wno-unused-parameter")
KERNEL_ISA = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mfma")


def openvino_dirs() -> tuple[Path, Path]:
    """(include dir, libs dir) of the installed openvino wheel."""
    import openvino

    root = Path(openvino.__file__).resolve().parent
    return root / "include", root / "libs"


def _runtime_libraries(libs: Path) -> list[str]:
    """The wheel's libopenvino and libtbb, by file name (the wheel ships only versioned names)."""
    names = []
    for stem in ("libopenvino.so.", "libtbb.so."):
        found = sorted(p.name for p in libs.glob(stem + "*") if p.name[len(stem):].isdigit())
        if not found:
            raise FileNotFoundError(f"no {stem}* in {libs}")
        names.append(found[-1])
    return names


def sources_hash() -> str:
    h = hashlib.sha256()
    for name in (KERNEL, OP, *HEADERS):
        h.update((HERE / name).read_bytes())
    h.update(" ".join((*COMMON, *KERNEL_ISA)).encode())
    try:
        import openvino

        h.update(openvino.get_version().encode())      # the headers and ABI follow the release
    except ImportError:
        pass
    return h.hexdigest()


def up_to_date() -> bool:
    return LIBRARY.is_file() and STAMP.is_file() and STAMP.read_text(encoding="utf-8").strip() == sources_hash()


def build(compiler: str | None = None, force: bool = False) -> tuple[Path | None, str]:
    """(the library or None, what happened)."""
    if up_to_date() and not force:
        return LIBRARY, f"{LIBRARY} is up to date"
    cxx = compiler or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None, "no C++ compiler (g++) found: openvino int8 builds keep the plugin's linears"
    try:
        include, libs = openvino_dirs()
        runtime = _runtime_libraries(libs)
    except (ImportError, FileNotFoundError) as e:
        return None, f"the openvino wheel's headers or libraries are missing ({e}): openvino int8 builds keep the plugin's linears"
    OUT_DIR.mkdir(exist_ok=True)
    kernel_obj, op_obj, tmp = OUT_DIR / "kernel.o", OUT_DIR / "op.o", LIBRARY.with_suffix(".so.tmp")
    steps = [
        [cxx, *COMMON, *KERNEL_ISA, f"-I{include}", "-c", str(HERE / KERNEL), "-o", str(kernel_obj)],
        [cxx, *COMMON, f"-I{include}", "-c", str(HERE / OP), "-o", str(op_obj)],
        [cxx, "-shared", str(kernel_obj), str(op_obj), f"-L{libs}", *(f"-l:{n}" for n in runtime),
         f"-Wl,-rpath,{libs}", "-o", str(tmp)],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            return None, f"compiling kiln's OpenVINO op library failed (openvino int8 builds keep the plugin's linears):\n{done.stderr}"
    kernel_obj.unlink(missing_ok=True)
    op_obj.unlink(missing_ok=True)
    tmp.replace(LIBRARY)       # NOTE: atomic, so a loader never sees half a library
    STAMP.write_text(sources_hash() + "\n")
    return LIBRARY, f"built {LIBRARY}"


def main() -> int:
    library, message = build(force="--force" in sys.argv)
    print(message)
    return 0      # a machine without a compiler keeps the plugin's linears: not an install failure


if __name__ == "__main__":
    raise SystemExit(main())
