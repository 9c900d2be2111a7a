"""EleutherAI's evaluation harness, lm-eval (a client nobody here wrote), against the real `kiln serve`
on SmolLM2 through its `local-completions` model: a log-likelihood task made of local files
(rolling perplexity over a few paragraphs of the test corpus), which lm-eval sends as token-id
prompts with `echo`, `logprobs` and one generated token. Each document's log-likelihood must
equal what kiln's own path computes in-process (the prompt logprobs of the same tokens, after
the same prefix token lm-eval puts first), and so must the task's bits per byte."""

from __future__ import annotations

import json
import math
import os
import subprocess

import httpx
import pytest

from kiln.config import RuntimeConfig
from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer
from third_party_clients import client_tool

pytestmark = pytest.mark.slow

CORPUS = os.path.join(os.path.dirname(__file__), "..", "data", "perplexity.txt")
NUM_DOCS, WORDS_PER_DOC = 3, 80
# Same engine, same tokens, one request at a time on both paths; the values pass through JSON
# floats, so they differ by rounding only: far below what a shifted token (several nats) moves.
TOLERANCE = 1e-3

TASK = """task: kiln_local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def docs() -> list[str]:
    with open(CORPUS, encoding="utf-8") as f:
        words = f.read().split()
    return [" ".join(words[i * WORDS_PER_DOC:(i + 1) * WORDS_PER_DOC]) for i in range(NUM_DOCS)]


@pytest.fixture(scope="module")
def lm_eval_run(start_module_server, smollm2_int4_artifact, docs, tmp_path_factory):
    server = start_module_server(smollm2_int4_artifact, "--kv-cache-memory", "256MiB")
    task_dir, out = tmp_path_factory.mktemp("lm-eval-task"), tmp_path_factory.mktemp("lm-eval-out")
    (task_dir / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    (task_dir / "kiln_local_ppl.yaml").write_text(TASK.format(docs=task_dir / "docs.jsonl"), encoding="utf-8")
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    model_args = ",".join([f"model={model}", f"base_url={server.url}/v1/completions",
                           "tokenizer_backend=huggingface", f"tokenizer={smollm2_int4_artifact / 'tokenizer'}",
                           "num_concurrent=1", "max_retries=1"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}     # local files only
    done = subprocess.run([str(client_tool("lm-eval")), "run", "--model", "local-completions",
                           "--model_args", model_args, "--tasks", "kiln_local_ppl", "--include_path", str(task_dir),
                           "--output_path", str(out), "--log_samples"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=out)
    assert done.returncode == 0, f"lm-eval exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_kiln_local_ppl_*.jsonl")
    per_doc = {}
    for line in samples.read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        per_doc[sample["doc_id"]] = float(sample["filtered_resps"][0])
    return json.loads(results.read_text(encoding="utf-8"))["results"]["kiln_local_ppl"], per_doc


@pytest.fixture(scope="module")
def kiln_log_likelihoods(smollm2_int4_artifact, docs, lm_eval_run) -> list[float]:
    """kiln's own path: the prompt logprobs of [prefix] + the document's tokens, in this process."""
    folder = smollm2_int4_artifact / "tokenizer"
    tokenizer = Tokenizer(folder).fast
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    prefix = tokenizer.token_to_id(_token_text(config.get("bos_token")) or _token_text(config["eos_token"]))
    llm = LLM(smollm2_int4_artifact, RuntimeConfig(kv_cache_memory=64 << 20))
    values = []
    for doc in docs:                      # one at a time, as lm-eval sent them
        ids = [prefix] + tokenizer.encode(doc, add_special_tokens=False).ids
        (out,) = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        values.append(sum(lp.token_logprob for lp in out.prompt_logprobs))
    return values


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def test_lm_eval_completes_the_local_task(lm_eval_run):
    metrics, per_doc = lm_eval_run
    assert sorted(per_doc) == list(range(NUM_DOCS))
    assert all(math.isfinite(v) and v < 0 for v in per_doc.values())
    assert metrics["bits_per_byte,none"] > 0 and metrics["word_perplexity,none"] > 1


def test_each_document_s_log_likelihood_is_kiln_s_own(lm_eval_run, kiln_log_likelihoods):
    _, per_doc = lm_eval_run
    for doc_id, expected in enumerate(kiln_log_likelihoods):
        assert per_doc[doc_id] == pytest.approx(expected, rel=TOLERANCE), doc_id


def test_bits_per_byte_is_kiln_s_perplexity_path_s(lm_eval_run, docs, kiln_log_likelihoods):
    metrics, _ = lm_eval_run
    num_bytes = sum(len(d.encode("utf-8")) for d in docs)
    expected = -sum(kiln_log_likelihoods) / num_bytes / math.log(2)
    assert metrics["bits_per_byte,none"] == pytest.approx(expected, rel=TOLERANCE)
