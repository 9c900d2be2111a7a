"""The build's fallback ladder (kiln.compiler.resolve.fallbacks, kiln.compiler.build): a default build
whose recipe fails the quantization check moves to the next rung, says so, and records every rung
tried; an explicit --quant / --backend fails instead, naming the next rung. The check's gate
(passes/verify_quant.py) decides on top-1 agreement and perplexity, not on the logit error.

The recipes are made to fail on purpose: every linear's scales scrambled after the quantize pass
(test_quant_checks.py's breaker), or a gate no int8 engine meets. The tiny presets are too small
for --quant auto to quantize, so these tests lower the size threshold (defaults.SMALL_MODEL_PARAMS)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

import kiln.compiler.build
import kiln.compiler.defaults
import kiln.compiler.passes.verify_quant as verify_quant
from kiln.compiler.build import build
from kiln.compiler.passes.base import PassCheckError
from kiln.compiler.passes.verify_quant import QuantCheck, QuantGate
from kiln.compiler.passes.quant_settings import QuantSettings
from kiln.compiler.plan import BuildHost
from kiln.config import BuildConfig
from kiln.contract.quant import QuantMode
from test_quant_checks import BrokenQuantize, scrambled_scales

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None


class ScrambledQuantize(BrokenQuantize):
    """What the build makes from its plan's recipe, with every quantized linear's scales scrambled."""

    def __init__(self, settings: QuantSettings, calibration_ids: list[int] | None = None):
        super().__init__(settings, scrambled_scales, calibration_ids)


class Stages:
    """A build's stage names, in order (the lines `kiln build` prints)."""

    def __init__(self):
        self.names: list[str] = []

    def __call__(self, name: str):
        from contextlib import nullcontext

        self.names.append(name)
        return nullcontext()

    def text(self) -> str:
        return "\n".join(self.names)


@pytest.fixture
def auto_quantizes_tiny(monkeypatch):
    monkeypatch.setattr(kiln.compiler.defaults, "SMALL_MODEL_PARAMS", 0)


@pytest.fixture
def scrambled(monkeypatch):
    monkeypatch.setattr(kiln.compiler.build, "QuantizePass", ScrambledQuantize)


def ort_host(probe=BuildHost.probe) -> BuildHost:
    """This machine without openvino: --backend auto picks ort, whose quantize pass kiln runs."""
    return replace(probe(), openvino=False, openvino_ops=False)


def ladder_of(path) -> list[dict]:
    return json.loads((path / "manifest.json").read_text())["plan"]["ladder"]


def test_a_failing_default_recipe_falls_back_to_the_next_rung_and_says_so(tmp_path, auto_quantizes_tiny, scrambled):
    stages = Stages()
    path = build(BuildConfig(source="tiny-llama", out=tmp_path / "art"), stage=stages, host=ort_host())
    first, chosen = ladder_of(path)
    assert first["rung"] == "primary" and not first["passed"] and first["backend"] == "ort"
    assert "top-1 agreement with fp32" in first["failure"] and first["figures"]["top1_agreement"] < 0.9
    # tiny-llama has two layers: the sensitive rung keeps every linear, the head and the table fp32
    assert chosen["rung"] == "ort int8, the LM head, embedding and layers 0, 1 fp32" and chosen["passed"]
    assert chosen["figures"]["top1_agreement"] == 1.0 and chosen["figures"]["chat"]["top1_agreement"] == 1.0
    said = stages.text()
    assert "rung primary: failed the check (text: top-1 0." in said
    assert "the next rung: ort int8, the LM head, embedding and layers 0, 1 fp32" in said
    assert "rung ort int8, the LM head, embedding and layers 0, 1 fp32: passed the check" in said
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["plan"]["rung"] == chosen["rung"] and manifest["plan"]["recipe"]["fp32_layers"] == [0, 1]
    assert "the rung before failed the build's check" in manifest["choices"]["backend"]["reason"]


