"""The q4min INT4 recipe (every linear but the LM head on kiln.MatMulQ4Min, the head on kiln.MatMulQ8)
and the INT8 recipe (every linear on kiln.MatMulQ8) on the tiny presets: the graph they make, its check against fp32, an artifact built with it, and the paths without the op
library (the build falls back and says so; such an artifact refuses to load with what to run)."""

from __future__ import annotations

import pytest

from kiln.compiler.build import build
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.passes.base import run_pass
from kiln.compiler.passes.quant_recipe import recipe_settings
from kiln.compiler.passes.quantize import MIN_TOP1, QuantizePass
from kiln.compiler.passes.quant_settings import Q8_ACCURACY_LEVELS, QuantSettings
from kiln.compiler.plan import BuildHost
from kiln.compiler.recipes import q8_activations, quant_recipe
from kiln.compiler.passes.verify_quant import QuantCheck, check_token_ids
from kiln.config import BuildConfig
from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.contract.backends import get_backend
from kiln.contract.quant import QuantMode
from kiln.engines.ort import native
from kiln.engines.ort.native.build import build as build_library


@pytest.fixture(scope="module", autouse=True)
def library():
    path, message = build_library()
    if path is None:
        pytest.skip(message)


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "absent.so")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_every_linear_but_the_head_runs_on_the_kernel(tiny_sources, name):
    src = tiny_sources[name]
    model = build_decoder(src.spec, src.weights)
    settings = recipe_settings(quant_recipe(get_backend("ort"), QuantMode.INT4, src.spec, BuildHost.probe()))
    assert settings == QuantSettings(QuantMode.INT4, int4_rounding="q4min", int8_linears=(), head_kernel="q8")
    check = QuantCheck("quantize", check_token_ids(src.tokenizer_dir, 512), MIN_TOP1[QuantMode.INT4])
    out, report = run_pass(QuantizePass(settings), model, check)
    kernel = [n for n in out.graph.node if n.op_type == native.OP_TYPE]
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in
               {t.name for t in model.graph.initializer}]
    assert len(kernel) == len(matmuls) - 1 and all(n.domain == native.OP_DOMAIN for n in kernel)
    head = [n for n in out.graph.node if n.op_type == native.OP_TYPE_Q8]
    assert len(head) == 1
    assert report.details["matmuls_by_bits"] == {4: len(kernel), 8: 1}          # the head 8-bit
    assert report.details["lm_head"] == "MatMulQ8 8-bit"
    assert "GatherBlockQuantized 8-bit" in report.details["embedding"]          # a table of its own
    assert any(o.domain == native.OP_DOMAIN for o in out.opset_import)
    assert report.details["top1_agreement"] >= MIN_TOP1[QuantMode.INT4]       # the check ran it through ORT


def test_int8_puts_every_linear_and_the_head_on_the_q8_kernel(tiny_sources):
    src = tiny_sources["tiny-llama"]
    model = build_decoder(src.spec, src.weights)
    host = BuildHost.probe()
    recipe = quant_recipe(get_backend("ort"), QuantMode.INT8, src.spec, host)
    settings = recipe_settings(recipe)
    activations = "int8" if host.cpu.isa in ("avx512vnni", "amx") else "int16"    # what the CPU multiplies fastest
    assert q8_activations(host.cpu) == activations
    assert settings == QuantSettings(QuantMode.INT8, int8_kernel="q8", head_kernel="q8", q8_activations=activations)
    check = QuantCheck("quantize", check_token_ids(src.tokenizer_dir, 512), MIN_TOP1[QuantMode.INT8])
    out, report = run_pass(QuantizePass(settings), model, check)
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in
               {t.name for t in model.graph.initializer}]
    kernel = [n for n in out.graph.node if n.op_type == native.OP_TYPE_Q8]
    assert len(kernel) == len(matmuls) and not [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert report.details["matmuls_by_bits"] == {8: len(kernel)}
    levels = {a.i for n in kernel for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {Q8_ACCURACY_LEVELS[activations]} and report.details["q8_activations"] == activations
    assert report.details["lm_head"] == "MatMulQ8 8-bit"
    assert report.details["top1_agreement"] >= MIN_TOP1[QuantMode.INT8]       # the check ran it through ORT
    assert f"MatMulQ8 kernel with {activations} activations" in recipe.note
    openvino = quant_recipe(get_backend("openvino"), QuantMode.INT8, src.spec, host)
    assert openvino.applied_by == "backend" and not openvino.note           # openvino compresses its own weights


def test_an_artifact_records_the_op_and_refuses_to_load_without_the_library(tmp_path, monkeypatch):
    from kiln import LLM, RuntimeConfig, SamplingParams

    art = build(BuildConfig(source="tiny-llama", out=tmp_path / "a", quant=QuantMode.INT4, backend="ort"))
    record = EngineArtifact.load(art).manifest.engines[0]
    assert record["native_ops"] == ["kiln.MatMulQ4Min", "kiln.MatMulQ8", "kiln.PagedAttention"]
    out = LLM(art, RuntimeConfig(kv_cache_memory=16 << 20)).generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "absent.so")
    with pytest.raises(ArtifactError, match=r"kiln\.MatMulQ4Min, kiln\.MatMulQ8, kiln\.PagedAttention.*python -m kiln\.engines\.ort\.native\.build"):
        LLM(art, RuntimeConfig(kv_cache_memory=16 << 20))


def test_without_the_library_the_build_keeps_matmul_nbits_and_says_so(no_library, tmp_path, tiny_sources):
    backend, spec, host = get_backend("ort"), tiny_sources["tiny-llama"].spec, BuildHost.probe()
    int4, int8 = (quant_recipe(backend, mode, spec, host) for mode in (QuantMode.INT4, QuantMode.INT8))
    assert recipe_settings(int4) == QuantSettings(QuantMode.INT4)      # the mode's defaults
    assert recipe_settings(int8) == QuantSettings(QuantMode.INT8)
    assert native.BUILD_COMMAND in int4.note and native.BUILD_COMMAND in int8.note
    stages = []

    def stage(name):
        stages.append(name)
        from contextlib import nullcontext
        return nullcontext()
    art = build(BuildConfig(source="tiny-llama", out=tmp_path / "a", quant=QuantMode.INT4, backend="ort"), stage)
    assert any("MatMulNBits" in s and native.BUILD_COMMAND in s for s in stages)
    manifest = EngineArtifact.load(art).manifest
    assert "native_ops" not in manifest.engines[0] and manifest.quant["int4_rounding"] == "search"
    assert manifest.choices["attention"]["value"] == "standard"       # kiln's PagedAttention needs the library too
