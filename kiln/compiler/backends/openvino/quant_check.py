"""The quantization check of an openvino build whose weights OpenVINO compresses itself (NNCF int8).

kiln's quantize pass checks its own ONNX graph against fp32; here the quantized numbers exist only
inside the compiled engine (NNCF's weights, the plugin's dynamic activation quantization, its KV
cache precision), so the check runs the engine itself over the check text, one prefill with
logits at every position, against the fp32 graph's logits: the same top-1 minimum, logit
tolerance and perplexity figures as the quantize pass, recorded as the build's quantize report.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx

from kiln.contract.engine import BucketGrid, KvLayout, PagedBatch
from kiln.engines.openvino.loader import open_openvino
from kiln.compiler.eval.perplexity import text_logits
from kiln.contract.model_spec import ModelSpec
from kiln.compiler.passes.base import PassCheckError, PassReport
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import MIN_TOP1, REL_TOLERANCE
from kiln.compiler.passes.verify_quant import QuantCheck


def engine_logits(root: Path, record: dict, spec: ModelSpec, buckets: BucketGrid, kv_layout: KvLayout,
                  token_ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] of the compiled engine for one sequence prefilled in one call."""
    engine = open_openvino(root, record, spec, buckets, kv_layout)
    n = len(token_ids)
    num_blocks = -(-n // engine.block_size)
    engine.allocate_kv(num_blocks)
    rows = np.arange(n, dtype=np.int64)
    batch = PagedBatch(input_ids=np.asarray(token_ids, np.int64), positions=rows, query_lens=np.array([n]),
                       past_lens=np.array([0]), block_tables=[np.arange(num_blocks, dtype=np.int64)],
                       slot_mapping=rows, logits_indices=rows)
    return engine.execute(batch).logits


def check_compressed_engine(root: Path, record: dict, spec: ModelSpec, buckets: BucketGrid, kv_layout: KvLayout,
                            fp32_model: onnx.ModelProto, token_ids: list[int], mode: QuantMode) -> PassReport:
    """The report of the engine's quantization against fp32; raises PassCheckError beyond tolerance."""
    name = f"quantize (openvino {record['options']['weights']})"
    t0 = time.perf_counter()
    check = QuantCheck(name, token_ids, MIN_TOP1[mode])
    got = engine_logits(root, record, spec, buckets, kv_layout, token_ids)
    err, rel = check.compare(text_logits(fp32_model, token_ids), got)
    nodes = len(fp32_model.graph.node)
    tolerance = REL_TOLERANCE[mode]
    details = {"mode": mode.value, **record["compression"], "options": record["options"], **check.details()}
    report = PassReport(name, nodes, nodes, time.perf_counter() - t0, err, rel, tolerance, details)
    if not rel <= tolerance:
        raise PassCheckError(f"pass {name!r} failed its numeric check: max relative logit error {rel:.3g} > "
                             f"tolerance {tolerance:.3g} over {len(token_ids)} tokens of {check.text}")
    return report
