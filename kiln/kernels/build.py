"""Build kiln's kernel library (kiln/kernels) once and link the op libraries that use it.

    python -m kiln.kernels.build [--force]               # both op libraries
    python -m kiln.engines.ort.native.build [--force]    # the ONNX Runtime one (scripts/setup.sh runs it)
    python -m kiln.engines.openvino.native.build         # the OpenVINO one (scripts/setup.sh runs it)

The kernel objects (kiln/kernels/_build) are compiled once for plain x86-64, except each level's
micro-kernels (microkernels_<level>.cc, and paged_attention.cc once per level), compiled with that
level's flags alone and chosen at run time (isa.h): one build serves every x86-64 CPU. A new level's
file (microkernels_amx.cc) is picked up by its name. Each op library is its registration files
compiled for plain x86-64 and linked with those objects. Idempotent: a library whose sources, flags
(and for OpenVINO, release) are unchanged is left as it is. No compiler, or a failed compile, leave no
library, and the message says what builds do without it; nothing else needs one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

KERNELS = Path(__file__).resolve().parent
OUT_DIR = KERNELS / "_build"
# Each level's flags: the same flags as kiln/contract/cpu.py's ISA_LEVELS (isa.h), each level adding
# to the one below.
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {"scalar": ()}
LEVEL_FLAGS["avx2"] = (*LEVEL_FLAGS["scalar"], "-mavx2", "-mfma", "-mf16c")
LEVEL_FLAGS["avx512"] = (*LEVEL_FLAGS["avx2"], "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
LEVEL_FLAGS["avx512vnni"] = (*LEVEL_FLAGS["avx512"], "-mavx512vnni")
LEVEL_FLAGS["amx"] = (*LEVEL_FLAGS["avx512vnni"], "-mamx-tile", "-mamx-int8", "-mamx-bf16")
ATTENTION_LEVELS = {"scalar": "Scalar", "avx2": "Avx2", "avx512": "Avx512"}     # paged_attention.h's copies
BASELINE_SOURCES = ("isa.cc", "dispatch.cc")
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra")


@dataclass(frozen=True)
class Unit:
    """One object of the kernel library: a source, compiled with a level's flags and defines."""
    source: str
    level: str
    defines: tuple[str, ...] = ()

    @property
    def object(self) -> Path:
        stem = Path(self.source).stem       # a source compiled once per level is named per level
        return OUT_DIR / (f"{stem}_{self.level}.o" if self.defines else f"{stem}.o")

    def flags(self) -> tuple[str, ...]:
        return (*FLAGS, *LEVEL_FLAGS[self.level], *self.defines)


def kernel_units() -> list[Unit]:
    units = [Unit(s, "scalar") for s in BASELINE_SOURCES]
    for path in sorted(KERNELS.glob("microkernels_*.cc")):
        level = path.stem.removeprefix("microkernels_")
        if level not in LEVEL_FLAGS:
            raise ValueError(f"{path.name}: no level {level!r} (levels: {', '.join(LEVEL_FLAGS)})")
        units.append(Unit(path.name, level))
    units += [Unit("paged_attention.cc", level, (f"-DKILN_ATTEND_TASK=AttendTask{name}",))
              for level, name in ATTENTION_LEVELS.items()]
    units += [Unit("paged_kv_attention.cc", level, (f"-DKILN_ATTEND_KV=AttendKv{name}", f"-DKILN_STORE_TOKEN=StoreToken{name}"))
              for level, name in ATTENTION_LEVELS.items()]
    units.append(Unit("paged_kv_decode_vnni.cc", "avx512vnni"))  # installed by microkernels_avx512vnni.cc's table
    units.append(Unit("paged_kv_attention_amx.cc", "amx"))      # installed by microkernels_amx.cc's table
    return units


def kernel_files() -> list[Path]:
    return sorted({*KERNELS.glob("*.cc"), *KERNELS.glob("*.h")})


