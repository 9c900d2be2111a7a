"""The build pipeline: export -> passes -> engines -> artifact, as a short sequence of stages."""

from __future__ import annotations

import hashlib
import shutil
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable

import onnx

from kiln.compiler.backends import ort
from kiln.compiler.backends.built import BuiltEngines, StageFn
from kiln.compiler.defaults import AUTO, choose_attention, choose_backend, choose_quant
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import ModelSource, load_source
from kiln.compiler.passes.base import run_pass
from kiln.compiler.passes.quantize import QuantizePass
from kiln.compiler.passes.verify import compare_logits
from kiln.config import BuildConfig
from kiln.contract.artifact import TOKENIZER_DIR, ArtifactWriter, Manifest, current_versions, file_record
from kiln.contract.backends import BACKEND_OPTIONS, BACKENDS, Backend, get_backend
from kiln.contract.quant import QuantMode
from kiln.tokenizer import TEMPLATE_FILE, Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", TEMPLATE_FILE)
# The backends whose attention core depends on the build (ort: --attention; openvino: the model).
ATTENTION_CHOOSERS = ("ort", "openvino")


def build(config: BuildConfig, stage: StageFn = lambda name: nullcontext()) -> Path:
    """Build an artifact folder; `stage(name)` wraps each stage (progress display, timing)."""
    if config.backend != AUTO and config.quant is not None:
        _refuse_unbuildable(config, get_backend(config.backend))      # before the slow stages
    with ArtifactWriter(config.out, config.force) as writer:
        with stage("load model source"):
            src = load_source(config.source)
        config, choices = resolve_defaults(config, src.spec)
        backend = get_backend(config.backend)
        _refuse_unbuildable(config, backend)
        attention = f"; attention: {choices['attention']['reason']}" if "attention" in choices else ""
        with stage(f"chose {config.backend} {config.quant.value} ({choices['backend']['reason']}; "
                   f"{choices['quant']['reason']}{attention})"):
            pass
        if not _engine_quantizes(config):
            from kiln.compiler.passes.quantize import kernel_note

            note = kernel_note(config.quant, backend)
            if note:
                with stage(note):       # kiln's own kernel, or why not
                    pass
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
        if _engine_quantizes(config):
            built, checked = _build_quantizing_engines(backend, model, src, config, writer.tmp, stage, choices)
            reports += checked
        else:
            built = backend.build_function()(model, src.spec, config, writer.tmp, stage)
        if config.prefill_engine:
            built = _add_prefill_engine(built, unquantized, src, config, writer.tmp, stage)
        reports += built.pass_reports
        with stage("write artifact"):
            tokenizer = _copy_tokenizer(src, writer.tmp / TOKENIZER_DIR)
            manifest = Manifest(
                spec=src.spec, quant=_quant_record(config, reports), buckets=config.buckets,
                kv_layout=built.kv_layout, engines=built.engines,
                generation=_generation_defaults(src, writer.tmp / TOKENIZER_DIR),
                tokenizer=tokenizer, passes=reports, source=src.description, versions=current_versions(),
                choices=choices)
            shutil.rmtree(_weights_workdir(writer), ignore_errors=True)
            return writer.commit(manifest)


def resolve_defaults(config: BuildConfig, spec) -> tuple[BuildConfig, dict]:
    """The config with `auto` backend and quant replaced by this machine's and model's choice, and
    the choices with their reasons (the manifest records them)."""
    modes = get_backend(config.backend).quant_modes if config.backend != AUTO else ()
    quant = choose_quant(config.quant, spec, modes)
    ort_options = tuple(o for o, neutral in BACKEND_OPTIONS.items() if getattr(config, o) != neutral)
    backend = choose_backend(config.backend, QuantMode(quant.value), spec, ort_options)
    attention = choose_attention(config.attention, backend.value, config.kv_dtype, spec)
    resolved = replace(config, quant=QuantMode(quant.value), backend=backend.value, attention=attention.value)
    choices = {"backend": backend.to_dict(), "quant": quant.to_dict()}
    if backend.value in ATTENTION_CHOOSERS:
        choices["attention"] = attention.to_dict()
    return resolved, choices


