"""--backend auto / --quant auto: the choice rules, on model specs (no build)."""

from __future__ import annotations

import dataclasses
import importlib.util
import platform

import pytest

from kiln.compiler import defaults
from kiln.compiler.defaults import choose_backend, choose_quant, parameter_count
from kiln.contract.model_spec import ModelSpec
from kiln.contract.quant import QuantMode

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None


def spec(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> ModelSpec:
    return ModelSpec("llama", vocab, hidden, layers, heads, kv_heads, hidden // heads, intermediate, 1e-5, 1e4,
                     2048, tie_word_embeddings=True, attention_bias=False)


def preset_spec(name: str) -> ModelSpec:
    return {"smollm2-135m": spec(576, 30, 9, 3, 1536, 49152), "tiny-llama": spec(64, 2, 4, 2, 128, 256)}[name]


@pytest.fixture
def smollm2():
    return preset_spec("smollm2-135m")


def test_parameter_count_of_smollm2_is_its_135m(smollm2):
    assert 134e6 < parameter_count(smollm2) < 136e6


def test_quant_auto_is_int8_for_a_real_model_and_fp32_for_a_tiny_one(smollm2):
    assert choose_quant(None, smollm2).value == "int8"
    assert choose_quant(None, preset_spec("tiny-llama")).value == "none"
    assert choose_quant(QuantMode.INT4, smollm2).chosen_by == "user"


@pytest.mark.skipif(not HAS_OPENVINO or platform.machine().lower() not in defaults.X86, reason="needs openvino on x86")
def test_backend_auto_picks_openvino_for_int8_where_it_covers_the_model(smollm2, monkeypatch):
    monkeypatch.setattr(defaults, "kiln_int8_is_faster_here", lambda: False)     # a CPU with AVX-512 or VNNI
    assert choose_backend("auto", QuantMode.INT8, smollm2).value == "openvino"
    assert choose_backend("auto", QuantMode.INT4, smollm2).value == "ort"      # ort measured faster at int4
    assert choose_backend("auto", QuantMode.W8A8, smollm2).value == "ort"      # only ort builds w8a8


@pytest.mark.skipif(not HAS_OPENVINO or platform.machine().lower() not in defaults.X86, reason="needs openvino on x86")
def test_backend_auto_picks_kilns_int8_kernel_on_an_avx2_cpu_without_vnni(smollm2, monkeypatch):
    monkeypatch.setattr(defaults, "kiln_int8_is_faster_here", lambda: True)
    choice = choose_backend("auto", QuantMode.INT8, smollm2)
    assert choice.value == "ort" and "MatMulQ8" in choice.reason and "neither AVX-512 nor VNNI" in choice.reason


@pytest.mark.parametrize("flags,faster", [({"avx2", "fma"}, True), ({"avx2", "fma", "avx512f"}, False),
                                          ({"avx2", "fma", "avx_vnni"}, False), ({"sse4_2"}, False), (set(), False)])
def test_which_cpus_run_int8_fastest_on_kilns_kernel(flags, faster, monkeypatch):
    from kiln.engines.ort import native

    monkeypatch.setattr(native, "available", lambda: True)
    assert defaults.kiln_int8_is_faster_here(flags) is faster
    monkeypatch.setattr(native, "available", lambda: False)                      # no op library: no kernel
    assert defaults.kiln_int8_is_faster_here(flags) is False


def test_backend_auto_falls_back_to_ort_and_says_why(smollm2, monkeypatch):
    windowed = dataclasses.replace(smollm2, sliding_window=4096)
    monkeypatch.setattr("kiln.compiler.backends.openvino.coverage.uncovered", lambda spec: "sliding-window attention")
    choice = choose_backend("auto", QuantMode.INT8, windowed)
    assert choice.value == "ort" and "sliding-window" in choice.reason
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert "only on x86" in choose_backend("auto", QuantMode.INT8, smollm2).reason


def test_ort_only_options_narrow_auto_to_ort(smollm2):
    choice = choose_backend("auto", QuantMode.INT8, smollm2, ort_options=("kv_dtype",))
    assert choice.value == "ort" and "--kv-dtype" in choice.reason


def test_an_explicit_backend_wins(smollm2):
    choice = choose_backend("ort", QuantMode.INT8, smollm2)
    assert (choice.value, choice.chosen_by) == ("ort", "user")


def test_quant_auto_respects_a_named_backends_modes(smollm2):
    """tensorrt has no int8 weight-only path: auto gives it unquantized weights, not a refusal."""
    choice = choose_quant(None, smollm2, backend_modes=("none", "int4"))
    assert choice.value == "none" and "no int8" in choice.reason


def test_auto_attention_is_kilns_op_on_ort_where_the_library_is_built(monkeypatch):
    from kiln.compiler.defaults import choose_attention
    from kiln.engines.ort import native

    monkeypatch.setattr(native, "available", lambda: True)
    assert choose_attention("auto", "ort", "float32").value == "native"
    narrow = choose_attention("auto", "ort", "float16")
    assert narrow.value == "standard" and "fp32" in narrow.reason
    assert choose_attention("gqa", "ort", "float32").to_dict() == {"value": "gqa", "chosen_by": "user",
                                                                   "reason": "--attention gqa"}
    assert choose_attention("auto", "openvino", "float32").value == "auto"      # not an ort engine
    monkeypatch.setattr(native, "available", lambda: False)
    missing = choose_attention("auto", "ort", "float32")
    assert missing.value == "standard" and native.BUILD_COMMAND in missing.reason
