"""The model's Triton interface, defined once: config.pbtxt is rendered from these tables and
model.py reads requests by the same names.

Text in, text out: tokenization and detokenization happen inside the backend. Every sampling
knob is an optional input, so HTTP `generate` JSON like {"text_input": "...", "max_tokens": 8}
maps onto it directly (Triton turns top-level keys into tensors of dims [1]).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str          # Triton's config enum name, e.g. TYPE_STRING
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    doc: str = ""

    def pbtxt(self) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        optional = ", optional: true" if self.optional else ""
        return f'{{ name: "{self.name}", data_type: {self.data_type}, dims: [ {dims} ]{optional} }}'


INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", optional=False, doc="the prompt, raw text"),
    TensorSpec("max_tokens", "TYPE_INT32", doc="tokens to generate (default 16)"),
    TensorSpec("temperature", "TYPE_FP32", doc="0 = greedy (default 1.0)"),
    TensorSpec("top_p", "TYPE_FP32", doc="nucleus mass in (0, 1]"),
    TensorSpec("top_k", "TYPE_INT32", doc="0 disables"),
    TensorSpec("seed", "TYPE_INT64", doc="same seed, same output, whatever else is in the batch"),
    TensorSpec("stop", "TYPE_STRING", dims=(-1,), doc="stop strings; never returned"),
    TensorSpec("ignore_eos", "TYPE_BOOL", doc="keep generating past the end-of-sequence token"),
    TensorSpec("stream", "TYPE_BOOL", doc="one response per step (default false: one response)"),
)

OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", optional=False, doc="new text (streamed) or all of it"),
    TensorSpec("finish_reason", "TYPE_STRING", optional=False, doc="stop | length | abort; empty until the end"),
    TensorSpec("token_ids", "TYPE_INT32", dims=(-1,), optional=False, doc="the token ids behind text_output"),
    TensorSpec("batch_size", "TYPE_INT32", optional=False,
               doc="sequences in the engine step that produced this response"),
)

# Scalar inputs and the Python type each becomes in SamplingParams.
SAMPLING_SCALARS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int,
                    "seed": int, "ignore_eos": bool}


def pbtxt_list(specs: tuple[TensorSpec, ...]) -> str:
    return ",\n".join(f"  {s.pbtxt()}" for s in specs)