def _refuse_unbuildable(config: BuildConfig, backend: Backend) -> None:
    """Option combinations a backend cannot build are refused before the passes run, not after."""
    for option, neutral in BACKEND_OPTIONS.items():
        if getattr(config, option) != neutral and option not in backend.options:
            takers = [b.name for b in BACKENDS.values() if option in b.options]
            raise ValueError(f"--{option.replace('_', '-')} is an option of the {' / '.join(takers)} backend, "
                             f"not {backend.name!r} (which chooses its own; the artifact records it)")
    if config.quant.value not in backend.quant_modes:
        raise ValueError(f"the {backend.name} backend has no {config.quant.value} mode; it builds --quant "
                         f"{' | '.join(backend.quant_modes)}")


def _weights_workdir(writer: ArtifactWriter) -> Path:
    """The build's working weights file lives in the writer's temporary folder: a graph of any size
    stays a few MB of proto through every pass, and a failed build removes it with the folder.
    Removed before commit: the engines keep their own copies of what they use."""
    return writer.tmp / ".weights"


# Calls of at least this many tokens go to the prefill engine: ORT's integer GEMM (w8a8) is ~2x
# faster than MatMulNBits from 4 rows up and level at 1 (passes/dynamic_int8.py), so the
# weight-only engine keeps only one or two decodes, where it is as fast and more exact.
PREFILL_MIN_TOKENS = 4


def _add_prefill_engine(built: BuiltEngines, model: onnx.ModelProto, src: ModelSource, config: BuildConfig,
                        root: Path, stage: StageFn) -> BuiltEngines:
    """Engines per bucket range: a second ORT engine, quantized `config.prefill_engine` from the same
    fused graph, for calls of PREFILL_MIN_TOKENS tokens or more (prefill chunks, decode batches).
    Both read and write the one KV pool; the manifest says which serves what. The prefill engine
    keeps a core that takes any batch: GroupQueryAttention is faster for the decode engine's single
    decodes but slower for decode batches and continuing chunks (passes/attention_gqa.py), which are
    this engine's calls, so with --attention gqa it gets the standard core; kiln's PagedAttention
    takes any batch and is kept."""
    mode = QuantMode(config.prefill_engine)        # the ort backend: _refuse_unbuildable checked
    quantize, check = _checked_quantize(src, mode, config.backend)
    with stage(f"pass {quantize.name} ({mode.value}, prefill engine)"):
        model, report = run_pass(quantize, model, check if config.verify else None)
    core = "native" if config.attention == "native" else "standard"
    prefill = ort.build_engines(model, src.spec, replace(config, attention=core), root, stage, folder="ort-prefill")
    reports = [{**report.to_dict(), "name": f"{quantize.name} (prefill engine, {mode.value})"},
               *({**r, "name": f"{r['name']} (prefill engine)"} for r in prefill.pass_reports)]
    main = {**built.engines[0], "serves": {"max_tokens": PREFILL_MIN_TOKENS - 1}}
    extra = {**prefill.engines[0], "serves": {"min_tokens": PREFILL_MIN_TOKENS}, "quant": report.details}
    return BuiltEngines([main, extra], built.kv_layout, built.pass_reports + reports)


def _passes(src: ModelSource, config: BuildConfig) -> list:
    """The backend-neutral passes: the standard decoder graph (dense KV IO) in, fused and quantized out.
    The quantize pass runs in every mode: its check's perplexity on kiln/data/check.txt goes into
    the manifest, and a quantized graph that disagrees with fp32 fails the build."""
    from kiln.compiler.passes.cleanup import CleanupPass

    passes = [(CleanupPass(), compare_logits)]
    if config.fuse:
        from kiln.compiler.passes.fusion import fusion_passes

        skipped = get_backend(config.backend).skipped_fusions
        passes += [(p, compare_logits) for p in fusion_passes(src.spec, skipped, config.quant.value)]
    if not _engine_quantizes(config):
        passes.append(_checked_quantize(src, config.quant, config.backend))
    return passes


def _engine_quantizes(config: BuildConfig) -> bool:
    """The backend compresses the fp32 graph's weights itself (openvino int8: NNCF per channel, faster
    in OpenVINO than kiln's MatMulNBits blocks), so kiln's quantize pass does not run."""
    return config.quant.value in get_backend(config.backend).compresses_weights


