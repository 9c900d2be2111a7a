"""Build side of the OpenVINO backend: kiln's standard decoder -> paged OpenVINO IR + engine record.

    ONNX ModelProto (fused; fp32 or MatMulNBits-quantized)
      ─ OpenVINO ONNX frontend ─ mark the attention cuts ─ model.xml/.bin (weights kept as they are)
      ─ rewrite to the paged model, compile once on this CPU with the recorded precisions
      ─ the KV cache it allocates ─ engine record
      ─ the compiled model exported (compiled.blob) and imported back once ─ the record's "compiled"
    Loading imports the blob (kiln.engines.openvino.loader); where the plugin refuses it (another
    OpenVINO release or CPU instruction set) it repeats the last steps from model.xml (compile_paged).
A model the paged operation cannot compute (soft-capped scores) takes the kv_io pass's paged gather
instead of the cuts and the rewrite (layout "paged-gather", kiln.engines.openvino.gathered).
"""

from __future__ import annotations

import io
import logging
import tempfile
from dataclasses import replace
from pathlib import Path

import onnx
import openvino as ov

from kiln.contract.artifact import file_record
from kiln.contract.engine import KvLayout
from kiln.engines.openvino.engine import (GATHER_LAYOUT, PAGED_LAYOUT, compile_gathered, compile_paged,
                                          describe_kv_cache, import_gathered, import_paged)
from kiln.compiler.backends.openvino.coverage import attention_core
from kiln.engines.openvino import kiln_attention
from kiln.engines.openvino.options import OpenVinoOptions
from kiln.compiler.backends.built import BuiltEngines, StageFn
from kiln.compiler.backends.openvino.cuts import mark_cuts
from kiln.compiler.backends.openvino.int8_linears import use_kiln_linears
from kiln.compiler.backends.openvino.recipe import options_for_quant, options_for_recipe
from kiln.compiler.plan import QuantRecipe
from kiln.compiler.backends.openvino.tied_head import share_tied_head
from kiln.compiler.backends.openvino.weights import WeightCompression
from kiln.compiler.export.external import weights_dir
from kiln.compiler.passes.base import run_pass
from kiln.compiler.passes.kv_io import KvIoPass
from kiln.compiler.passes.verify_paged import compare_paged
from kiln.contract.model_spec import ModelSpec

log = logging.getLogger("kiln")

BACKEND = "openvino"
MODEL_FILE = "model.xml"
WEIGHTS_FILE = "model.bin"
BLOB_FILE = "compiled.blob"
PROTOBUF_LIMIT = 2**31 - 1


def build_engines(model: onnx.ModelProto, spec: ModelSpec, config, root: Path, stage: StageFn,
                  calibration_ids: list[int] | None = None, recipe: QuantRecipe | None = None) -> BuiltEngines:
    """OpenVINO's native paged attention replaces the attention core (its plugin picks the block size);
    for what that operation cannot compute (paged_graph.unsupported: soft-capped scores), kiln's paged
    gather stays in the graph (gathered.py), checked against the dense graph like the ort backend's.
    calibration_ids: the tokens kiln's int8 linears are smoothed on (required where the recipe takes
    them); recipe: the build plan's quantization recipe (None: the one this host's plan has for config.quant)."""
    reports = []
    options = options_for_recipe(recipe) if recipe is not None else options_for_quant(config.quant)
    options = with_attention(options, config.attention, spec)
    layout, why = attention_core(spec) if not options.attention else (PAGED_LAYOUT, "kiln's paged attention")
    gather = layout == GATHER_LAYOUT
    if gather:
        options = replace(gather_options(options), kernels="")     # kiln's linears: paged layout only
        kv_io = KvIoPass(spec, config.block_size, attention="standard")
        check = ((lambda a, b: compare_paged(a, b, spec.num_layers, config.block_size))
                 if config.verify else None)
        with stage(f"pass {kv_io.name} ({why})"):
            model, report = run_pass(kv_io, model, check)
            reports.append(report.to_dict())
    with stage("compile OpenVINO engine"):
        records = compile_openvino(model, spec, root / "engines" / "openvino", options, root=root,
                                   gather_block_size=config.block_size if gather else 0,
                                   calibration_ids=calibration_ids)
    return BuiltEngines(records, KvLayout(**records[0]["kv_layout"]), reports)


