"""The build pipeline: export -> passes -> engines -> artifact, as a short sequence of stages."""

from __future__ import annotations

import hashlib
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ContextManager

import onnx

from kiln.artifact import TOKENIZER_DIR, ArtifactWriter, Manifest, current_versions, file_record
from kiln.config import BuildConfig
from kiln.engines.base import KvLayout
from kiln.engines.ort_compile import compile_ort
from kiln.export.decoder_graph import build_decoder
from kiln.export.sources import ModelSource, load_source
from kiln.export.spec import ModelSpec
from kiln.passes.base import run_pass
from kiln.passes.kv_io import KvIoPass
from kiln.passes.quantize import QuantMode, QuantizePass
from kiln.passes.verify import compare_logits
from kiln.passes.verify_paged import compare_paged
from kiln.tokenizer import TEMPLATE_FILE, Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", TEMPLATE_FILE)
StageFn = Callable[[str], ContextManager]


def build(config: BuildConfig, stage: StageFn = lambda name: nullcontext()) -> Path:
    """Build an artifact folder; `stage(name)` wraps each stage (progress display, timing)."""
    engine_builder = _engine_builder(config.backend)
    _refuse_unbuildable(config)
    with ArtifactWriter(config.out, config.force) as writer:
        with stage("load model source"):
            src = load_source(config.source)
        with stage("export ONNX decoder graph"):
            model = build_decoder(src.spec, src.weights, _weights_workdir(writer))
        reports = []
        unquantized = model
        for p, check in _passes(src, config):
            if p.name == "quantize":
                unquantized = model
            with stage(f"pass {p.name}"):
                model, report = run_pass(p, model, check if config.verify else None)
                reports.append(report.to_dict())
        built = engine_builder(model, src.spec, config, writer.tmp, stage)
        if _engine_quantizes(config) and config.verify:
            with stage("check the engine's quantization"):
                reports.append(_check_engine_quant(built, model, src, config, writer.tmp).to_dict())
        if config.prefill_engine:
            built = _add_prefill_engine(built, unquantized, src, config, writer.tmp, stage)
        reports += built.pass_reports
        with stage("write artifact"):
            tokenizer = _copy_tokenizer(src, writer.tmp / TOKENIZER_DIR)
            manifest = Manifest(
                spec=src.spec, quant=_quant_record(config, reports), buckets=config.buckets,
                kv_layout=built.kv_layout, engines=built.engines,
                generation=_generation_defaults(src, writer.tmp / TOKENIZER_DIR),
                tokenizer=tokenizer, passes=reports, source=src.description, versions=current_versions())
            shutil.rmtree(_weights_workdir(writer), ignore_errors=True)
            return writer.commit(manifest)


def _refuse_unbuildable(config: BuildConfig) -> None:
    """Option combinations a backend cannot build are refused before the passes run, not after."""
    if config.prefill_engine and config.backend != "ort":
        raise ValueError(f"--prefill-engine is an option of the ort backend, not {config.backend!r}")
    if config.kv_dtype != "float32" and config.backend != "ort":
        raise ValueError(f"--kv-dtype is an option of the ort backend; {config.backend!r} chooses its own KV "
                         "cache precision (recorded in the artifact)")
    if config.attention != "standard" and config.backend != "ort":
        raise ValueError(f"--attention {config.attention} is an option of the ort backend, not {config.backend!r}")
    if config.backend == "openvino":
        from kiln.engines.openvino.options import OpenVinoOptions

        OpenVinoOptions.for_quant(config.quant)       # raises for a mode OpenVINO does not build


def _weights_workdir(writer: ArtifactWriter) -> Path:
    """The build's working weights file lives in the writer's temporary folder: a graph of any size
    stays a few MB of proto through every pass, and a failed build removes it with the folder.
    Removed before commit: the engines keep their own copies of what they use."""
    return writer.tmp / ".weights"


@dataclass
class BuiltEngines:
    engines: list[dict]                # manifest engine records (backend, file, sha256, io, ...)
    kv_layout: KvLayout                # the KV storage the engines read, as the runtime must plan it
    pass_reports: list[dict] = field(default_factory=list)


EngineBuilder = Callable[[onnx.ModelProto, ModelSpec, BuildConfig, Path, StageFn], BuiltEngines]


