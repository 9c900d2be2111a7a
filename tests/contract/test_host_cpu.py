"""One probe of the host CPU: its classes, and KILN_MAX_ISA lowering what a CPU does."""

from __future__ import annotations

import pytest

from kiln.contract.cpu import ISA_LEVELS, describe, read_flags

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
EPYC = AVX512 | {"avx512_vnni", "avx512_bf16"}
XEON_AMX = EPYC | {"amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("flags, cpu_class, vnni", [
    (set(), "other", False), (AVX2, "avx2", False), (AVX512, "avx512", False),
    (EPYC, "avx512-vnni", True), (XEON_AMX, "amx", True), (AVX2 | {"avx_vnni"}, "avx2", True)])
def test_each_cpu_class_is_told_apart(flags, cpu_class, vnni):
    cpu = describe(frozenset(flags))
    assert (cpu.cpu_class, cpu.vnni) == (cpu_class, vnni)


@pytest.mark.parametrize("cap, cpu_class", [("amx", "amx"), ("avx512vnni", "avx512-vnni"), ("avx512", "avx512"),
                                            ("avx2", "avx2"), ("scalar", "other")])
def test_the_cap_hides_every_level_above_it(cap, cpu_class):
    cpu = describe(frozenset(XEON_AMX), max_isa=cap)
    assert cpu.cpu_class == cpu_class
    assert (cpu.vnni is True) == (cap in ("avx512vnni", "amx"))


def test_the_cap_never_adds_what_the_cpu_lacks():
    assert describe(frozenset(AVX2), max_isa="amx").cpu_class == "avx2"


def test_a_misspelled_cap_is_refused_with_the_levels():
    with pytest.raises(ValueError, match="avx512vnni"):
        describe(frozenset(AVX2), max_isa="avx-512")


def test_unknown_flags_assume_nothing(tmp_path):
    assert read_flags(tmp_path / "missing") is None
    cpu = describe(None)
    assert (cpu.cpu_class, cpu.vnni, cpu.has("avx2")) == ("other", None, False)


def test_cpuinfo_is_read_from_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu avx2 fma f16c\n\nprocessor : 1\nflags : fpu\n")
    assert read_flags(info) == {"fpu", "avx2", "fma", "f16c"}
    assert list(ISA_LEVELS)[0] == "scalar"
