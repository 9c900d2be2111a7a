"""OpenVINO GenAI as a peer: its continuous-batching pipeline (native CPU paged attention).

Runs in the environment bench/setup_peers.sh makes (optimum-intel needs transformers<5.6; kiln
runs on 5.x), so this module imports nothing from kiln. The model is exported by optimum-intel
from the same plain HF folder onnxruntime-genai's builder reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench.peers import Run

# optimum-cli --weight-format per precision. SmolLM2's widths (576) are not multiples of the
# default int4 group size 128: group 32, every layer in 4 bit, symmetric.
EXPORT_FLAGS = {"fp32": ["--weight-format", "fp32"], "int8": ["--weight-format", "int8"],
                "int4": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0", "--sym"]}


def export_openvino(hf_dir: Path, out: Path, precision: str) -> Path:
    """optimum-intel's exporter, once per precision (setup, not measurement)."""
    if (out / "openvino_model.xml").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    cli = Path(sys.executable).parent / "optimum-cli"
    cmd = [str(cli), "export", "openvino", "-m", str(hf_dir), "--task", "text-generation-with-past",
           *EXPORT_FLAGS[precision], str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", **os.environ})
    if done.returncode != 0:
        raise RuntimeError(f"optimum-cli export failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    tmp.rename(out)
    return out


class OpenVINORunner:
    """ContinuousBatchingPipeline stepped from here: every prompt is one request of one batch."""

    def __init__(self, model_dir: Path, threads: int, label: str):
        import openvino_genai as ov_genai

        self.ov_genai, self.name = ov_genai, f"OpenVINO GenAI {label}"
        sc = ov_genai.SchedulerConfig()
        # NOTE: prefix caching off (repetitions resend the same prompts); 1 GB of KV is ample here.
        sc.cache_size, sc.enable_prefix_caching = 1, False
        sc.max_num_seqs, sc.max_num_batched_tokens = 64, 2048
        # NOTE: the same intra-op thread count as kiln and the other peers, or they are not comparable.
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(model_dir), sc, "CPU",
                                                        {"INFERENCE_NUM_THREADS": threads})
        self._ids = 0

    def generate(self, prompts: list[list[int]], n: int) -> Run:
        import openvino as ov

        config = self._greedy(n)
        t0 = time.perf_counter()
        handles = [self.pipe.add_request(self._next_id(), ov.Tensor(np.asarray([p], dtype=np.int64)), config)
                   for p in prompts]
        tokens, first = [[] for _ in prompts], None
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            for out, h in zip(tokens, handles):
                if h.can_read():
                    out += [t for g in h.read().values() for t in g.generated_ids]
            if first is None and any(tokens):
                first = time.perf_counter() - t0
        return Run(first, time.perf_counter() - t0, tokens)

    def _greedy(self, n: int):
        # Exactly n new tokens, EOS or not, like kiln's ignore_eos.
        config = self.ov_genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = n
        config.ignore_eos, config.do_sample = True, False
        return config

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids
