"""The pass protocol and the runner that times, reports and numerically checks each pass."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

import onnx


class PassCheckError(RuntimeError):
    """A pass changed the graph's numbers beyond its tolerance: the build fails with its name.
    `details`: what the check measured (the build's ladder records it for the rung that failed)."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = dict(details or {})


class QuantCheckError(PassCheckError):
    """The quantization check's gate failed (passes/verify_quant.py): the one failure a build's
    ladder answers with its next rung. Any other pass beyond its tolerance is a bug and ends the build."""


@dataclass
class PassReport:
    name: str
    nodes_before: int
    nodes_after: int
    seconds: float
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    tolerance: float | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class GraphPass(Protocol):
    name: str
    # Max abs error on logits allowed relative to the logits' own max abs value; None: the pass's
    # check decides itself (the quantize check gates on what users see, passes/verify_quant.py).
    rel_tolerance: float | None

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto: ...

    def details(self) -> dict: ...


# check(before, after) -> (max_abs_error, max_rel_error); rel = max abs error / max |logit|.
NumericCheck = Callable[[onnx.ModelProto, onnx.ModelProto], tuple[float, float]]


def run_pass(p: GraphPass, model: onnx.ModelProto, check: NumericCheck | None) -> tuple[onnx.ModelProto, PassReport]:
    before = len(model.graph.node)
    t0 = time.perf_counter()
    out = p.run(model)
    report = PassReport(p.name, before, len(out.graph.node), time.perf_counter() - t0,
                        tolerance=p.rel_tolerance, details=p.details())
    if check is not None:
        report.max_abs_error, report.max_rel_error = check(model, out)
        report.details |= getattr(check, "details", dict)()     # what a check object measured
        if p.rel_tolerance is not None and not report.max_rel_error <= p.rel_tolerance:
            raise PassCheckError(
                f"pass {p.name!r} failed its numeric check: max relative error "
                f"{report.max_rel_error:.3g} > tolerance {p.rel_tolerance:.3g} "
                f"(max abs error {report.max_abs_error:.3g})"
            )
    return out, report
