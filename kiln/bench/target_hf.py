"""HF transformers as a peer: `generate` one request at a time (it has no in-flight batching), on a
worker thread, its streamer stamping each new token. Requests that arrive while one runs wait,
as they would behind a server built on `generate`; that wait is part of their TTFT."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from pathlib import Path
from typing import AsyncIterator, Callable

from kiln.bench.records import Chunk
from kiln.bench.text import Prompt
from kiln.bench.workloads import RequestSpec

_DONE = object()


def load_hf_model(source: str):
    """transformers' fp32 model for a kiln model source: a preset, a .gguf file or an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.export import presets

    if source == "smollm2-135m" or source.endswith(".gguf"):
        path = presets.smollm2_gguf_path() if source == "smollm2-135m" else Path(source)
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    if source in presets.TINY_CONFIGS:
        # NOTE: the same seed as the preset kiln builds from, so the weights are the same.
        folder = presets.write_tiny_checkpoint(source, Path(tempfile.mkdtemp(prefix=f"kiln-bench-{source}-")))
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


class HFTarget:
    def __init__(self, model, to_ids: Callable[[Prompt], list[int]], context_len: int, temperature: float,
                 threads: int | None = None):
        import torch

        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
        self.model, self.to_ids, self.temperature = model, to_ids, temperature
        self.context_len, self.name = context_len, "HF transformers generate (sequential)"
        self._lock = asyncio.Lock()

    async def prepare(self) -> None:
        await asyncio.to_thread(self._generate, [1, 2, 3], 2, lambda n: None, threading.Event())

    def observer(self, interval: float):
        from kiln.bench.observe import Observer

        return Observer(interval)

    async def stream(self, prompt: Prompt, spec: RequestSpec) -> AsyncIterator[Chunk]:
        loop, inbox, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        ids = self.to_ids(prompt)
        emit = (lambda n: loop.call_soon_threadsafe(inbox.put_nowait, n))
        async with self._lock:
            job = asyncio.ensure_future(asyncio.to_thread(self._generate, ids, spec.max_tokens, emit, stop))
            try:
                while (item := await inbox.get()) is not _DONE:
                    yield Chunk(num_tokens=item)
                await job                       # re-raises a failure of generate
            finally:
                stop.set()                      # a client that went away stops generate at its next token
                await asyncio.shield(asyncio.wait([job]))

    async def close(self) -> None:
        pass

    def _generate(self, ids: list[int], max_tokens: int, emit, stop: threading.Event) -> None:
        import torch
        from transformers import StoppingCriteriaList

        sample = self.temperature > 0
        knobs = dict(do_sample=True, temperature=self.temperature) if sample else dict(do_sample=False)
        x = torch.tensor([ids], dtype=torch.long)
        try:
            with torch.inference_mode():
                # min_new_tokens = max_new_tokens: the workload's reply length, like ignore_eos for kiln.
                self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, streamer=_TokenStamps(emit),
                                    stopping_criteria=StoppingCriteriaList([_Stop(stop)]),
                                    pad_token_id=self.model.config.eos_token_id, **knobs)
        finally:
            emit(_DONE)


def _TokenStamps(emit):
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
