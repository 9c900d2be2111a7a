"""The quantize pass's check: the quantized graph against its fp32 input, on a real text.

One forward pass of each graph over the check text (kiln/data/check.txt, the first `max_tokens`
tokens, batch 1) gives three numbers:
- top-1 agreement: the share of positions whose greedy next token is the same in both graphs.
  Below the mode's stated minimum the build fails with the pass's name;
- logit error: max |Δlogit| / max |logit| — returned as the pass's relative error, so run_pass holds
  it to QuantizePass.rel_tolerance;
- perplexity of both graphs on the text, recorded in the pass report and the manifest (a quality
  figure, not a pass/fail criterion: a random-weight test model has no meaningful perplexity).
Real text rather than random ids: the agreement of greedy tokens on random ids measures ties
between near-uniform logits, not whether the graph computes the same function.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from kiln.compiler.eval.perplexity import CHECK_TEXT, perplexity_of_logits, text_logits
from kiln.compiler.passes.base import PassCheckError


def check_token_ids(tokenizer_dir: Path, max_tokens: int, text_path: Path = CHECK_TEXT) -> list[int]:
    from kiln.compiler.eval.perplexity import text_token_ids

    return text_token_ids(tokenizer_dir, text_path)[:max_tokens]


class QuantCheck:
    """check(fp32, quantized) for run_pass; `details()` holds what it measured for the report."""

    def __init__(self, pass_name: str, token_ids: list[int], min_top1: float, text: str = "kiln/data/check.txt"):
        if len(token_ids) < 2:
            raise ValueError("the quantization check needs at least two tokens of text")
        self.pass_name, self.token_ids, self.min_top1, self.text = pass_name, token_ids, min_top1, text
        self._details: dict = {}

    def __call__(self, before: onnx.ModelProto, after: onnx.ModelProto) -> tuple[float, float]:
        ref = text_logits(before, self.token_ids)
        return self.compare(ref, ref if after is before else text_logits(after, self.token_ids))

    def compare(self, ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
        """fp32 logits against the quantized ones over the check text: (max abs, max relative error);
        raises when top-1 agreement is below the minimum. Also for engines that quantize weights
        themselves (the openvino backend), fed from the compiled engine."""
        top1 = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
        err = float(np.abs(got - ref).max())
        rel = err / max(float(np.abs(ref).max()), 1e-12)
        self._details = {"check_text": self.text, "check_tokens": len(self.token_ids),
                         "top1_agreement": top1, "min_top1_agreement": self.min_top1,
                         "perplexity_fp32": perplexity_of_logits(ref, self.token_ids),
                         "perplexity": perplexity_of_logits(got, self.token_ids)}
        if not top1 >= self.min_top1:
            raise PassCheckError(f"pass {self.pass_name!r} failed its numeric check: top-1 agreement with fp32 "
                                 f"{top1:.3f} < {self.min_top1:.3f} over {len(self.token_ids)} tokens of "
                                 f"{self.text} (max relative logit error {rel:.3g})")
        return err, rel

    def details(self) -> dict:
        return dict(self._details)
