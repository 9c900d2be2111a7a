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
from kiln.compiler.plan import BuildHost, BuildPlan, Fallback, QuantRecipe
from kiln.compiler.resolve import apply_to_config, fallbacks, refuse_before_export, resolve
from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import ModelSource, load_source
from kiln.compiler.passes.base import QuantCheckError, run_pass
from kiln.compiler.passes.verify_quant import CheckTexts, chat_check_ids, check_token_ids
from kiln.compiler.passes.fusion import passes_for
from kiln.compiler.passes.quantize import QuantizePass
from kiln.compiler.passes.verify import compare_logits
from kiln.config import BuildConfig
from kiln.contract.artifact import TOKENIZER_DIR, ArtifactWriter, Manifest, current_versions, file_record
from kiln.contract.backends import BACKEND_OPTIONS, BACKENDS, Backend, get_backend
from kiln.compiler.defaults import AUTO
from kiln.contract.quant import QuantMode
from kiln.inspect_view import rung_figures
from kiln.tokenizer import TEMPLATE_FILE, Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", TEMPLATE_FILE)


def build(config: BuildConfig, stage: StageFn = lambda name: nullcontext(), host: BuildHost | None = None) -> Path:
    """Build an artifact folder; `stage(name)` wraps each stage (progress display, timing). The build
    host is read here, once (host: a given BuildHost instead, as the tests give one)."""
    host = host or BuildHost.probe()
    if config.backend != AUTO and config.quant is not None:
        _refuse_unbuildable(config, get_backend(config.backend))      # before the slow stages
    with ArtifactWriter(config.out, config.force) as writer:
        with stage("load model source"):
            src = load_source(config.source)
        plan = resolve(config, src.spec, host)
        ladder = fallbacks(plan, config, src.spec)
        config = apply_to_config(config, plan)
        _refuse_unbuildable(config, get_backend(config.backend))
        refuse_before_export(plan, src.spec)
        with stage(f"chose {config.backend} {config.quant.value} ({_chosen(plan)})"):
            pass
        with stage("export ONNX decoder graph"):
            exported = build_decoder(src.spec, src.weights, _weights_workdir(writer))
        texts = _check_texts(src)
        built, reports, plan, tried, unquantized = _climb(exported, src, texts, config, plan, ladder, writer.tmp, stage)
        config = apply_to_config(config, plan)
        if config.prefill_engine:           # the user's own choice: its check fails the build, no ladder
            main = len(built.pass_reports)
            built = _add_prefill_engine(built, unquantized, src, texts, config, writer.tmp, stage, plan)
            reports += built.pass_reports[main:]
        with stage("write artifact"):
            tokenizer = _copy_tokenizer(src, writer.tmp / TOKENIZER_DIR)
            manifest = Manifest(
                spec=src.spec, quant=_quant_record(config, reports), buckets=config.buckets,
                kv_layout=built.kv_layout, engines=built.engines,
                generation=_generation_defaults(src, writer.tmp / TOKENIZER_DIR),
                tokenizer=tokenizer, passes=reports, source=src.description, versions=current_versions(),
                choices=plan.choices(), plan={**plan.to_dict(), "ladder": tried})
            shutil.rmtree(_weights_workdir(writer), ignore_errors=True)
            return writer.commit(manifest)


def _climb(exported: onnx.ModelProto, src: ModelSource, texts: CheckTexts, config: BuildConfig, plan: BuildPlan,
           ladder: tuple[Fallback, ...], root: Path, stage: StageFn):
    """Build `plan`; where its quantization fails the check, the next rung of the ladder that changes
    nothing the user chose (resolve.fallbacks), until one passes. A default build must not fail on a
    model a later rung passes; an explicit --quant / --backend fails with the next rung named.
    Returns the engines, the pass reports, the plan built, every rung tried with its figures, and
    the graph before quantization (what a prefill engine is quantized from)."""
    primary, rungs, tried = plan, list(ladder), []
    while True:
        config = apply_to_config(config, plan)
        try:
            built, reports, unquantized = _build_rung(exported, src, texts, config, plan, root, stage)
        except QuantCheckError as e:
            tried.append(_rung_record(plan, e.details, str(e)))
            _say_rung(stage, tried[-1])
            step = _next_rung(rungs, primary, e)
            with stage(step.stage.format(failure=_short(e))):
                pass
            plan = step.taken(_short(e))
            shutil.rmtree(root / "engines", ignore_errors=True)      # the failed rung's engine files
            continue
        tried.append(_rung_record(plan, _check_details(reports), ""))
        if config.verify:
            _say_rung(stage, tried[-1])
        return built, reports, plan, tried, unquantized


def _next_rung(rungs: list[Fallback], primary: BuildPlan, failure: QuantCheckError) -> Fallback:
    """The next rung the build may take; where the user's flags rule it out, the failure, naming it."""
    if not rungs:
        raise failure
    step = rungs.pop(0)
    if not step.allowed_after(primary):
        raise QuantCheckError(f"{failure}; the next rung of kiln's ladder, {step.name}, changes what you asked "
                             f"for: {step.how_to_ask()}", failure.details) from failure
    return step


