"""Build kiln's ONNX Runtime custom-op library (kiln.MatMulQ4Min, kiln.MatMulQ8, kiln.PagedAttention)
into _build/ beside this file, with the kernel library it compiles in (kiln/kernels/build.py does both).

    python -m kiln.engines.ort.native.build          # scripts/setup.sh runs it; idempotent

Installing kiln (a wheel, `pip install .`, `pip install -e .`) runs the same build (setup.py) where a
C++ compiler is found, and ships the sources, so this command also works in an installed kiln. No
compiler or a failed compile leave no library: ort builds then run ONNX Runtime's own kernels and say
so (kiln.kernels.build.ORT_WITHOUT); an artifact built on kiln's ops does not load.
"""

from __future__ import annotations

from kiln.kernels.build import build_ort as build
from kiln.kernels.build import main as build_main
from kiln.kernels.build import ort_library

LIBRARY = ort_library().library

__all__ = ["LIBRARY", "build", "main"]


def main(argv: list[str] | None = None) -> int:
    return build_main(argv, builders=(build,))


if __name__ == "__main__":
    raise SystemExit(main())