def with_attention(options: OpenVinoOptions, requested: str, spec: ModelSpec) -> OpenVinoOptions:
    """--attention native: kiln's own paged attention over its u8 cache (kiln_attention.py) in place
    of the plugin's operation; anything else keeps the plugin's."""
    if requested != "native":
        return options
    why_not = kiln_attention.supports(spec)
    if why_not:
        raise ValueError(f"--attention native: kiln's paged attention for OpenVINO does not take {why_not}")
    # NOTE: u8 (codes per token and head): half the bytes of f16 per token, which long contexts'
    # decodes read (bench/bench_paged_attention.py compares the cores and formats)
    fmt = kiln_attention.KILN_U8
    return replace(options, attention=fmt.name, kv_cache_precision="u8", key_cache_quant_mode="")


def compile_openvino(model: onnx.ModelProto, spec: ModelSpec, out_dir: Path,
                     options: OpenVinoOptions | None = None, root: Path | None = None,
                     gather_block_size: int = 0, calibration_ids: list[int] | None = None) -> list[dict]:
    """Write engines/openvino/model.{xml,bin} and return the manifest's engine records.

    root: the artifact folder file paths are recorded relative to (default: out_dir/../..).
    gather_block_size: > 0 when `model` is the kv_io graph with kiln's paged gather (its pool's block
    size), 0 for the standard graph the paged rewrite takes.
    calibration_ids: tokens whose activations smooth kiln's int8 linears (options.kernels); required
    with them.
    The record's "kv_layout" is the layout the runtime must plan with (the plugin's block size).
    """
    options = options or OpenVinoOptions()
    if options.compresses_weights and _already_quantized(model):
        # NOTE: OpenVINO runs kiln's MatMulNBits too, but slower than NNCF's per-channel int8 from
        # the fp32 graph (weights.py); the record says which path the weights took.
        options = replace(options, weights=WeightCompression.NONE.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = root or out_dir.parent.parent
    layout = GATHER_LAYOUT if gather_block_size else PAGED_LAYOUT
    with tempfile.TemporaryDirectory(prefix="kiln-ov-") as tmp:
        ov_model = _read_onnx(model, Path(tmp))
        if not gather_block_size:
            mark_cuts(ov_model, model, spec)
        tied = share_tied_head(ov_model)
        kernels = {}
        if options.kernels:
            # NOTE: before NNCF, which then finds only the embedding and the LM head to compress.
            if not calibration_ids:
                raise ValueError("kiln's int8 linears need calibration token ids (kiln/data/calibration.txt)")
            ov_model, kernels = use_kiln_linears(ov_model, calibration_ids)
        compression = WeightCompression(options.weights).apply(ov_model) | {"tied_head_shared": tied}
        if kernels:
            compression["kernels"] = {"name": options.kernels, **kernels}
        if _already_quantized(model):
            compression["weights"] = "onnx MatMulNBits (kiln's quantize pass)"
        # NOTE: save_model halves fp32 weights by default; only the f16 recipe asks it to.
        ov.save_model(ov_model, out_dir / MODEL_FILE, compress_to_fp16=WeightCompression(options.weights).saved_f16)
        del ov_model
    if gather_block_size:
        compiled = compile_gathered(out_dir / MODEL_FILE, options, threads=1)
        kv_layout = KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, gather_block_size, "float32")
        kv = {"element_type": "f32", "layout": GATHER_LAYOUT, "bytes_per_block": kv_layout.bytes_per_block}
    else:
        compiled = compile_paged(out_dir / MODEL_FILE, spec, options, threads=1)
        kv = describe_kv_cache(compiled)
        kv_layout = kv_layout_for(spec, kv)
    record = {
        "backend": BACKEND, **file_record(root, out_dir / MODEL_FILE),
        "weights": file_record(root, out_dir / WEIGHTS_FILE), "layout": layout,
        "io": _io(compiled), "options": options.to_dict(), "compression": compression, "kv_cache": kv,
        "kv_layout": kv_layout.to_dict(), "openvino": ov.get_version(),
    }
    blob = export_compiled(compiled, spec, options, out_dir / BLOB_FILE, kv, layout)
    if blob is not None:
        record["compiled"] = {**file_record(root, blob), "openvino": ov.get_version(),
                              "device": ov.Core().get_property("CPU", "FULL_DEVICE_NAME")}
    return [record]


