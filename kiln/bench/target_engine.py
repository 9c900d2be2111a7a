"""An artifact run in this process: kiln's LLM.stream (the engine steps on its own thread)."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import AsyncIterator

from kiln.bench.records import Chunk
from kiln.bench.text import ExactCounter, Prompt
from kiln.bench.workloads import RequestSpec


class EngineTarget:
    def __init__(self, llm, endpoint: str = "chat", temperature: float = 1.0, name: str | None = None):
        self.llm, self.endpoint, self.temperature = llm, endpoint, temperature
        self.name = name or f"kiln {Path(llm.artifact.path).name} (in-process)"
        self.context_len = llm.core.scheduler.config.max_model_len
        self.counter = ExactCounter(llm.tokenizer.fast)

    @classmethod
    def load(cls, artifact: Path, runtime_config, **kw) -> "EngineTarget":
        from kiln.runtime.llm import LLM

        return cls(LLM(artifact, runtime_config), **kw)

    async def prepare(self) -> ExactCounter:
        """A warm-up request (the first engine calls pay one-off costs), then the exact counter."""
        from kiln.bench.structured import structured_output
        from kiln.runtime.sampling_params import SamplingParams

        async with aclosing(self.llm.stream("Hello", SamplingParams(max_tokens=2, temperature=0))) as deltas:
            async for _ in deltas:
                pass
        return self.counter

    def observer(self, interval: float):
        from kiln.bench.observe import EngineObserver

        return EngineObserver(self.llm.client, interval)

    def prompt_input(self, prompt: Prompt):
        return self.llm.chat_prompt(prompt.as_messages()) if self.endpoint == "chat" else prompt.as_text()

    async def stream(self, prompt: Prompt, spec: RequestSpec) -> AsyncIterator[Chunk]:
        from kiln.bench.structured import structured_output
        from kiln.runtime.sampling_params import SamplingParams

        # ignore_eos: reply lengths are the workload's, as the HTTP target asks of a server.
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=self.temperature, ignore_eos=True,
                                structured=structured_output() if spec.json_schema else None)
        # aclosing: when our caller abandons us, LLM.stream is closed too, which aborts the request.
        async with aclosing(self.llm.stream(self.prompt_input(prompt), params)) as deltas:
            async for d in deltas:
                yield Chunk(text=d.text, num_tokens=len(d.token_ids))

    async def close(self) -> None:
        self.llm.shutdown()
