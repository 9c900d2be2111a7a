"""Build kiln's ONNX Runtime custom-op library (kiln.MatMulQ4Min, kiln.MatMulQ8, kiln.PagedAttention)
into _build/ beside this file, with the kernel library it compiles in (kiln/kernels/build.py does both).

    python -m kiln.engines.ort.native.build          # scripts/setup.sh runs it; idempotent

No compiler or a failed compile leave no library: kiln then builds int4 without the kernel
(MatMulNBits only) and says so; nothing else needs it.
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