def test_kiln_inspect_shows_the_rungs_tried(tmp_path, auto_quantizes_tiny, scrambled):
    from kiln.cli import main

    path = build(BuildConfig(source="tiny-llama", out=tmp_path / "art"), host=ort_host())
    res = CliRunner().invoke(main, ["inspect", str(path)], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert "rungs tried" in res.output and "failed" in res.output and "passed: chosen" in res.output
    assert "top-1 agreement with fp32" in res.output               # why the first rung was left


@pytest.mark.parametrize("flags, named", [
    (dict(quant=QuantMode.INT8, backend="ort"), "ort int8, the LM head, embedding and layers 0, 1 fp32, changes what "
                                                "you asked for: `kiln build` without --quant and --backend tries it"),
    (dict(quant=QuantMode.INT8), "ort int8, the LM head"),
    (dict(quant=QuantMode.INT4, backend="ort"), "ort int8 (kiln.MatMulQ8, blocks of 32), changes what you asked for: "
                                                "`--backend ort --quant int8`"),
])
def test_an_explicit_flag_that_fails_names_the_next_rung(tmp_path, scrambled, flags, named):
    with pytest.raises(PassCheckError, match="top-1 agreement with fp32") as failed:
        build(BuildConfig(source="tiny-llama", out=tmp_path / "art", **flags), host=ort_host())
    assert f"the next rung of kiln's ladder, {named}" in str(failed.value)
    assert not (tmp_path / "art").exists()


def test_the_cli_says_the_next_rung_when_an_explicit_build_fails(tmp_path, scrambled):
    from kiln.cli import main

    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(tmp_path / "art"), "--quant", "int4",
                                    "--backend", "ort"])
    assert res.exit_code == 1 and "the next rung of kiln's ladder" in res.output
    assert "--backend ort --quant int8" in res.output


def unmeetable(monkeypatch, *modes: QuantMode) -> None:
    """Gates no engine at `modes` meets (top-1 above 1: fp32 itself would fail them)."""
    gates = dict(verify_quant.QUANT_GATES)
    gates.update({mode: QuantGate(1.01, gates[mode].max_perplexity_increase) for mode in modes})
    monkeypatch.setattr(verify_quant, "QUANT_GATES", gates)


@pytest.mark.skipif(not HAS_OPENVINO, reason="the default ladder here starts on openvino")
def test_a_gate_no_int8_engine_meets_stops_at_the_f16_rung(tmp_path, auto_quantizes_tiny, monkeypatch):
    from kiln.cli import main

    unmeetable(monkeypatch, QuantMode.INT8)
    stages = Stages()
    path = build(BuildConfig(source="tiny-llama", out=tmp_path / "art"), stage=stages)
    rungs = ladder_of(path)
    assert [r["passed"] for r in rungs] == [False] * (len(rungs) - 1) + [True]
    assert [r["quant"] for r in rungs[:-1]] == ["int8"] * (len(rungs) - 1)          # every int8 rung was tried
    assert rungs[-2]["rung"] == "ort int8, the LM head, embedding and layers 0, 1 fp32"
    assert (rungs[-1]["rung"], rungs[-1]["backend"], rungs[-1]["quant"]) == ("openvino f16 weights", "openvino", "f16")
    gate = verify_quant.QUANT_GATES[QuantMode.F16]
    for figures in (rungs[-1]["figures"], rungs[-1]["figures"]["chat"]):
        assert figures["top1_agreement"] >= gate.min_top1 and figures["perplexity_increase"] <= gate.max_perplexity_increase
    assert "the next rung: openvino f16 weights" in stages.text()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["quant"]["mode"] == "f16" and manifest["choices"]["quant"]["chosen_by"] == "auto"
    assert manifest["plan"]["rung"] == "openvino f16 weights" and manifest["engines"][0]["options"]["weights"] == "f16"
    res = CliRunner().invoke(main, ["inspect", str(path)], terminal_width=400)
    assert res.exit_code == 0 and "openvino f16 weights" in res.output and "passed: chosen" in res.output


@pytest.mark.skipif(not HAS_OPENVINO, reason="the default ladder here starts on openvino")
def test_a_gate_no_int8_or_f16_engine_meets_climbs_the_whole_ladder_to_fp32(tmp_path, auto_quantizes_tiny,
                                                                             monkeypatch):
    unmeetable(monkeypatch, QuantMode.INT8, QuantMode.F16)
    stages = Stages()
    path = build(BuildConfig(source="tiny-llama", out=tmp_path / "art"), stage=stages)
    rungs = ladder_of(path)
    assert [r["passed"] for r in rungs] == [False] * (len(rungs) - 1) + [True]
    assert [(r["rung"], r["quant"]) for r in rungs][-2:] == [("openvino f16 weights", "f16"), ("ort fp32", "none")]
    assert [r["backend"] for r in rungs][-4:] == ["ort", "ort", "openvino", "ort"] and rungs[0]["backend"] == "openvino"
    assert all(f"rung {r['rung']}: " in stages.text() for r in rungs)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["quant"]["mode"] == "none" and manifest["choices"]["quant"]["chosen_by"] == "auto"