@dataclass(frozen=True)
class OpLibrary:
    """An op library: its registration sources, compiled for plain x86-64 and linked with the kernels."""
    title: str                        # "kiln's ONNX Runtime op library (kiln.MatMulQ4Min)"
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    library: Path
    flags: tuple[str, ...]            # the registration files' compile flags (include folders among them)
    link: tuple[str, ...] = ()        # what the link adds (the runtime's libraries)
    without: str = ""                 # what builds do without the library
    release: str = ""                 # a version the library's ABI follows (the hash takes it)

    @property
    def stamp(self) -> Path:
        return self.library.parent / "sources.sha256"

    def sources_hash(self) -> str:
        h = hashlib.sha256()
        for path in (*kernel_files(), *self.sources, *self.headers):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        for unit in kernel_units():
            h.update(" ".join(unit.flags()).encode())
        h.update(" ".join((*self.flags, *self.link, self.release)).encode())
        return h.hexdigest()

    def up_to_date(self) -> bool:
        return (self.library.is_file() and self.stamp.is_file()
                and self.stamp.read_text(encoding="utf-8").strip() == self.sources_hash())


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _run(cmd: list[str]) -> str | None:
    """None, or the compiler's complaint."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    return None if done.returncode == 0 else f"{' '.join(cmd)}\n{done.stderr}"


def _vague_symbols(obj: Path) -> list[str]:
    """The weak and unique symbols an object defines (an inline function or template the compiler
    kept a copy of). NOTE: the linker keeps one copy of each across all objects, so one a level's file
    defines could be the copy a plain x86-64 file calls: AVX-512 code on an AVX2 CPU. The per-level
    files therefore define none (they instantiate no std:: template, and take scratch from
    ScratchMemory)."""
    nm = shutil.which("nm")
    if nm is None:
        return []
    done = subprocess.run([nm, "--defined-only", "-C", str(obj)], capture_output=True, text=True)
    return [line.split(" ", 2)[2] for line in done.stdout.splitlines()
            if len(line.split(" ", 2)) == 3 and line.split(" ", 2)[1] in ("W", "V", "u")]


def _writable(folder: Path) -> bool:
    """Whether the build can write `folder` (or create it in its parent)."""
    return os.access(folder if folder.exists() else folder.parent, os.W_OK)


def build_kernels(cxx: str) -> tuple[list[Path], str | None]:
    """(the kernel objects, None) or ([], what failed). Compiled once for all op libraries: objects
    whose source, headers and flags are unchanged are kept."""
    OUT_DIR.mkdir(exist_ok=True)
    headers = b"".join(p.read_bytes() for p in sorted(KERNELS.glob("*.h")))
    units = kernel_units()

    def compile_one(unit: Unit) -> str | None:
        key = hashlib.sha256(headers + (KERNELS / unit.source).read_bytes() + " ".join((cxx, *unit.flags())).encode())
        stamp = unit.object.with_suffix(".sha256")
        if unit.object.is_file() and stamp.is_file() and stamp.read_text().strip() == key.hexdigest():
            return None
        failed = _run([cxx, *unit.flags(), "-c", str(KERNELS / unit.source), "-o", str(unit.object)])
        if failed:
            return failed
        vague = _vague_symbols(unit.object) if unit.level != "scalar" else []
        if vague:
            unit.object.unlink()
            return (f"{unit.source} ({unit.level}) defines weak symbols the linker could share with plain x86-64 "
                    f"code: {', '.join(vague[:8])}")
        stamp.write_text(key.hexdigest() + "\n")
        return None

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f for f in pool.map(compile_one, units) if f]
    return ([], failures[0]) if failures else ([u.object for u in units], None)


def build_library(lib: OpLibrary, compiler_path: str | None = None, force: bool = False) -> tuple[Path | None, str]:
    """(the library or None, what happened)."""
    if lib.up_to_date() and not force:
        return lib.library, f"{lib.library} is up to date"
    cxx = compiler_path or compiler()
    if cxx is None:
        return None, f"no C++ compiler (g++) found: {lib.without}"
    locked = [d for d in (OUT_DIR, lib.library.parent) if not _writable(d)]
    if locked:
        return None, (f"{locked[0]} is not writable (kiln is installed for another user): {lib.without}; "
                      "run the build as the user who installed kiln")
    objects, failed = build_kernels(cxx)
    lib.library.parent.mkdir(exist_ok=True)
    tmp = lib.library.with_suffix(".so.tmp")
    if failed is None:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            op_objects = [lib.library.parent / f"{s.stem}.o" for s in lib.sources]
            failures = [f for f in pool.map(lambda so: _run([cxx, *lib.flags, f"-I{KERNELS}", "-c", str(so[0]), "-o",
                                                            str(so[1])]), zip(lib.sources, op_objects)) if f]
        failed = failures[0] if failures else _run([cxx, "-shared", *map(str, op_objects), *map(str, objects),
                                                    *lib.link, "-o", str(tmp)])
        for obj in op_objects:
            obj.unlink(missing_ok=True)
    if failed is not None:
        tmp.unlink(missing_ok=True)
        return None, f"compiling {lib.title} failed ({lib.without}):\n{failed}"
    tmp.replace(lib.library)       # NOTE: atomic, so a loader never sees half a library
    lib.stamp.write_text(lib.sources_hash() + "\n")
    return lib.library, f"built {lib.library}"


# ---- the two op libraries ----------------------------------------------------------------------------

ORT_NATIVE = KERNELS.parent / "engines" / "ort" / "native"
OPENVINO_NATIVE = KERNELS.parent / "engines" / "openvino" / "native"
# What a machine without each library runs instead: said by every build that leaves one out.
ORT_WITHOUT = ("ort builds run ONNX Runtime's own kernels instead of kiln.MatMulQ4Min, kiln.MatMulQ8 and "
               "kiln.PagedAttention (int8 and int4 linears on MatMulNBits, attention as a paged gather), int8 "
               "on an AVX2 CPU without AVX-512 goes to OpenVINO, and an artifact built with them does not load")
OPENVINO_WITHOUT = ("openvino int8 builds keep the plugin's own linears instead of kiln.LinearI8 (AVX-512 VNNI, AMX), "
                    "and an artifact built with them does not load")


def ort_library() -> OpLibrary:
    """kiln's ONNX Runtime custom-op library: g++ alone, since it declares the part of ONNX Runtime's C
    ABI it calls itself (ort_abi.h) and needs no ONNX Runtime headers (the onnxruntime wheel ships none)."""
    return OpLibrary(
        title="kiln's ONNX Runtime op library (kiln.MatMulQ4Min)",
        sources=(ORT_NATIVE / "linear_op.cc", ORT_NATIVE / "paged_attention_op.cc"),
        headers=(ORT_NATIVE / "ort_abi.h", ORT_NATIVE / "op_library.h"),
        library=ORT_NATIVE / "_build" / "libkiln_ort_ops.so",
        flags=FLAGS, without=ORT_WITHOUT)


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


def openvino_library() -> OpLibrary:
    """kiln's OpenVINO extension library: g++ against the headers and libraries the openvino wheel
    ships (openvino/include, openvino/libs). Raises ImportError / FileNotFoundError without them."""
    import openvino

    include, libs = openvino_dirs()
    return OpLibrary(
        title="kiln's OpenVINO op library",
        sources=(OPENVINO_NATIVE / "linear_i8_op.cpp", OPENVINO_NATIVE / "paged_attention_op.cpp"),
        headers=(OPENVINO_NATIVE / "paged_attention_op.h",),
        library=OPENVINO_NATIVE / "_build" / "libkiln_ov_ops.so",
        flags=("-O3", "-std=c++17", "-fPIC", "-DOV_THREAD=OV_THREAD_TBB", "-Wall", "-Wno-unused-parameter",
               f"-I{include}"),
        # the rpath: the openvino wheel beside this kiln in site-packages (a wheel built elsewhere), then
        # the one it was built against (a checkout)
        link=(f"-L{libs}", *(f"-l:{n}" for n in _runtime_libraries(libs)),
              "-Wl,-rpath,$ORIGIN/../../../../../openvino/libs", f"-Wl,-rpath,{libs}"),
        without=OPENVINO_WITHOUT, release=openvino.get_version())


def build_ort(compiler_path: str | None = None, force: bool = False) -> tuple[Path | None, str]:
    return build_library(ort_library(), compiler_path, force)


def build_openvino(compiler_path: str | None = None, force: bool = False) -> tuple[Path | None, str]:
    try:
        lib = openvino_library()
    except (ImportError, FileNotFoundError) as e:
        # e.g. an isolated package build, whose environment holds only setuptools
        return None, (f"the openvino wheel's headers or libraries are not in this environment ({e}): "
                      f"{OPENVINO_WITHOUT}; `python -m kiln.engines.openvino.native.build` builds it where "
                      "kiln and openvino are installed")
    return build_library(lib, compiler_path, force)


def main(argv: list[str] | None = None, builders=(build_ort, build_openvino)) -> int:
    force = "--force" in (sys.argv[1:] if argv is None else argv)
    for build in builders:
        print(build(force=force)[1])
    return 0      # a machine without a compiler keeps the runtimes' own ops: not an install failure


if __name__ == "__main__":
    raise SystemExit(main())
