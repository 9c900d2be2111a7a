"""kiln's build step for its op libraries; pyproject.toml holds everything else.

Building the package (`pip install .`, `pip wheel .`, `pip install -e .`) compiles kiln's op libraries
with kiln/kernels/build.py, the same code `python -m kiln.kernels.build` runs, where a C++ compiler is
found: the ONNX Runtime one always (g++ alone), the OpenVINO one where the build environment has the
openvino wheel (its headers and libraries; `--no-build-isolation` into an environment holding kiln's
dependencies). A library that cannot be built is left out and the build says what runs instead; the
sources ship either way, so `python -m kiln.engines.ort.native.build` works in any install later.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

SOURCE_ROOT = Path(__file__).resolve().parent


class OpLibrary(Extension):
    """One of kiln's op libraries. Its compile is kiln/kernels/build.py's `builder`: the kernels need
    per-file instruction-set flags, which setuptools' compiler step does not express."""

    def __init__(self, name: str, builder: str):
        super().__init__(name, sources=[])
        self.builder = builder


def _kernels_build(package_root: Path):
    """kiln/kernels/build.py of the tree being built, loaded by path: the build environment has no kiln
    to import, and the module uses the standard library alone."""
    spec = importlib.util.spec_from_file_location("_kiln_kernels_build", package_root / "kiln" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look up their defining module
    spec.loader.exec_module(module)
    return module


class BuildOpLibraries(build_ext):
    """Compiles the op libraries into the tree the install takes: build/lib for a wheel (build_py has
    copied the sources there), the source tree for an editable install."""

    def run(self) -> None:
        root = SOURCE_ROOT if self.inplace else Path(self.build_lib)
        build = _kernels_build(root)
        for library in self.extensions:
            print(f"kiln: {getattr(build, library.builder)()[1]}")
        if not self.inplace:
            # the kernel objects serve incremental rebuilds only; a wheel ships the linked libraries
            shutil.rmtree(root / "kiln" / "kernels" / "_build", ignore_errors=True)

    def _libraries(self) -> list[Path]:
        root = SOURCE_ROOT if self.inplace else Path(self.build_lib)
        return [p for p in root.glob("kiln/engines/*/native/_build/*") if p.is_file()]

    def get_outputs(self) -> list[str]:
        return [str(p) for p in self._libraries()]

    def get_output_mapping(self) -> dict[str, str]:
        return {}       # built where they are used: nothing to copy into the source tree


class PlatformWheel(bdist_wheel):
    """The op libraries are plain shared objects, not Python extension modules: the wheel is tied to
    the platform (the CPU architecture), not to one Python version."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


setup(
    ext_modules=[OpLibrary("kiln.engines.ort.native._build.libkiln_ort_ops", "build_ort"),
                 OpLibrary("kiln.engines.openvino.native._build.libkiln_ov_ops", "build_openvino")],
    cmdclass={"build_ext": BuildOpLibraries, "bdist_wheel": PlatformWheel},
)
