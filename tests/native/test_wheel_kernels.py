"""kiln's package carries its kernels: a wheel built from this tree holds every C++ source of the op
libraries (so `python -m kiln.engines.ort.native.build` works in an installed kiln) and, where a C++
compiler is found, the ONNX Runtime op library built, which loads from the wheel's files alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.contract.cpu import ISA_LEVELS
from kiln.kernels.build import compiler

ROOT = Path(__file__).resolve().parents[2]
NATIVE_SUFFIXES = (".cc", ".cpp", ".h")


def native_sources() -> set[str]:
    """The op libraries' sources in this checkout, as paths inside the package."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "kiln").rglob("*")
            if p.suffix in NATIVE_SUFFIXES and "_build" not in p.parts}


BUILD_LINES: list[str] = []          # what the package build said of the op libraries


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of a copy of this tree (the checkout's own build/ and _build/ folders untouched), built as
    `pip wheel` builds it; without build isolation, so it needs nothing from an index."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "kiln", tree / "kiln", ignore=shutil.ignore_patterns("_build", "__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "-w", str(out), "--no-deps",
                           "--no-build-isolation", "-v"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    BUILD_LINES[:] = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("kiln:")]
    (built,) = out.glob("kiln-*.whl")
    return built


def test_the_wheel_carries_the_op_libraries_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert native_sources() and native_sources() <= names, sorted(native_sources() - names)
    assert "kiln/kernels/build.py" in names
    assert not [n for n in names if n.endswith(".o")], "kernel objects are build leftovers, not package files"
    # plain shared objects, not extension modules: any Python 3 on this platform
    assert wheel.name.startswith("kiln-") and "-py3-none-" in wheel.name


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler: the wheel carries the sources only")
def test_the_wheel_ships_the_ort_op_library_built_and_it_loads(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kiln/engines/ort/native/_build/libkiln_ort_ops.so" in names, "\n".join(BUILD_LINES)
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = ("from kiln.engines.ort import native; import kiln; "
            "assert kiln.__file__.startswith(%r), kiln.__file__; print(native.isa())" % str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ISA_LEVELS
    # the documented build command finds the library built and its sources unchanged
    done = subprocess.run([sys.executable, "-m", "kiln.engines.ort.native.build"], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "is up to date" in done.stdout, done.stdout + done.stderr