def _build_quantizing_engines(backend: Backend, model: onnx.ModelProto, src: ModelSource, config: BuildConfig,
                              root: Path, stage: StageFn, choices: dict) -> tuple[BuiltEngines, list[dict]]:
    """Engines of a backend that quantizes the fp32 graph itself (openvino), fed the calibration text,
    and their check's report. Where kiln's int8 linears (options.kernels) fail the check, the engine is
    built again on OpenVINO's own and the backend choice says so: a default build must not fail on
    what the plugin's linears would pass."""
    from kiln.compiler.passes.base import PassCheckError
    from kiln.compiler.passes.int4_calibration import CALIBRATION_TOKENS, calibration_token_ids

    build = backend.build_function()
    longest = min(CALIBRATION_TOKENS, src.spec.max_position_embeddings)
    calibration = (_chat_sample(src.tokenizer_dir) + calibration_token_ids(src.tokenizer_dir, longest))[:longest]
    built = build(model, src.spec, config, root, stage, calibration_ids=calibration)
    if not config.verify:
        return built, []
    try:
        with stage("check the engine's quantization"):
            return built, [_check_engine_quant(built, model, src, config, root).to_dict()]
    except PassCheckError as e:
        if not built.engines[0]["options"].get("kernels"):
            raise
        failure = str(e)
    with stage(f"kiln's int8 linears failed the check ({failure}): building on OpenVINO's own"):
        pass
    choices["backend"]["reason"] += f"; kiln's int8 linears failed the build's check ({failure}), so OpenVINO's own"
    built = build(model, src.spec, config, root, stage, calibration_ids=calibration, kiln_kernels=False)
    with stage("check the engine's quantization"):
        return built, [_check_engine_quant(built, model, src, config, root).to_dict()]


# A conversation in the model's own chat template, ahead of the calibration text: chat requests start
# with the template's control tokens, whose activations the plain text never shows (on SmolLM2 some
# channels reach 7-13x the text's maxima there).
CALIBRATION_CHAT = [{"role": "user", "content": "Give me three tips for keeping a small vegetable garden healthy."},
                    {"role": "assistant", "content": "Water early in the morning, mulch the soil, and rotate crops."}]


def _chat_sample(tokenizer_dir: Path) -> list[int]:
    """CALIBRATION_CHAT as the model's chat template renders it; nothing for a model without one."""
    tokenizer = Tokenizer(tokenizer_dir)
    return tokenizer.encode_chat(CALIBRATION_CHAT) if tokenizer.chat_template else []


def _check_engine_quant(built: BuiltEngines, fp32_model: onnx.ModelProto, src: ModelSource, config: BuildConfig,
                        root: Path):
    """The quantize pass's check, run on the compiled engine (kiln.compiler.backends.openvino.quant_check)."""
    from kiln.compiler.backends.openvino.quant_check import check_compressed_engine
    from kiln.compiler.passes.verify_quant import check_token_ids

    tokens = check_token_ids(src.tokenizer_dir, min(512, src.spec.max_position_embeddings))
    return check_compressed_engine(root, built.engines[0], src.spec, config.buckets, built.kv_layout, fp32_model,
                                   tokens, config.quant)


def _checked_quantize(src: ModelSource, mode: QuantMode, backend: str) -> tuple[QuantizePass, Callable]:
    """The quantize pass for `mode` and its check against fp32 on the check text (passes/verify_quant.py)."""
    from kiln.compiler.passes.int4_calibration import CALIBRATION_TOKENS, calibration_token_ids
    from kiln.compiler.passes.quantize import MIN_TOP1, recipe_options
    from kiln.compiler.passes.verify_quant import QuantCheck, check_token_ids

    calibration = calibration_token_ids(src.tokenizer_dir, min(CALIBRATION_TOKENS, src.spec.max_position_embeddings))
    quantize = QuantizePass(mode, calibration_ids=calibration, **recipe_options(mode, get_backend(backend)))
    tokens = check_token_ids(src.tokenizer_dir, min(512, src.spec.max_position_embeddings))
    return quantize, QuantCheck(quantize.name, tokens, MIN_TOP1[mode])


def _quant_record(config: BuildConfig, reports: list[dict]) -> dict:
    """The manifest's quant entry: the quantize pass's details, with its check's perplexity."""
    details = next((r["details"] for r in reports if r["name"].startswith("quantize")), {})
    return {"mode": config.quant.value, **details}


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
    eos += [i for i in src.end_token_ids if i not in eos]
    return {"eos_token_ids": eos, "max_model_len": src.spec.max_position_embeddings,
            "has_chat_template": tok.chat_template is not None}


