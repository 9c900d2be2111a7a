"""Shared by the openvino tests: kiln's standard graph for a source, and an artifact whose engine is
the openvino backend (made from a built ORT artifact's manifest and tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.passes.quantize import QuantMode


def standard_graph(source: str, quant: QuantMode = QuantMode.NONE):
    """kiln's fused standard decoder graph (dense KV IO, before the kv_io pass), as build.py makes it."""
    from kiln.export.decoder_graph import build_decoder
    from kiln.export.sources import load_source
    from kiln.passes.base import run_pass
    from kiln.passes.cleanup import CleanupPass
    from kiln.passes.fusion import fusion_passes
    from kiln.passes.quantize import QuantizePass

    src = load_source(source)
    model = build_decoder(src.spec, src.weights)
    passes = [CleanupPass(), *fusion_passes(src.spec)]
    if quant is not QuantMode.NONE:
        passes.append(QuantizePass(quant))
    for p in passes:
        model, _ = run_pass(p, model, None)
    return src.spec, model


def openvino_artifact(ort_artifact: Path, source: str, out: Path, quant: QuantMode = QuantMode.NONE) -> Path:
    """A copy of `ort_artifact` whose only engine is the openvino one built from the same source."""
    from kiln.engines.openvino.compile import compile_openvino
    from kiln.engines.openvino.options import OpenVinoOptions

    shutil.copytree(ort_artifact, out)
    shutil.rmtree(out / "engines")
    spec, model = standard_graph(source)        # the backend compresses the fp32 graph itself
    records = compile_openvino(model, spec, out / "engines" / "openvino", OpenVinoOptions.for_quant(quant))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["engines"], manifest["kv_layout"] = records, records[0]["kv_layout"]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out
