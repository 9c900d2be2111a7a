"""The quantization check of an openvino build whose weights OpenVINO compresses itself (NNCF int8).

kiln's quantize pass checks its own ONNX graph against fp32; here the quantized numbers exist only
inside the compiled engine (NNCF's weights, the plugin's dynamic activation quantization, its KV
cache precision), so the check runs the engine itself over the check text, one prefill with
logits at every position, against the fp32 graph's logits: the same gate (top-1 agreement and
perplexity shift on the plain and the chat text) and figures as the quantize pass, recorded as the
build's quantize report.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx

from kiln.contract.engine import BucketGrid, KvLayout, PagedBatch
from kiln.engines.openvino.loader import open_openvino
from kiln.contract.model_spec import ModelSpec
from kiln.compiler.passes.base import PassReport
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.verify_quant import QuantCheck


def engine_logits(root: Path, record: dict, spec: ModelSpec, buckets: BucketGrid, kv_layout: KvLayout,
                  sequences: list[list[int]]) -> list[np.ndarray]:
    """Logits [T, vocab] of the compiled engine for each sequence, each prefilled in one call."""
    engine = open_openvino(root, record, spec, buckets, kv_layout)
    num_blocks = max(-(-len(ids) // engine.block_size) for ids in sequences)
    engine.allocate_kv(num_blocks)
    return [_prefill_logits(engine, ids) for ids in sequences]


def _prefill_logits(engine, token_ids: list[int]) -> np.ndarray:
    n = len(token_ids)
    rows = np.arange(n, dtype=np.int64)
    blocks = np.arange(-(-n // engine.block_size), dtype=np.int64)
    batch = PagedBatch(input_ids=np.asarray(token_ids, np.int64), positions=rows, query_lens=np.array([n]),
                       past_lens=np.array([0]), block_tables=[blocks], slot_mapping=rows, logits_indices=rows)
    return engine.execute(batch).logits


def check_compressed_engine(root: Path, record: dict, spec: ModelSpec, buckets: BucketGrid, kv_layout: KvLayout,
                            fp32_model: onnx.ModelProto, check: QuantCheck, mode: QuantMode) -> PassReport:
    """The report of the engine's quantization against fp32; raises PassCheckError where it fails
    the check's gate (passes/verify_quant.py: top-1 agreement and perplexity shift per text)."""
    name = f"quantize (openvino {record['options']['weights']})"
    check.pass_name = name
    t0 = time.perf_counter()
    gots = engine_logits(root, record, spec, buckets, kv_layout, check.texts())
    err, rel = check.compare(check.fp32_logits(fp32_model), gots)
    nodes = len(fp32_model.graph.node)
    details = {"mode": mode.value, **record["compression"], "options": record["options"], **check.details()}
    return PassReport(name, nodes, nodes, time.perf_counter() - t0, err, rel, None, details)