def _build_rung(exported: onnx.ModelProto, src: ModelSource, texts: CheckTexts, config: BuildConfig, plan: BuildPlan,
                root: Path, stage: StageFn) -> tuple[BuiltEngines, list[dict], onnx.ModelProto]:
    """One plan's passes and engines from the exported graph; raises QuantCheckError where its
    quantization fails the check."""
    backend = get_backend(config.backend)
    if not _engine_quantizes(config) and plan.recipe.note:
        with stage(plan.recipe.note):       # kiln's own kernel, or why not
            pass
    reports: list[dict] = []
    model = unquantized = exported
    for p, check in _passes(src, texts, config, plan):
        if p.name == "quantize":
            unquantized = model
        with stage(f"pass {p.name}"):
            model, report = run_pass(p, model, check if config.verify else None)
            reports.append(report.to_dict())
    if _engine_quantizes(config):
        built, checked = _build_quantizing_engines(backend, model, src, texts, config, root, stage, plan)
        reports += checked
    else:
        built = backend.build_function()(model, src.spec, config, root, stage)
    return built, reports + built.pass_reports, unquantized


def _check_details(reports: list[dict]) -> dict:
    return next((r["details"] for r in reports if r["name"].startswith("quantize")), {})


def _rung_record(plan: BuildPlan, details: dict, failure: str) -> dict:
    """A rung as the manifest's plan records it: which, its check's figures, and why it was left."""
    figures = {k: details[k] for k in RUNG_FIGURES if k in details}
    return {"rung": plan.rung, "backend": plan.backend.value, "quant": plan.quant.value,
            "passed": not failure, "figures": figures, "failure": failure}


# The check's figures a rung record keeps (passes/verify_quant.py names them).
RUNG_FIGURES = ("top1_agreement", "perplexity_increase", "max_rel_logit_error", "chat")


def _say_rung(stage: StageFn, record: dict) -> None:
    verdict = "passed" if record["passed"] else "failed"
    with stage(f"rung {record['rung']}: {verdict} the check ({rung_figures(record['figures'])})"):
        pass


def _short(failure: QuantCheckError) -> str:
    """A failed check in a few words: its figures, or its message where it carries none."""
    figures = {k: failure.details[k] for k in RUNG_FIGURES if k in failure.details}
    return rung_figures(figures) if figures else str(failure)


def _chosen(plan: BuildPlan) -> str:
    attention = f"; attention: {plan.attention.reason}" if "attention" in plan.choices() else ""
    return f"{plan.backend.reason}; {plan.quant.reason}{attention}"


def _refuse_unbuildable(config: BuildConfig, backend: Backend) -> None:
    """Option combinations a backend cannot build are refused before the passes run, not after."""
    for option, neutral in BACKEND_OPTIONS.items():
        if getattr(config, option) != neutral and option not in backend.options:
            takers = [b.name for b in BACKENDS.values() if option in b.options]
            raise ValueError(f"--{option.replace('_', '-')} is an option of the {' / '.join(takers)} backend, "
                             f"not {backend.name!r} (which chooses its own; the artifact records it)")
    refusal = backend.refuses(config.quant.value)
    if refusal:
        raise ValueError(refusal)


def _weights_workdir(writer: ArtifactWriter) -> Path:
    """The build's working weights file lives in the writer's temporary folder: a graph of any size
    stays a few MB of proto through every pass, and a failed build removes it with the folder.
    Removed before commit: the engines keep their own copies of what they use."""
    return writer.tmp / ".weights"


# Calls of at least this many tokens go to the prefill engine: ORT's integer GEMM (w8a8) is clearly
# faster than MatMulNBits from 4 rows up and level at 1 (passes/dynamic_int8.py), so the
# weight-only engine keeps only one or two decodes, where it is as fast and more exact.
PREFILL_MIN_TOKENS = 4


def _add_prefill_engine(built: BuiltEngines, model: onnx.ModelProto, src: ModelSource, texts: CheckTexts,
                        config: BuildConfig, root: Path, stage: StageFn, plan: BuildPlan) -> BuiltEngines:
    """Engines per bucket range: a second ORT engine, quantized `config.prefill_engine` from the same
    fused graph, for calls of PREFILL_MIN_TOKENS tokens or more (prefill chunks, decode batches).
    Both read and write the one KV pool; the manifest says which serves what. The prefill engine
    keeps a core that takes any batch: GroupQueryAttention is faster for the decode engine's single
    decodes but slower for decode batches and continuing chunks (passes/attention_gqa.py), which are
    this engine's calls, so with --attention gqa it gets the standard core; kiln's PagedAttention
    takes any batch and is kept."""
    mode = QuantMode(config.prefill_engine)        # the ort backend: _refuse_unbuildable checked
    quantize, check = _checked_quantize(src, texts, plan.prefill_recipe)
    with stage(f"pass {quantize.name} ({mode.value}, prefill engine)"):
        model, report = run_pass(quantize, model, check if config.verify else None)
    core = "native" if config.attention == "native" else "standard"
    prefill = ort.build_engines(model, src.spec, replace(config, attention=core), root, stage, folder="ort-prefill")
    reports = [{**report.to_dict(), "name": f"{quantize.name} (prefill engine, {mode.value})"},
               *({**r, "name": f"{r['name']} (prefill engine)"} for r in prefill.pass_reports)]
    main = {**built.engines[0], "serves": {"max_tokens": PREFILL_MIN_TOKENS - 1}}
    extra = {**prefill.engines[0], "serves": {"min_tokens": PREFILL_MIN_TOKENS}, "quant": report.details}
    return BuiltEngines([main, extra], built.kv_layout, built.pass_reports + reports)


