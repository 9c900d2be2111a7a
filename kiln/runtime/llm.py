"""The Python API: LLM(artifact).generate(...) for batches, .stream(...) for async token streams."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator

from kiln.contract.artifact import EngineArtifact
from kiln.config import RuntimeConfig
from kiln.runtime.engine_client import EngineClient
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.frontend import Frontend, Prompt
from kiln.runtime.outputs import CompletionOutput, OutputProcessor, StreamDelta
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer


class LLM(Frontend):
    def __init__(self, artifact: str | Path | EngineArtifact | None = None, config: RuntimeConfig | None = None,
                 *, model: str | Path | None = None):
        """model: vLLM's name for the artifact (LLM(model="engines/smollm2"))."""
        if (artifact is None) == (model is None):
            raise TypeError("give the artifact folder once: LLM(artifact) or LLM(model=artifact)")
        artifact = artifact if model is None else model
        verifying = None
        if isinstance(artifact, EngineArtifact):
            self.artifact = artifact
        else:
            # NOTE: the files hash while the engine loads (both mostly outside the GIL); a mismatch
            # raises here, before anything can be served.
            self.artifact, verifying = EngineArtifact.load_verifying(artifact)
        # NOTE: the tokenizer loads on a thread while the engine loads (the engine's import holds
        # no GIL): both are on a server start's path.
        with ThreadPoolExecutor(1, thread_name_prefix="kiln-tokenizer") as pool:
            tokenizer = pool.submit(Tokenizer, self.artifact.tokenizer_dir)
            self.core = EngineCore(self.artifact, config or RuntimeConfig())
            if verifying is not None:
                verifying.result()
            super().__init__(self.artifact, tokenizer.result())
        self.outputs = OutputProcessor(self.tokenizer)
        self._client: EngineClient | None = None
        self._client_lock = threading.Lock()

    # -- the engine client: the one loop that steps the core -------------------------------
    @property
    def client(self) -> EngineClient:
        """Created on first use; generate(), stream() and the servers all go through it."""
        with self._client_lock:
            if self._client is None:
                self._client = EngineClient(self)
            return self._client

    # -- batch API ----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Run all prompts to completion in one in-flight batch; outputs in prompt order.
        Safe alongside stream() and other generate() calls: they all join the same batch."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        return self.client.complete([self.make_request(p, sp) for p, sp in zip(prompts, params_list)])

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None
             ) -> list[CompletionOutput]:
        """One conversation (a list of messages) or many (a list of them), as vLLM takes them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.chat_prompt(c) for c in conversations], params)

    # -- streaming API ------------------------------------------------------------------------
    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[StreamDelta]:
        return self.client.stream(self.make_request(prompt, params or SamplingParams()))

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.shutdown()


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], int)