def _build_ort(model: onnx.ModelProto, spec: ModelSpec, config: BuildConfig, root: Path,
               stage: StageFn, folder: str = "ort") -> BuiltEngines:
    """Paged IO in the graph (a gather from the runtime's pool), then ORT's offline optimization."""
    # NOTE: checked at fp32 activations (verify_paged.py)
    kv_io = KvIoPass(spec, config.block_size, attention=config.attention, kv_dtype=config.kv_dtype)
    with stage(f"pass {kv_io.name}"):
        check = (lambda a, b: compare_paged(a, b, spec.num_layers, config.block_size, kv_dtype=config.kv_dtype)
                 if config.verify else None)
        model, report = run_pass(kv_io, model, check)
    with stage("compile ONNX Runtime engine"):
        engine, weights = compile_ort(model, root / "engines" / folder)
    record = {"backend": "ort", **file_record(root, engine), "io": _io_shapes(model)}
    if weights is not None:
        record["weights"] = file_record(root, weights)
    layout = KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size, dtype=config.kv_dtype,
                      block_bytes=_int8_block_bytes(spec, config.block_size) if config.kv_dtype == "int8" else 0)
    return BuiltEngines([record], layout, [report.to_dict()])


def _int8_block_bytes(spec: ModelSpec, block_size: int) -> int:
    """An int8 pool's block: the values and one fp32 scale per token and head (engines/kv_pool.py)."""
    return spec.num_layers * 2 * spec.num_kv_heads * block_size * (spec.head_dim + 4)


def _build_openvino(model: onnx.ModelProto, spec: ModelSpec, config: BuildConfig, root: Path,
                    stage: StageFn) -> BuiltEngines:
    """OpenVINO's native paged attention replaces the attention core; its plugin picks the block size."""
    from kiln.engines.openvino.compile import compile_openvino
    from kiln.engines.openvino.options import OpenVinoOptions

    with stage("compile OpenVINO engine"):
        records = compile_openvino(model, spec, root / "engines" / "openvino",
                                   OpenVinoOptions.for_quant(config.quant), root=root)
    return BuiltEngines(records, KvLayout(**records[0]["kv_layout"]))


def _build_tensorrt(model: onnx.ModelProto, spec: ModelSpec, config: BuildConfig, root: Path,
                    stage: StageFn) -> BuiltEngines:
    from kiln.engines.tensorrt.build import build_tensorrt      # GPU backends: kiln/engines/tensorrt, ort_cuda

    return BuiltEngines(*build_tensorrt(model, spec, config, root, stage))


def _build_ort_cuda(model: onnx.ModelProto, spec: ModelSpec, config: BuildConfig, root: Path,
                    stage: StageFn) -> BuiltEngines:
    from kiln.engines.ort_cuda.build import build_ort_cuda

    return BuiltEngines(*build_ort_cuda(model, spec, config, root, stage))


# Calls of at least this many tokens go to the prefill engine: ORT's integer GEMM (w8a8) is ~2x
# faster than MatMulNBits from 4 rows up and level at 1 (passes/dynamic_int8.py), so the
# weight-only engine keeps only one or two decodes, where it is as fast and more exact.
PREFILL_MIN_TOKENS = 4


def _add_prefill_engine(built: BuiltEngines, model: onnx.ModelProto, src: ModelSource, config: BuildConfig,
                        root: Path, stage: StageFn) -> BuiltEngines:
    """Engines per bucket range: a second ORT engine, quantized `config.prefill_engine` from the same
    fused graph, for calls of PREFILL_MIN_TOKENS tokens or more (prefill chunks, decode batches).
    Both read and write the one KV pool; the manifest says which serves what. The prefill engine
    keeps the standard attention core whatever --attention says: GroupQueryAttention is faster for
    the decode engine's single decodes but slower for decode batches and continuing chunks
    (passes/attention_gqa.py), which are this engine's calls."""
    mode = QuantMode(config.prefill_engine)        # the ort backend: _refuse_unbuildable checked
    quantize, check = _checked_quantize(src, mode, config.backend)
    with stage(f"pass {quantize.name} ({mode.value}, prefill engine)"):
        model, report = run_pass(quantize, model, check if config.verify else None)
    prefill = _build_ort(model, src.spec, replace(config, attention="standard"), root, stage, folder="ort-prefill")
    reports = [{**report.to_dict(), "name": f"{quantize.name} (prefill engine, {mode.value})"},
               *({**r, "name": f"{r['name']} (prefill engine)"} for r in prefill.pass_reports)]
    main = {**built.engines[0], "serves": {"max_tokens": PREFILL_MIN_TOKENS - 1}}
    extra = {**prefill.engines[0], "serves": {"min_tokens": PREFILL_MIN_TOKENS}, "quant": report.details}
    return BuiltEngines([main, extra], built.kv_layout, built.pass_reports + reports)


