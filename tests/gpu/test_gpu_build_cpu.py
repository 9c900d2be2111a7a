"""The GPU backends' build and load on a machine without a GPU: what can be built is built and
checked (the ort-cuda artifact, the tensorrt graph and its profiles), what needs the GPU is refused
with what to do, and nothing half-built is left behind."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
from click.testing import CliRunner

from kiln.contract.backends import get_backend
from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.cli import main
from kiln.config import BuildConfig
from kiln.engines.load import load_engine
from kiln.engines.gpu.device import cuda_device_count

pytestmark = pytest.mark.skipif(cuda_device_count() > 0, reason="checks the refusals of a machine without a GPU")


def _build(tmp_path, *args):
    out = tmp_path / "artifact"
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(out), *args])
    return res, out


def test_ort_cuda_artifact_builds_on_a_cpu_and_says_what_did_not_run(tmp_path):
    res, out = _build(tmp_path, "--backend", "ort-cuda", "--quant", "int4")
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["engines"][0]
    assert record["backend"] == "ort-cuda" and record["file"] == "engines/ort-cuda/model.onnx"
    assert record["checks"][0]["passed"] and "no CUDA GPU" in record["compare"]["skipped"]
    assert manifest["kv_layout"]["dtype"] == "float16"
    assert manifest["kv_layout"]["block_bytes"] == 2 * 2 * 2 * 16 * 2 * 16      # L, k/v, kvh, hd, fp16, block
    with pytest.raises(ArtifactError, match="needs a CUDA GPU; this machine has none; run it on a machine"):
        load_engine(EngineArtifact.load(out))
    res = CliRunner().invoke(main, ["inspect", str(out)])
    assert res.exit_code == 0 and "engines/ort-cuda/model.onnx" in res.output


def test_ort_cuda_refuses_fp32(tmp_path):
    res, out = _build(tmp_path, "--backend", "ort-cuda", "--precision", "fp32")
    assert res.exit_code == 1 and "PagedAttention has no fp32 kernel" in res.output
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    ([], "build with --no-fuse"),
    (["--no-fuse", "--quant", "int8"], "has no int8 mode; it builds --quant none | int4"),
    (["--no-fuse"], "pass --kv-cache-memory"),
    (["--no-fuse", "--kv-cache-memory", "64MiB"], "needs a CUDA GPU"),
])
def test_tensorrt_build_refuses_without_a_gpu_and_leaves_nothing(tmp_path, args, message):
    res, out = _build(tmp_path, "--backend", "tensorrt", *args)
    assert res.exit_code == 1 and message in " ".join(res.output.split())
    assert not out.exists() and not list(tmp_path.glob(".artifact.building-*"))


@pytest.mark.parametrize("precision, quant", [("fp16", "none"), ("fp32", "none"), ("fp16", "int4")])
def test_tensorrt_graph_and_profiles_are_prepared_on_a_cpu(tmp_path, precision, quant):
    """The CPU half of a tensorrt build: kv_io graph in the precision (int4: block-quantized
    DequantizeLinear), the file TensorRT parses, profiles per bucket range, and the Polygraphy
    check of that file against kiln's graph on ONNX Runtime CPU."""
    import onnx

    from kiln.compiler.backends.tensorrt.build import check_graph_for_tensorrt, prepare_graph
    from kiln.compiler.export.decoder_graph import build_decoder
    from kiln.compiler.export.sources import load_source
    from kiln.contract.quant import QuantMode
    from kiln.compiler.passes.quantize import QuantizePass
    from kiln.compiler.plan import BuildHost
    from kiln.compiler.recipes import quant_recipe

    src = load_source("tiny-llama")
    recipe = quant_recipe(get_backend("tensorrt"), QuantMode(quant), src.spec, BuildHost.probe())  # as the build's plan
    model = QuantizePass.for_recipe(recipe).run(build_decoder(src.spec, src.weights))
    config = BuildConfig(source="tiny-llama", out=tmp_path / "unused", fuse=False, precision=precision,
                         quant=QuantMode(quant), kv_cache_memory=64 << 20)
    check_graph_for_tensorrt(model, config)
    prepared = prepare_graph(model, src.spec, config, tmp_path, lambda name: nullcontext())
    graph = onnx.load(prepared.onnx_path)
    onnx.checker.check_model(graph)
    assert not [n.op_type for n in graph.graph.node if n.domain or not onnx.defs.has(n.op_type)]
    halves = sum(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.graph.initializer)
    assert (halves > 0) == (precision == "fp16")
    types = [t.data_type for t in graph.graph.initializer]
    dequantize = sum(n.op_type == "DequantizeLinear" for n in graph.graph.node)
    int4 = types.count(onnx.TensorProto.INT4)           # signed weights only: TensorRT has no UINT4
    assert (int4, dequantize) == ((14, 14) if quant == "int4" else (0, 0))     # 7 linears x 2 layers
    assert onnx.TensorProto.UINT4 not in types
    assert prepared.record["precision"] == precision and prepared.record["weight_quant"]["quant"] == quant
    assert [p["name"] for p in prepared.record["profiles"]][:3] == ["decode-b1-4", "decode-b6-24", "decode-b28-64"]
    block_bytes = 2 * 2 * 2 * 16 * 16 * (2 if precision == "fp16" else 4)    # L, k/v, kvh, block, hd, dtype
    assert {tuple(p["dims"]["num_blocks"]) for p in prepared.record["profiles"]} == {
        (1, (64 << 20) // block_bytes, (64 << 20) // block_bytes)}
    assert set(prepared.inputs) >= {"input_ids", "block_tables", "key_cache.0"}
    reports = {r["name"]: r for r in prepared.reports}
    if precision == "fp32" and quant == "none":
        assert list(reports) == ["kv_io"]
        return
    report = reports[f"compare ort-cpu tensorrt graph ({precision}) vs ort-cpu kiln graph"]
    compare = report["details"]              # the Polygraphy comparison, in pass-report form
    assert compare["passed"] and 0 < compare["outputs"]["logits"]["max_abs_error"] < 5e-2
    assert report["max_abs_error"] == compare["outputs"]["logits"]["max_abs_error"]
    assert report["nodes_before"] == report["nodes_after"] > 0


def test_a_tensorrt_artifact_is_refused_on_a_machine_without_a_gpu(tiny_llama_artifact, tmp_path):
    import shutil

    copy = tmp_path / "trt"
    shutil.copytree(tiny_llama_artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["engines"][0]["backend"] = "tensorrt"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="holds a TensorRT engine, which needs a CUDA GPU; this machine has none"):
        load_engine(EngineArtifact.load(copy))


def test_the_tensorrt_pool_is_what_kv_cache_memory_holds():
    from kiln.compiler.backends.tensorrt.build import pool_blocks
    from kiln.compiler.export.sources import load_source

    spec = load_source("tiny-llama").spec
    config = BuildConfig(source="tiny-llama", out=None, fuse=False, kv_cache_memory=64 << 20)
    assert pool_blocks(spec, config) == (64 << 20) // (2 * 2 * 2 * 16 * 16 * 2)     # fp16 blocks
    with pytest.raises(ValueError, match="pass --kv-cache-memory"):
        pool_blocks(spec, BuildConfig(source="tiny-llama", out=None, fuse=False))
    with pytest.raises(ValueError, match="more than TensorRT indexes in one layer's cache"):
        pool_blocks(spec, BuildConfig(source="tiny-llama", out=None, fuse=False, kv_cache_memory=1 << 45))