@pytest.mark.skipif(not HAS_OPENVINO, reason="f16 weights build on openvino")
def test_an_explicit_f16_build_that_fails_names_the_fp32_rung(tmp_path, monkeypatch):
    unmeetable(monkeypatch, QuantMode.F16)
    with pytest.raises(PassCheckError, match="the next rung of kiln's ladder, ort fp32, changes what you asked for: "
                                             "`--quant none --backend ort`"):
        build(BuildConfig(source="tiny-llama", out=tmp_path / "art", quant=QuantMode.F16))
    assert not (tmp_path / "art").exists()


# The gate, on logits made up to look like each case (vocabulary of V, T positions).
V, T = 4096, 64


def made_up_logits(seed: int = 0, margin: float = 4.0) -> tuple[np.ndarray, list[int]]:
    """Logits with a clear top token per position, and the text: each position's top token next."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1, (T, V)).astype(np.float32)
    top = rng.integers(0, V, T)
    logits[np.arange(T), top] += margin
    return logits, [int(rng.integers(0, V))] + top[:-1].tolist()


def test_the_gate_passes_a_large_logit_error_that_changes_no_answer():
    """One extreme logit (a soft-capped or large-vocabulary head's outlier) moved far: the relative
    logit error is large, the greedy tokens and the perplexity stay, and the check passes."""
    ref, ids = made_up_logits()
    got = ref.copy()
    got[:, -1] -= 0.5 * np.abs(ref).max()             # a token nobody predicts, moved a lot
    check = QuantCheck.for_mode("quantize", QuantMode.INT8, ids)
    err, rel = check.compare(ref, got)
    assert rel > 0.15 and check.details()["max_rel_logit_error"] == rel     # reported
    assert check.details()["top1_agreement"] == 1.0


def test_the_gate_fails_changed_answers_and_a_perplexity_shift():
    ref, ids = made_up_logits()
    flipped = ref.copy()
    flipped[np.arange(0, T, 4), 0] = ref.max() + 1            # a quarter of the answers change
    with pytest.raises(PassCheckError, match="top-1 agreement with fp32 0.750 < 0.900") as failed:
        QuantCheck.for_mode("quantize", QuantMode.INT8, ids).compare(ref, flipped)
    assert failed.value.details["top1_agreement"] == 0.75          # the figures travel with the failure
    flatter = ref * 0.8                                            # same answers, less sure of the text
    with pytest.raises(PassCheckError, match=r"perplexity \+\d+\.\d+% over fp32's > \+3%"):
        QuantCheck.for_mode("quantize", QuantMode.INT8, ids).compare(ref, flatter)


def test_the_gate_checks_the_chat_text_too():
    ref, ids = made_up_logits()
    chat_ref, chat_ids = made_up_logits(seed=1)
    chat_got = chat_ref.copy()
    chat_got[:, 0] = chat_ref.max() + 1                            # every chat answer changes
    check = QuantCheck.for_mode("quantize", QuantMode.INT8, ids, chat_ids)
    with pytest.raises(PassCheckError, match="over 64 tokens of chat in the model's template"):
        check.compare([ref, chat_ref], [ref, chat_got])
    assert check.details()["top1_agreement"] == 1.0 and check.details()["chat"]["top1_agreement"] < 0.1


def test_kiln_build_prints_each_rung_with_its_figures(tmp_path, auto_quantizes_tiny, scrambled, monkeypatch):
    from kiln.cli import main

    monkeypatch.setattr(BuildHost, "probe", staticmethod(ort_host))        # what `kiln build` reads
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(tmp_path / "art")], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert "rung primary: failed the check (text: top-1 0." in res.output and "max rel logit error" in res.output
    assert "the next rung: ort int8, the LM head, embedding and layers 0, 1 fp32" in res.output
    assert "layers 0, 1 fp32: passed the check (text: top-1 1.000, perplexity +0.00%" in res.output


def test_a_pass_that_breaks_the_graph_ends_the_build_without_climbing(tmp_path, auto_quantizes_tiny, monkeypatch):
    """Only the quantization check's gate moves the build to the next rung: a fusion or cleanup
    beyond its tolerance is a bug, which no rung would fix."""
    from kiln.compiler.passes.base import QuantCheckError

    monkeypatch.setattr(kiln.compiler.build, "compare_logits", lambda before, after: (1.0, 1.0))
    stages = Stages()
    with pytest.raises(PassCheckError, match="pass 'cleanup' failed its numeric check") as failed:
        build(BuildConfig(source="tiny-llama", out=tmp_path / "art"), stage=stages, host=ort_host())
    assert not isinstance(failed.value, QuantCheckError) and "next rung" not in stages.text()
