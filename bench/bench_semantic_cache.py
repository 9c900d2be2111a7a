"""The semantic response cache's trade-off, on the labelled pairs of tests/data/semantic_pairs.jsonl:
hit rate on paraphrases and false-hit rate on near-misses, per cosine threshold, with and without
the guards (kiln/serving/cache/semantic_guards.py); then, with --artifact, the latency a hit saves
through a real `kiln serve --semantic-cache` (each pair's first question generates, its
paraphrase is answered from the cache).

    .venv/bin/python -m bench.bench_semantic_cache
    .venv/bin/python -m bench.bench_semantic_cache --artifact engines/smollm2 --max-tokens 64

Each pair is judged alone: a cache holding only the pair's first question is asked the second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kiln.config import SemanticCacheConfig
from kiln.serving.cache.embedder import Embedder
from kiln.compiler.export.embedder import ensure_exported
from kiln.serving.cache.semantic_cache import SemanticCache, SemanticQuery

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "tests" / "data" / "semantic_pairs.jsonl"
THRESHOLDS = (0.8, 0.85, 0.9, 0.95)


def pair_outcomes(embedder: Embedder, pairs: list[dict], threshold: float, guards: bool) -> list[bool]:
    """Whether each pair's second question hits the first's stored answer."""
    a = embedder.embed([p["a"] for p in pairs])
    b = embedder.embed([p["b"] for p in pairs])
    hits = []
    for pair, ea, eb in zip(pairs, a, b):
        cache = SemanticCache(8, 1 << 20, 60, threshold=threshold, guards=guards)
        cache.put(SemanticQuery("k", pair["a"], ea), "answer", 100)
        hits.append(cache.lookup(SemanticQuery("k", pair["b"], eb)).outcome == "hit")
    return hits


def accuracy_table(embedder: Embedder, pairs: list[dict]) -> list[str]:
    para = [p for p in pairs if p["label"] == "paraphrase"]
    near = [p for p in pairs if p["label"] == "near-miss"]
    lines = [f"{len(para)} paraphrase pairs, {len(near)} near-miss pairs (tests/data/semantic_pairs.jsonl)", "",
             "| threshold | guards | paraphrase hit rate | near-miss false-hit rate | false hits |",
             "|---|---|---|---|---|"]
    default = SemanticCacheConfig.threshold
    for threshold in THRESHOLDS:
        for guards in (False, True):
            hit = pair_outcomes(embedder, para, threshold, guards)
            false = pair_outcomes(embedder, near, threshold, guards)
            named = ", ".join(f"{p.get('kind', '?')}: {p['b']!r}" for p, f in zip(near, false) if f)
            mark = " (default)" if threshold == default else ""
            lines.append(f"| {threshold:g}{mark} | {'on' if guards else 'off'} | {sum(hit)}/{len(hit)} "
                         f"({sum(hit) / len(hit):.0%}) | {sum(false)}/{len(false)} ({sum(false) / len(false):.0%}) | "
                         f"{named if guards else '—'} |")
    return lines


def embed_latency(embedder: Embedder, questions: list[str], repeats: int = 20) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        embedder.embed([questions[i % len(questions)]])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def served_latencies(artifact: Path, model: Path, pairs: list[dict], max_tokens: int, port: int) -> list[str]:
    """Median e2e latency of the first questions (generated) and their paraphrases (cache hits)."""
    import httpx

    cmd = [str(Path(sys.executable).parent / "kiln"), "serve", str(artifact), "--port", str(port),
           "--semantic-cache", "--semantic-cache-model", str(model), "--no-console"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        generated, cached, hits = [], [], 0
        for pair in pairs:
            generated.append(_ask(url, pair["a"], max_tokens)[0])
            seconds, header = _ask(url, pair["b"], max_tokens)
            if header == "semantic":
                hits += 1
                cached.append(seconds)
        return [f"{len(pairs)} paraphrase pairs through kiln serve --semantic-cache ({artifact.name}, "
                f"max_tokens {max_tokens}, greedy):",
                f"  first question (generated):  median e2e {statistics.median(generated) * 1e3:.0f} ms",
                f"  paraphrase ({hits} hits):        median e2e {statistics.median(cached) * 1e3:.0f} ms"
                if cached else "  no paraphrase hit"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ask(url: str, question: str, max_tokens: int) -> tuple[float, str | None]:
    import httpx

    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - t0, r.headers.get("x-cache")


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("kiln serve was not ready in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="embedding model folder (default: the exported MiniLM)")
    ap.add_argument("--artifact", type=Path, default=None, help="also measure the latency a hit saves through kiln serve")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18123)
    args = ap.parse_args()
    model = ensure_exported(args.model)
    pairs = [json.loads(line) for line in PAIRS.open()]
    embedder = Embedder(model)
    print("\n".join(accuracy_table(embedder, pairs)))
    print(f"\nembedding one question: median {embed_latency(embedder, [p['a'] for p in pairs]) * 1e3:.1f} ms "
          f"(one ONNX Runtime thread)")
    if args.artifact:
        para = [p for p in pairs if p["label"] == "paraphrase"]
        print("\n" + "\n".join(served_latencies(args.artifact, model, para, args.max_tokens, args.port)))


if __name__ == "__main__":
    main()
