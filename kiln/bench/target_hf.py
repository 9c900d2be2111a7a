"""HF transformers as a peer: `generate` one request at a time, its streamer stamping each token."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from kiln.bench.target_peer import Emit, SequentialPeer


def load_hf_model(source: str):
    """transformers' fp32 model for a kiln model source: a preset, a .gguf file or an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.compiler.export import presets

    if source == "smollm2-135m" or source.endswith(".gguf"):
        path = presets.smollm2_gguf_path() if source == "smollm2-135m" else Path(source)
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    if source in presets.TINY_CONFIGS:
        # NOTE: the same seed as the preset kiln builds from, so the weights are the same.
        folder = presets.write_tiny_checkpoint(source, Path(tempfile.mkdtemp(prefix=f"kiln-bench-{source}-")))
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


class HFTarget(SequentialPeer):
    name = "HF transformers generate (sequential)"

    def __init__(self, model, to_ids, context_len: int, temperature: float, threads: int | None = None):
        import torch

        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
        super().__init__(to_ids, context_len, temperature)
        self.model = model

    def generate(self, ids: list[int], max_tokens: int, emit: Emit, stop: threading.Event) -> None:
        import torch
        from transformers import StoppingCriteriaList

        sample = self.temperature > 0
        knobs = dict(do_sample=True, temperature=self.temperature) if sample else dict(do_sample=False)
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            # min_new_tokens = max_new_tokens: the workload's reply length, like ignore_eos for kiln.
            self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, streamer=_TokenStamps(emit),
                                stopping_criteria=StoppingCriteriaList([_Stop(stop)]),
                                pad_token_id=self.model.config.eos_token_id, **knobs)


def _TokenStamps(emit: Emit):
    from transformers.generation.streamers import BaseStreamer

    class TokenStamps(BaseStreamer):
        """generate() puts the prompt first, then each new token: report the tokens."""

        def __init__(self):
            self.prompt_seen = False

        def put(self, value):
            if self.prompt_seen:
                emit(int(value.numel()))
            self.prompt_seen = True

        def end(self):
            pass

    return TokenStamps()


def _Stop(event: threading.Event):
    import torch
    from transformers import StoppingCriteria

    class Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), event.is_set(), dtype=torch.bool)

    return Stop()