def gather_options(options: OpenVinoOptions) -> OpenVinoOptions:
    """A paged-gather engine computes in f32: under bf16 (or f16) compute the plugin converts the
    fp32 pool input to that precision whole, every call (the entire pool, not the blocks gathered:
    the cost grows with the pool, not the step; figure in docs/results/2026-12-06-figures-from-code-comments.md),
    and an fp16 pool fares worse (the plugin moves the widening above the Gather). The compressed
    weights stay as they are."""
    return replace(options, inference_precision="f32")


def export_compiled(compiled: ov.CompiledModel, spec: ModelSpec, options: OpenVinoOptions, path: Path,
                    kv: dict, layout: str = PAGED_LAYOUT) -> Path | None:
    """Write the compiled model's blob; None (and no file) when it does not import back here.

    NOTE: the blob is the plugin's transformed graph for this OpenVINO release and this CPU's
    instruction set (its header says which; the plugin refuses any other), so the artifact keeps
    model.xml/.bin for the loads it refuses."""
    # NOTE: export_model writes to an io.BytesIO only (not a file): the blob passes through memory once.
    stream = io.BytesIO()
    compiled.export_model(stream)
    path.write_bytes(stream.getbuffer())
    del stream
    try:
        if layout == GATHER_LAYOUT:
            import_gathered(path, options, threads=1)
        else:
            back, _ = import_paged(path, spec, options, threads=1)
            if describe_kv_cache(back) != kv:
                raise RuntimeError(f"the imported model allocates the KV cache as {describe_kv_cache(back)}")
    except RuntimeError as e:
        path.unlink()
        log.warning("the compiled OpenVINO model does not import back (%s); the artifact's loads will "
                    "compile it from model.xml", str(e).strip().splitlines()[-1][:300])
        return None
    return path


def _already_quantized(model: onnx.ModelProto) -> bool:
    return any(n.op_type in ("MatMulNBits", "GatherBlockQuantized") for n in model.graph.node)


def kv_layout_for(spec: ModelSpec, kv: dict) -> KvLayout:
    """The runtime's view of the cache: block size from the plugin's key block shape [kvh, bs(+scales), hd]."""
    block_size = kv["value_block_shape"][1]
    dtype = {"f32": "float32", "f16": "float16", "u8": "uint8"}[kv["element_type"]]
    return KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, dtype, kv["bytes_per_block"])


def _read_onnx(model: onnx.ModelProto, tmp: Path) -> ov.Model:
    """The frontend reads a file (and may map its weights: keep `tmp` until the model is saved)."""
    path = tmp / "model.onnx"
    if weights_dir(model) is not None:
        return _read_external(model, weights_dir(model))
    if model.ByteSize() < PROTOBUF_LIMIT:
        onnx.save(model, path)
    else:
        # NOTE: saving with external data rewrites the proto's tensors in place: work on a copy.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save(copy, path, save_as_external_data=True, location="model.data")
    return ov.Core().read_model(path)


def _read_external(model: onnx.ModelProto, folder: Path) -> ov.Model:
    """A graph whose weights are already external (export.external) is read from their folder: its
    tensors name the weights file relative to the model file, and the frontend refuses paths that
    leave the model's folder (a link included). The weights file stays until the build ends."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix="openvino-", suffix=".onnx") as f:
        f.write(model.SerializeToString())
        f.flush()
        return ov.Core().read_model(f.name)


def _io(compiled: ov.CompiledModel) -> dict[str, list]:
    """Every input and output except the per-layer caches (described once under "kv_cache")."""
    ports = [*compiled.inputs, *compiled.outputs]
    return {p.get_any_name(): [str(d) for d in p.get_partial_shape()] for p in ports
            if not p.get_any_name().startswith(("key_cache.", "value_cache."))}
