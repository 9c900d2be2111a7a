"""The quantization check: the quantized graph (or engine) against its fp32 input, on real text.

The gate is what a user of the model would notice: whether its greedy answers and its confidence in
real text change. Over two texts, the plain check text (kiln/data/check.txt, its first `max_tokens`
tokens) and, where the model has a chat template, a few conversations rendered in it (chat requests
start with the template's control tokens, whose activations plain text never shows), it measures:
- top-1 agreement: the share of positions whose greedy next token is fp32's;
- the perplexity shift: perplexity / fp32's perplexity - 1 on the same text.
A build fails when either text falls below its mode's top-1 minimum or above its perplexity bound
(QUANT_GATES, one row per mode). The max relative logit error, max |Δlogit| / max |logit|, is
reported but gates nothing: its denominator is one extreme logit, so a large vocabulary, a tied
head's shared table or soft-capped logits move it while no answer changes.
Real text rather than random ids: the agreement of greedy tokens on random ids measures ties
between near-uniform logits, not whether the graph computes the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from kiln.compiler.eval.perplexity import CHECK_TEXT, perplexity_of_logits, text_logits
from kiln.compiler.passes.base import QuantCheckError
from kiln.contract.quant import QuantMode


@dataclass(frozen=True)
class QuantGate:
    min_top1: float                      # share of positions whose greedy token is fp32's
    max_perplexity_increase: float       # perplexity / fp32's perplexity - 1


# The bounds per mode. Top-1: between what the default recipes measured on SmolLM2 and the tiny
# presets over both texts (random weights: near-uniform logits, so argmax ties flip easily; the
# chat text's template tokens most) and what graphs with a linear's scales shuffled measured. Perplexity: above what each mode's recipes cost SmolLM2 on the
# check text (docs/building.md: int8, int4, w8a8 with 7-bit weights), far below what a broken
# linear costs a real model. w8a8 and int4 round harder than int8's blocks of 32, so they get more.
# f16 keeps 11 significant bits of every weight (int8, 8 of a block's largest) and rounds no activation: its
# error changes almost no answer, so its bounds are a small part of int8's; a build that misses them
# has lost more than f16 rounding (the ladder's fp32 rung follows).
QUANT_GATES = {
    QuantMode.NONE: QuantGate(1.0, 0.0),
    QuantMode.F16: QuantGate(0.98, 0.005),
    QuantMode.INT8: QuantGate(0.90, 0.03),
    QuantMode.INT4: QuantGate(0.60, 0.10),
    QuantMode.W8A8: QuantGate(0.80, 0.12),
}

# Conversations the chat text renders in the model's own template.
CHECK_CHAT = [
    [{"role": "user", "content": "What is the capital of France, and what river runs through it?"},
     {"role": "assistant", "content": "The capital of France is Paris. The Seine runs through the city."}],
    [{"role": "user", "content": "Give me three tips for keeping a small vegetable garden healthy."},
     {"role": "assistant", "content": "Water early in the morning, mulch the soil to keep it moist, and rotate "
                                      "your crops each year so pests do not settle in."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."},
     {"role": "assistant", "content": "def square(x):\n    return x * x"}],
]
CHAT_TEXT = "chat: kiln's check conversations in the model's template"


def check_token_ids(tokenizer_dir: Path, max_tokens: int, text_path: Path = CHECK_TEXT) -> list[int]:
    from kiln.compiler.eval.perplexity import text_token_ids

    return text_token_ids(tokenizer_dir, text_path)[:max_tokens]


def chat_check_ids(tokenizer_dir: Path, max_tokens: int) -> list[int]:
    """CHECK_CHAT rendered in the model's chat template, one after the other; none without a template."""
    from kiln.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_dir)
    if not tokenizer.chat_template:
        return []
    ids = [t for chat in CHECK_CHAT for t in tokenizer.encode_chat(chat, add_generation_prompt=False)]
    return ids[:max_tokens]


class CheckTexts:
    """A build's check texts (token ids) and fp32's logits over them, computed once: every rung of the
    ladder is held to the same fp32 reference (the graphs before quantization differ between rungs
    only by fusions, each checked against the export within a tight tolerance)."""

    def __init__(self, token_ids: list[int], chat_ids: list[int]):
        self.token_ids, self.chat_ids = token_ids, chat_ids
        self._fp32: list[np.ndarray] | None = None
        self.perplexities: dict[int, float] = {}      # fp32's, by text index

    def check(self, pass_name: str, mode: QuantMode) -> "QuantCheck":
        return QuantCheck.for_mode(pass_name, mode, self.token_ids, self.chat_ids, references=self)

    def fp32_logits(self, model: onnx.ModelProto, texts: list[list[int]]) -> list[np.ndarray]:
        if self._fp32 is None:
            self._fp32 = [text_logits(model, ids) for ids in texts]
        return self._fp32


