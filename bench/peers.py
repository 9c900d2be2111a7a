"""The peers bench_runtime.py measures kiln against, on the same SmolLM2 weights.

- HF transformers `generate` in fp32, loaded from the same GGUF file kiln builds from.
- ONNX Runtime GenAI (fp32 and int4), built by its own model builder from a plain HF folder that
  is written from that GGUF-loaded model (the builder cannot read a GGUF file).
- OpenVINO GenAI: peer_openvino.py (it runs in an environment of its own).

Every runner answers `generate(prompts, n) -> Run`: greedy, exactly n new tokens per prompt,
timed with perf_counter in this process. Building models is setup, done before any timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Run:
    first_token_s: float | None   # start -> first new token of any sequence; None where not observable
    total_s: float                # start -> all n tokens of every sequence
    token_ids: list[list[int]]    # the new tokens, per prompt

    def decode_tokens_per_s(self) -> float:
        """Single-stream decode rate: tokens after the first over the time after the first."""
        n = len(self.token_ids[0])
        return (n - 1) / (self.total_s - self.first_token_s)

    def aggregate_tokens_per_s(self) -> float:
        return sum(len(t) for t in self.token_ids) / self.total_s


# -- setup: the models ----------------------------------------------------------------------------

def load_hf_gguf():
    """SmolLM2 from the registry GGUF, dequantized by transformers to fp32 (~20 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.compiler.export.presets import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def ensure_hf_folder(out: Path) -> Path:
    """The plain HF folder the peers' builders read, written once from the GGUF-loaded model."""
    if (out / "config.json").is_file():
        return out
    return write_hf_folder(*load_hf_gguf(), out)


def write_hf_folder(model, tokenizer, out: Path) -> Path:
    """A plain HF checkpoint folder with the GGUF model's weights.

    NOTE: save_pretrained refuses a GGUF-loaded model ("quantized with gguf"), so the weights go
    into a fresh model built from the same config without its quantization_config.
    """
    from transformers import AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg)
    plain.load_state_dict(model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def build_genai(hf_dir: Path, out: Path, precision: str, cache: Path) -> Path:
    """Run onnxruntime-genai's model builder (a subprocess: it is setup, not measurement)."""
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
           "-p", precision, "-e", "cpu", "-c", str(cache),
           # Like kiln's logits_index: no LM head over prompt positions (the notes: ~15% faster prefill).
           "--extra_options", "prune_lm_head=true"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai builder failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    tmp.rename(out)
    return out


# -- runners --------------------------------------------------------------------------------------

class HFRunner:
    """transformers `generate`: its streamer times the first token; a batch takes equal-length prompts."""

    name = "HF transformers fp32"

    def __init__(self, model, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.model = model

    def generate(self, prompts: list[list[int]], n: int) -> Run:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("a batch without padding takes equal-length prompts")
        import torch

        clock = _FirstTokenClock()
        ids = torch.tensor(prompts, dtype=torch.long)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, streamer=clock,
                                      pad_token_id=self.model.config.eos_token_id)
        total = time.perf_counter() - t0
        return Run(clock.first - t0, total, out[:, ids.shape[1]:].tolist())


def _FirstTokenClock():
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenClock(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token: stamp the first token."""

        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    return FirstTokenClock()


class GenAIRunner:
    """onnxruntime-genai's Generator: a static batch (equal-length prompts, so no padding)."""

    def __init__(self, model_dir: Path, threads: int, label: str, session_options: dict | None = None):
        import onnxruntime_genai as og

        self.og, self.name = og, f"onnxruntime-genai {label}"
        self.model_dir, self.threads = model_dir, threads
        config = og.Config(str(model_dir))
        # NOTE: the same intra-op thread count as kiln and torch, or the peers are not comparable.
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1, **(session_options or {})}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.model = og.Model(config)

    def generate(self, prompts: list[list[int]], n: int) -> Run:
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1:
            raise ValueError("the static batch takes equal-length prompts")
        length = lengths.pop()
        params = self.og.GeneratorParams(self.model)
        # min_length = max_length: exactly n new tokens, EOS or not, like ignore_eos for kiln.
        params.set_search_options(batch_size=len(prompts), max_length=length + n, min_length=length + n,
                                  do_sample=False)
        gen = self.og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.asarray(prompts, dtype=np.int32))
        gen.generate_next_token()
        first = time.perf_counter() - t0
        while not gen.is_done():
            gen.generate_next_token()
        total = time.perf_counter() - t0
        tokens = [list(map(int, gen.get_sequence(i)[length:])) for i in range(len(prompts))]
        return Run(first, total, tokens)
