"""A model whose fp32 graph is over protobuf's 2 GiB limit builds (weights as external data through
the build, model.onnx.data in the artifact) and generates what transformers generates.

The checkpoint is the smallest synthetic Llama past the limit (scripts/make_synthetic_llama.py
over-2gib: 566M parameters, 6 layers, a 2.26 GB fp32 graph), at unit scale so greedy decoding
has clear margins. Built once; about three minutes on two cores, ~5 GB peak.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kiln.contract.quant import QuantMode
from token_agreement import TOP_K, assert_all_close, logits_top

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROTOBUF_LIMIT = 2**31
MAX_NEW = 8


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, k).tolist() for k in (5, 23)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic") / "llama-over-2gib"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_llama.py"), "over-2gib", str(out),
                    "--weights", "unit"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def hf_tokens(checkpoint) -> list[tuple[list[int], list[dict]]]:
    """transformers' greedy continuations on the same bf16 weights, in fp32 (freed before the build),
    with each step's top-k logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in _prompts():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=256,
                                 output_logits=True, return_dict_in_generate=True)
            out.append((gen.sequences[0, len(prompt):].tolist(), [logits_top(s[0].numpy()) for s in gen.logits]))
    return out


@pytest.fixture(scope="module")
def artifact(checkpoint, hf_tokens, tmp_path_factory) -> Path:
    from kiln.compiler.build import build
    from kiln.config import BuildConfig

    # fp32 on ort, named: the defaults would quantize a model this size to int8 (and pick openvino)
    return build(BuildConfig(source=str(checkpoint), out=tmp_path_factory.mktemp("built") / "over-2gib",
                             quant=QuantMode.NONE, backend="ort"))


def test_graph_is_over_the_protobuf_limit_and_its_weights_are_a_recorded_file(artifact):
    record = json.loads((artifact / "manifest.json").read_text())["engines"][0]
    assert record["weights"]["bytes"] > PROTOBUF_LIMIT > 100 * record["bytes"]
    assert record["weights"]["bytes"] == (artifact / record["weights"]["file"]).stat().st_size


def test_generates_what_transformers_generates(artifact, hf_tokens):
    from kiln import LLM, RuntimeConfig, SamplingParams

    llm = LLM(artifact, RuntimeConfig(kv_cache_memory=64 << 20, threads=2))
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=TOP_K)
    # two fp32 implementations: token for token up to the first near-tie
    assert_all_close(llm.generate(_prompts(), greedy), hf_tokens, names=("kiln", "HF"))
