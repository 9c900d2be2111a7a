"""kiln's kernel library (kiln/kernels/) as a whole: one probe of the CPU, the same as Python's, one
cap (KILN_MAX_ISA) for both; each level's micro-kernels found by their file's name and compiled with
that level's flags; and no level's code the linker could hand to another."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kiln.contract.cpu import ISA_LEVELS
from kiln.kernels import build as kernels_build




def levels_seen(max_isa: str | None) -> dict:
    """(the library's level, the Python probe's) in a fresh process with KILN_MAX_ISA as given."""
    env = {k: v for k, v in os.environ.items() if k != "KILN_MAX_ISA"}
    if max_isa is not None:
        env["KILN_MAX_ISA"] = max_isa
    code = ("import json; from kiln.contract.cpu import host; from kiln.engines.ort import native; "
            "print(json.dumps({'library': native.isa(), 'python': host().isa}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("max_isa", [None, *ISA_LEVELS])
def test_the_library_level_is_the_python_probes_capped_alike(library, max_isa):
    seen = levels_seen(max_isa)
    assert seen["library"] == seen["python"]
    if max_isa is not None:
        levels = list(ISA_LEVELS)
        assert levels.index(seen["library"]) <= levels.index(max_isa)


def test_the_levels_are_pythons_and_each_adds_to_the_one_below():
    assert list(kernels_build.LEVEL_FLAGS) == list(ISA_LEVELS)
    flags = list(kernels_build.LEVEL_FLAGS.values())
    assert all(set(lower) < set(higher) for lower, higher in zip(flags, flags[1:]))


def test_a_levels_micro_kernels_are_one_file_found_by_its_name(tmp_path, monkeypatch):
    """An AMX micro-kernel file is picked up, compiled with the amx flags, with nothing else to change."""
    for path in kernels_build.KERNELS.iterdir():
        if path.suffix in (".cc", ".h"):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "microkernels_amx.cc").write_text('#include "kernels.h"\nvoid kiln::AmxKernels(Kernels*) {}\n')
    monkeypatch.setattr(kernels_build, "KERNELS", tmp_path)
    units = {u.source: u for u in kernels_build.kernel_units()}
    assert units["microkernels_amx.cc"].flags()[-3:] == ("-mamx-tile", "-mamx-int8", "-mamx-bf16")
    assert {u.level for u in units.values() if u.source.startswith("microkernels_")} == {
        "scalar", "avx2", "avx512vnni", "amx"}
    (tmp_path / "microkernels_sse4.cc").write_text("")
    with pytest.raises(ValueError, match="no level 'sse4'"):
        kernels_build.kernel_units()


def test_the_weak_symbol_check_sees_an_inline_copy(tmp_path):
    """A level's object that kept a copy of an inline function is what the build refuses (the linker
    could give that copy to code built for a lower level)."""
    cxx = kernels_build.compiler()
    if cxx is None or kernels_build.shutil.which("nm") is None:
        pytest.skip("no compiler or nm")
    source = tmp_path / "a.cc"
    source.write_text("inline int twice(int x) { return 2 * x; }\nint (*use)(int) = twice;\n")
    subprocess.run([cxx, "-O2", "-c", str(source), "-o", str(tmp_path / "a.o")], check=True)
    assert any("twice" in s for s in kernels_build._vague_symbols(tmp_path / "a.o"))


def test_avx512_without_vnni_runs_the_avx2_linears(library, monkeypatch):
    """The avx512 level has no int8 micro-kernels of its own (vpdpbusd is the avx512vnni level's):
    its MatMulQ4Min / MatMulQ8 results are the avx2 level's, bit for bit."""
    from test_q4_1_q8_0_kernels import session

    from kiln.compiler.passes.q4min_linear import pack_tiles, pack_tiles_q8, q4min_blocks, q8_blocks
    from kiln.engines.ort import native

    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.05, (96, 40)).astype(np.float32)
    x = rng.normal(0, 1, (1, 5, 96)).astype(np.float32)
    results = {}
    for level in ("avx2", "avx512"):
        monkeypatch.setenv("KILN_MAX_ISA", level)
        if native.isa() != level:
            pytest.skip(f"this CPU does not run the {level} level")
        results[level] = [session(96, 40, pack_tiles(q4min_blocks(w))).run(None, {"x": x})[0],
                          session(96, 40, pack_tiles_q8(q8_blocks(w)), op_type=native.OP_TYPE_Q8).run(None, {"x": x})[0]]
    for a, b in zip(results["avx2"], results["avx512"]):
        np.testing.assert_array_equal(a, b)
