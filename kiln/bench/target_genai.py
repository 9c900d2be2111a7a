"""onnxruntime-genai as a peer: its Generator, one request at a time (no in-flight batching on CPU).

Takes a model folder its builder made (`python -m onnxruntime_genai.models.builder`, e.g. the
ones bench/bench_runtime.py caches in bench/.cache/genai-*) from the same weights as the artifact.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from kiln.bench.target_peer import Emit, SequentialPeer


class GenAITarget(SequentialPeer):
    def __init__(self, model_dir: Path, to_ids, context_len: int, temperature: float, threads: int):
        import onnxruntime_genai as og

        super().__init__(to_ids, context_len, temperature)
        self.og, self.name = og, f"onnxruntime-genai {Path(model_dir).name} (sequential)"
        config = og.Config(str(model_dir))
        # NOTE: the same intra-op thread count as kiln and torch, or the peers are not comparable.
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.model = og.Model(config)

    def generate(self, ids: list[int], max_tokens: int, emit: Emit, stop: threading.Event) -> None:
        params = self.og.GeneratorParams(self.model)
        sample = dict(do_sample=True, temperature=self.temperature) if self.temperature > 0 else dict(do_sample=False)
        # min_length = max_length: exactly max_tokens new tokens, EOS or not, like ignore_eos for kiln.
        length = len(ids) + max_tokens
        params.set_search_options(batch_size=1, max_length=length, min_length=length, **sample)
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(np.asarray([ids], dtype=np.int32))
        while not gen.is_done() and not stop.is_set():
            gen.generate_next_token()
            emit(1)
