"""Triton request tensors -> a kiln generation request, and kiln deltas -> Triton replies.

Pure Python over numpy arrays: no Triton import, so all of it is tested without a server.
Every problem is a ValueError whose message goes back to the client as a Triton error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kiln.runtime.outputs import StreamDelta
from kiln.runtime.sampling_params import SamplingParams
from kiln.serving.triton.tensors import SAMPLING_SCALARS

GetInput = Callable[[str], "np.ndarray | None"]   # the input's array, or None when not sent


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool


def parse_request(get_input: GetInput) -> GenerateRequest:
    prompt = _one(get_input, "text_input")
    if prompt is None:
        raise ValueError("text_input is required")
    knobs = {name: cast(value) for name, cast in SAMPLING_SCALARS.items()
             if (value := _one(get_input, name)) is not None}
    stop = get_input("stop")
    if stop is not None:
        knobs["stop"] = tuple(_text(s) for s in stop.reshape(-1))
    stream = _one(get_input, "stream")
    return GenerateRequest(_text(prompt), SamplingParams(**knobs), bool(stream))


def _one(get_input: GetInput, name: str):
    """The single element of a [1] input (any shape with one element is accepted)."""
    array = get_input(name)
    if array is None:
        return None
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text(value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"strings must be UTF-8 ({e})") from None
    return str(value)


@dataclass
class Reply:
    """What one Triton response carries."""
    text: str
    token_ids: list[int]
    finish_reason: str
    batch_size: int
    final: bool

    def arrays(self) -> dict[str, np.ndarray]:
        return {"text_output": np.array([self.text.encode()], dtype=np.object_),
                "finish_reason": np.array([self.finish_reason.encode()], dtype=np.object_),
                "token_ids": np.array(self.token_ids, dtype=np.int32),
                "batch_size": np.array([self.batch_size], dtype=np.int32)}


@dataclass
class ReplyBuilder:
    """Streamed: one reply per delta, the last one final. Not streamed: deltas are collected
    and one final reply carries the whole text (HTTP `generate` expects exactly one)."""
    stream: bool
    _text: list[str] = field(default_factory=list)
    _token_ids: list[int] = field(default_factory=list)

    def on_delta(self, delta: StreamDelta, batch_size: int) -> Reply | None:
        if self.stream:
            return Reply(delta.text, list(delta.token_ids), delta.finish_reason or "", batch_size, delta.finished)
        self._text.append(delta.text)
        self._token_ids.extend(delta.token_ids)
        if not delta.finished:
            return None
        return Reply("".join(self._text), self._token_ids, delta.finish_reason or "", batch_size, True)