class QuantCheck:
    """check(fp32, quantized) for run_pass; `details()` holds what it measured for the report."""

    def __init__(self, pass_name: str, token_ids: list[int], min_top1: float, text: str = "kiln/data/check.txt",
                 max_perplexity_increase: float = math.inf, chat_ids: list[int] = (),
                 references: CheckTexts | None = None):
        if len(token_ids) < 2:
            raise ValueError("the quantization check needs at least two tokens of text")
        self.pass_name, self.token_ids, self.min_top1, self.text = pass_name, token_ids, min_top1, text
        self.max_perplexity_increase = max_perplexity_increase
        self.chat_ids = list(chat_ids) if len(chat_ids) >= 2 else []
        self.references = references           # where fp32's logits are kept across checks (None: computed here)
        self._details: dict = {}

    @classmethod
    def for_mode(cls, pass_name: str, mode: QuantMode, token_ids: list[int], chat_ids: list[int] = (),
                 references: CheckTexts | None = None) -> "QuantCheck":
        gate = QUANT_GATES[mode]
        return cls(pass_name, token_ids, gate.min_top1, max_perplexity_increase=gate.max_perplexity_increase,
                   chat_ids=chat_ids, references=references)

    def texts(self) -> list[list[int]]:
        """The token sequences the check runs, the plain text first."""
        return [self.token_ids] + ([self.chat_ids] if self.chat_ids else [])

    def fp32_logits(self, fp32: onnx.ModelProto) -> list[np.ndarray]:
        """fp32's logits over texts(), from the build's references where it keeps them."""
        if self.references is not None:
            return self.references.fp32_logits(fp32, self.texts())
        return [text_logits(fp32, ids) for ids in self.texts()]

    def __call__(self, before: onnx.ModelProto, after: onnx.ModelProto) -> tuple[float, float]:
        refs = self.fp32_logits(before)
        gots = refs if after is before else [text_logits(after, ids) for ids in self.texts()]
        return self.compare(refs, gots)

    def compare(self, refs: list[np.ndarray] | np.ndarray, gots: list[np.ndarray] | np.ndarray) -> tuple[float, float]:
        """fp32 logits against the quantized ones over each of texts() (one array: the plain text
        alone): (max abs, max relative error), reported; raises where a text fails its gate. Also
        for engines that quantize weights themselves (the openvino backend), fed from the engine."""
        refs, gots = ([refs], [gots]) if isinstance(refs, np.ndarray) else (refs, gots)
        errors = [float(np.abs(g - r).max()) for r, g in zip(refs, gots)]
        err = max(errors)
        rel = max(e / max(float(np.abs(r).max()), 1e-12) for e, r in zip(errors, refs))
        figures = [self._figures(r, g, ids, i) for i, (r, g, ids) in enumerate(zip(refs, gots, self.texts()))]
        self._details = {"check_text": self.text, "check_tokens": len(self.token_ids), **figures[0],
                         "min_top1_agreement": self.min_top1, "max_rel_logit_error": rel}
        if math.isfinite(self.max_perplexity_increase):
            self._details["max_perplexity_increase"] = self.max_perplexity_increase
        if len(figures) > 1:
            self._details["chat"] = {"text": CHAT_TEXT, "tokens": len(self.chat_ids), **figures[1]}
        for name, f in zip((f"{len(self.token_ids)} tokens of {self.text}", f"{len(self.chat_ids)} tokens of "
                            "chat in the model's template"), figures):
            self._gate(name, f, rel)
        return err, rel

    def _figures(self, ref: np.ndarray, got: np.ndarray, ids: list[int], index: int) -> dict:
        kept = self.references.perplexities if self.references is not None else {}
        if index not in kept:
            kept[index] = perplexity_of_logits(ref, ids)
        ppl_ref = kept[index]
        ppl = ppl_ref if got is ref else perplexity_of_logits(got, ids)
        return {"top1_agreement": float(np.mean(ref.argmax(-1) == got.argmax(-1))), "perplexity_fp32": ppl_ref,
                "perplexity": ppl, "perplexity_increase": ppl / ppl_ref - 1}

    def _gate(self, text: str, f: dict, rel: float) -> None:
        where = f"pass {self.pass_name!r} failed its numeric check"
        logit = f"max relative logit error {rel:.3g}, reported"
        if not f["top1_agreement"] >= self.min_top1:
            raise QuantCheckError(f"{where}: top-1 agreement with fp32 {f['top1_agreement']:.3f} < {self.min_top1:.3f} "
                                 f"over {text} ({logit})", self._details)
        if not f["perplexity_increase"] <= self.max_perplexity_increase:
            raise QuantCheckError(f"{where}: perplexity {f['perplexity_increase']:+.2%} over fp32's > "
                                 f"{self.max_perplexity_increase:+.0%} over {text} ({logit})", self._details)

    def details(self) -> dict:
        return dict(self._details)