def _passes(src: ModelSource, texts: CheckTexts, config: BuildConfig, plan: BuildPlan) -> list:
    """The backend-neutral passes: the standard decoder graph (dense KV IO) in, fused and quantized out.
    The quantize pass runs in every mode: its check's perplexity on kiln/data/check.txt goes into
    the manifest, and a quantized graph that disagrees with fp32 fails the build."""
    from kiln.compiler.passes.cleanup import CleanupPass

    passes = [(CleanupPass(), compare_logits)]
    passes += [(p, compare_logits) for p in passes_for(plan.fusions, src.spec)]    # none with --no-fuse
    if not _engine_quantizes(config):
        passes.append(_checked_quantize(src, texts, plan.recipe))
    return passes


def _engine_quantizes(config: BuildConfig) -> bool:
    """The backend compresses the fp32 graph's weights itself (openvino int8: NNCF per channel, faster
    in OpenVINO than kiln's MatMulNBits blocks), so kiln's quantize pass does not run."""
    return config.quant.value in get_backend(config.backend).compresses_weights


def _build_quantizing_engines(backend: Backend, model: onnx.ModelProto, src: ModelSource, texts: CheckTexts,
                              config: BuildConfig, root: Path, stage: StageFn,
                              plan: BuildPlan) -> tuple[BuiltEngines, list[dict]]:
    """Engines of a backend that quantizes the fp32 graph itself (openvino), fed the calibration text,
    and their check's report; raises QuantCheckError where the engine fails it (the ladder moves on)."""
    from kiln.compiler.passes.int4_calibration import CALIBRATION_TOKENS, calibration_token_ids

    longest = min(CALIBRATION_TOKENS, src.spec.max_position_embeddings)
    calibration = (_chat_sample(src.tokenizer_dir) + calibration_token_ids(src.tokenizer_dir, longest))[:longest]
    built = backend.build_function()(model, src.spec, config, root, stage, calibration_ids=calibration,
                                     recipe=plan.recipe)
    if not config.verify:
        return built, []
    with stage("check the engine's quantization"):
        return built, [_check_engine_quant(built, model, src, texts, config, root).to_dict()]


# A conversation in the model's own chat template, ahead of the calibration text: chat requests start
# with the template's control tokens, whose activations the plain text never shows (on SmolLM2 some
# channels reach several times the text's maxima there: docs/results/2026-12-06-figures-from-code-comments.md).
CALIBRATION_CHAT = [{"role": "user", "content": "Give me three tips for keeping a small vegetable garden healthy."},
                    {"role": "assistant", "content": "Water early in the morning, mulch the soil, and rotate crops."}]


def _chat_sample(tokenizer_dir: Path) -> list[int]:
    """CALIBRATION_CHAT as the model's chat template renders it; nothing for a model without one."""
    tokenizer = Tokenizer(tokenizer_dir)
    return tokenizer.encode_chat(CALIBRATION_CHAT) if tokenizer.chat_template else []


def _check_engine_quant(built: BuiltEngines, fp32_model: onnx.ModelProto, src: ModelSource, texts: CheckTexts,
                        config: BuildConfig, root: Path):
    """The quantize pass's check, run on the compiled engine (kiln.compiler.backends.openvino.quant_check)."""
    from kiln.compiler.backends.openvino.quant_check import check_compressed_engine

    check = texts.check("quantize", config.quant)
    return check_compressed_engine(root, built.engines[0], src.spec, config.buckets, built.kv_layout, fp32_model,
                                   check, config.quant)


def _checked_quantize(src: ModelSource, texts: CheckTexts, recipe: QuantRecipe) -> tuple[QuantizePass, Callable]:
    """The quantize pass for a plan's recipe and its check against fp32 (passes/verify_quant.py)."""
    from kiln.compiler.passes.int4_calibration import CALIBRATION_TOKENS, calibration_token_ids

    mode = QuantMode(recipe.mode)
    calibration = calibration_token_ids(src.tokenizer_dir, min(CALIBRATION_TOKENS, src.spec.max_position_embeddings))
    quantize = QuantizePass.for_recipe(recipe, calibration_ids=calibration)
    return quantize, texts.check(quantize.name, mode)


def _check_texts(src: ModelSource) -> CheckTexts:
    """The check's texts for this model: the plain text and chat in the model's template."""
    longest = min(CHECK_TOKENS, src.spec.max_position_embeddings)
    return CheckTexts(check_token_ids(src.tokenizer_dir, longest), chat_check_ids(src.tokenizer_dir, longest))


CHECK_TOKENS = 512         # of each check text: the plain text and the chat


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