ENGINE_BUILDERS: dict[str, EngineBuilder] = {"ort": _build_ort, "openvino": _build_openvino,
                                             "tensorrt": _build_tensorrt, "ort-cuda": _build_ort_cuda}


def _engine_builder(backend: str) -> EngineBuilder:
    try:
        return ENGINE_BUILDERS[backend]
    except KeyError:
        raise ValueError(f"unknown engine backend {backend!r}; kiln builds {', '.join(ENGINE_BUILDERS)}") from None


def _passes(src: ModelSource, config: BuildConfig) -> list:
    """The backend-neutral passes: the standard decoder graph (dense KV IO) in, fused and quantized out.
    The quantize pass runs in every mode: its check's perplexity on kiln/data/check.txt goes into
    the manifest, and a quantized graph that disagrees with fp32 fails the build."""
    from kiln.passes.cleanup import CleanupPass

    passes = [(CleanupPass(), compare_logits)]
    if config.fuse:
        from kiln.passes.fusion import fusion_passes

        passes += [(p, compare_logits) for p in fusion_passes(src.spec, config.backend)]
    if not _engine_quantizes(config):
        passes.append(_checked_quantize(src, config.quant, config.backend))
    return passes


def _engine_quantizes(config: BuildConfig) -> bool:
    """The backend compresses the fp32 graph's weights itself (openvino int8: NNCF per channel, faster
    in OpenVINO than kiln's MatMulNBits blocks), so kiln's quantize pass does not run."""
    if config.backend != "openvino":
        return False
    from kiln.engines.openvino.options import OpenVinoOptions

    return OpenVinoOptions.for_quant(config.quant).compresses_weights


def _check_engine_quant(built: BuiltEngines, fp32_model: onnx.ModelProto, src: ModelSource, config: BuildConfig,
                        root: Path):
    """The quantize pass's check, run on the compiled engine (engines/openvino/quant_check.py)."""
    from kiln.engines.openvino.quant_check import check_compressed_engine
    from kiln.passes.verify_quant import check_token_ids

    tokens = check_token_ids(src.tokenizer_dir, min(512, src.spec.max_position_embeddings))
    return check_compressed_engine(root, built.engines[0], src.spec, config.buckets, built.kv_layout, fp32_model,
                                   tokens, config.quant)


def _checked_quantize(src: ModelSource, mode: QuantMode, backend: str) -> tuple[QuantizePass, Callable]:
    """The quantize pass for `mode` and its check against fp32 on the check text (verify_quant.py)."""
    from kiln.passes.int4_calibration import CALIBRATION_TOKENS, calibration_token_ids
    from kiln.passes.quantize import MIN_TOP1, recipe_options
    from kiln.passes.verify_quant import QuantCheck, check_token_ids

    calibration = calibration_token_ids(src.tokenizer_dir, min(CALIBRATION_TOKENS, src.spec.max_position_embeddings))
    quantize = QuantizePass(mode, calibration_ids=calibration, **recipe_options(mode, backend))
    tokens = check_token_ids(src.tokenizer_dir, min(512, src.spec.max_position_embeddings))
    return quantize, QuantCheck(quantize.name, tokens, MIN_TOP1[mode])


def _quant_record(config: BuildConfig, reports: list[dict]) -> dict:
    """The manifest's quant entry: the quantize pass's details, with its check's perplexity."""
    details = next((r["details"] for r in reports if r["name"].startswith("quantize")), {})
    return {"mode": config.quant.value, **details}


def _io_shapes(model: onnx.ModelProto) -> dict[str, list]:
    def dims(v):
        return [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
    return {v.name: dims(v) for v in [*model.graph.input, *model.graph.output]}


def _copy_tokenizer(src: ModelSource, out: Path) -> dict:
    out.mkdir(parents=True)
    files = {}
    for name in TOKENIZER_FILES:
        if (src.tokenizer_dir / name).is_file():
            shutil.copy(src.tokenizer_dir / name, out / name)
            files[f"{TOKENIZER_DIR}/{name}"] = file_record(out.parent, out / name)["sha256"]
    template = Tokenizer(out).chat_template or ""
    return {"files": files, "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()}


def _generation_defaults(src: ModelSource, tokenizer_dir: Path) -> dict:
    tok = Tokenizer(tokenizer_dir)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return {"eos_token_ids": eos, "max_model_len": src.spec.max_position_embeddings,
            "has_chat_template": tok.chat_template is not None}


@contextmanager
def timed_stage(name: str, sink: Callable[[str, float], None]):
    t0 = time.perf_counter()
    yield
    sink(name, time.perf_counter() - t0)
