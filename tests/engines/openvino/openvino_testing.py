"""Shared by the openvino tests: kiln's standard graph for a source, as the build hands it to a backend."""

from __future__ import annotations

from kiln.contract.backends import get_backend
from kiln.contract.quant import QuantMode


def standard_graph(source: str, quant: QuantMode = QuantMode.NONE):
    """kiln's fused standard decoder graph (dense KV IO, before the kv_io pass), as build.py makes it."""
    from kiln.compiler.export.decoder_graph import build_decoder
    from kiln.compiler.export.sources import load_source
    from kiln.compiler.passes.base import run_pass
    from kiln.compiler.passes.cleanup import CleanupPass
    from kiln.compiler.passes.fusion import fusion_passes
    from kiln.compiler.passes.quantize import QuantizePass
    from kiln.compiler.passes.quant_settings import QuantSettings

    src = load_source(source)
    model = build_decoder(src.spec, src.weights)
    passes = [CleanupPass(), *fusion_passes(src.spec, get_backend("openvino").skipped_fusions)]
    if quant is not QuantMode.NONE:
        passes.append(QuantizePass(QuantSettings(quant)))
    for p in passes:
        model, _ = run_pass(p, model, None)
    return src.spec, model
