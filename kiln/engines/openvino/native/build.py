"""Build kiln's OpenVINO extension library (kiln.LinearI8, kiln.GateUpI8) into _build/ beside this
file, with the kernel library it compiles in (kiln/kernels/build.py does both).

    python -m kiln.engines.openvino.native.build          # scripts/setup.sh runs it; idempotent

g++ against the headers and libraries the openvino wheel ships. The registration file is compiled for
plain x86-64, so the library loads anywhere and only runs its kernels where a build chose them
(kiln/engines/openvino/native). No compiler, or a failed compile, leave no library: openvino int8
builds then keep the plugin's own linears, and say so.
"""

from __future__ import annotations

from kiln.kernels.build import build_openvino as build
from kiln.kernels.build import main as build_main

__all__ = ["build", "main"]


def main(argv: list[str] | None = None) -> int:
    return build_main(argv, builders=(build,))


if __name__ == "__main__":
    raise SystemExit(main())
