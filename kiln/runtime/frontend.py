"""What a front end needs of a model besides its engine: the artifact, its tokenizer, and requests
made from prompts (tokenized, their output constraint bound to the tokenizer).

`LLM` is a Frontend whose engine runs on a thread of this process; `EngineProcess`
(kiln/runtime/engine_process.py) is one whose engine runs in a process of its own.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from kiln.contract.artifact import EngineArtifact
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.structured import bind_params
from kiln.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class Frontend:
    def __init__(self, artifact: EngineArtifact, tokenizer: Tokenizer):
        self.artifact, self.tokenizer = artifact, tokenizer
        self._ids = itertools.count()

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Any thread (the HTTP server's among them): it reads the artifact, never the engine core."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        eos = self.eos_token_ids
        params = self.bind(params)
        return Request(request_id or f"req-{next(self._ids)}", ids, params, eos_token_id=eos[0] if eos else None,
                       extra_eos_token_ids=tuple(eos[1:]))

    def bind(self, params: SamplingParams) -> SamplingParams:
        """The params with their output constraint (if any) compiled for this tokenizer; raises
        GrammarError (a ValueError) for a constraint the grammar engine refuses."""
        return bind_params(params, self.tokenizer, self.artifact.manifest.spec.vocab_size, self.eos_token_ids)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.artifact.manifest.generation.get("eos_token_ids") or []

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages)
