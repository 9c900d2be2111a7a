"""kiln on Ray Serve, measured side by side in one run on loopback (docs/deployment.md, Measured):

  prefix    K distinct long system prompts with short user turns, sent in shuffled rounds: the
            cluster's prefix-cache hit rate (cached over prompt tokens, from the responses' usage)
            with one replica, with two behind Serve's default router, with two behind kiln's
            prefix router. The KV pool is sized so that one replica cannot hold every prompt.
  hedge     two replicas, one slowed by the slow_replica_delay knob: p50 / p99 TTFT with hedging
            off and on (at two budgets), and the fraction of requests hedged.
  overhead  one stream, then 16 concurrent clients: TTFT and ITL through kiln serve directly and
            through the Ray Serve ingress with one and two replicas. NOTE: on a 2-core machine two
            replicas share the same cores.

    python -m bench.bench_scale --artifact PATH [--section prefix|hedge|overhead|all]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kiln.config import AdmissionConfig, ResponseCacheConfig, RuntimeConfig, ServeConfig
from kiln.units import parse_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# -- one streamed request ----------------------------------------------------------------------

async def stream_once(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    t0, times, usage, replica = time.perf_counter(), [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        replica = r.headers.get("x-kiln-replica")
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - t0)
    return {"ttft": times[0] if times else float("nan"), "itl": [b - a for a, b in zip(times, times[1:])],
            "usage": usage, "replica": replica}


# -- the Ray side ------------------------------------------------------------------------------

class Cluster:
    def __init__(self, cpus: int):
        import ray
        from ray import serve

        self.ray, self.serve, self.port = ray, serve, free_port()
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.url = f"http://127.0.0.1:{self.port}"

    def deploy(self, artifact: str, runtime: RuntimeConfig, **options) -> str:
        from kiln.scale.app import ScaleOptions, application

        config = ServeConfig(admission=AdmissionConfig(ttft_slo=0), response_cache=ResponseCacheConfig(enabled=False),
                             served_model_name="m")
        options = ScaleOptions(**options, replica_header=True)        # the answering replica, per request
        self.serve.run(application(artifact, runtime, config, options), name="bench", route_prefix="/")
        return self.url

    def undeploy(self) -> None:
        self.serve.delete("bench")

    def close(self) -> None:
        self.serve.shutdown()
        self.ray.shutdown()


def prefix_workload(k: int, rounds: int, system_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    systems = [" ".join(f"rule{k_}-{w}" for w in range(system_words)) for k_ in range(k)]
    prompts = []
    for r in range(rounds):
        for i in rng.sample(range(k), k):
            prompts.append(f"{systems[i]}\nUser {r}: question {rng.randrange(10**6)}?\nAssistant:")
    return prompts


async def run_sequential(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient() as client:
        return [await stream_once(client, url, p, max_tokens) for p in prompts]


def section_prefix(cluster: Cluster, args, runtime: RuntimeConfig) -> None:
    prompts = prefix_workload(args.prompts, args.rounds, args.system_words)
    print(f"\n## prefix affinity: {args.prompts} system prompts x {args.rounds} rounds, KV pool "
          f"{args.kv_cache_memory} per replica")
    print("| setup | hit rate (all) | hit rate (after round 1) | replicas used |")
    print("| --- | --- | --- | --- |")
    for name, options in (("1 replica", dict(replicas=1)),
                          ("2 replicas, Serve's default router", dict(replicas=2, prefix_routing=False)),
                          ("2 replicas, kiln's prefix router", dict(replicas=2))):
        url = cluster.deploy(args.artifact, runtime, replica_cpus=1, **options)
        results = asyncio.run(run_sequential(url, prompts, 4))
        cluster.undeploy()
        later = results[args.prompts:]
        rate = lambda rs: sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rs) / \
            sum(r["usage"]["prompt_tokens"] for r in rs)
        print(f"| {name} | {rate(results):.1%} | {rate(later):.1%} | {len({r['replica'] for r in results})} |")


def section_hedge(cluster: Cluster, args, runtime: RuntimeConfig) -> None:
    prompts = [f"Topic {i}: " + "words " * 60 for i in range(args.hedge_requests)]
    print(f"\n## hedging: 2 replicas, one holds every {args.slow_every}th of its streams {args.slow_delay} s; "
          f"{len(prompts)} sequential requests")
    print("| hedging | TTFT p50 | TTFT p99 | hedged |")
    print("| --- | --- | --- | --- |")
    for name, options in (("off", dict(hedge=False)),
                          ("on, 5 % budget", dict(hedge=True, hedge_fraction=0.05))):
        url = cluster.deploy(args.artifact, runtime, replicas=2, replica_cpus=1, hedge_floor=0.1,
                             slow_replica_delay=args.slow_delay, slow_replica_every=args.slow_every, **options)
        results = asyncio.run(run_sequential(url, prompts, 8))
        metrics = httpx.get(f"{url}/metrics").text
        sent = sum(float(l.split()[1]) for l in metrics.splitlines() if l.startswith("kiln_hedges_sent_total"))
        cluster.undeploy()
        ttfts = [r["ttft"] for r in results]
        print(f"| {name} | {1e3 * pct(ttfts, 0.5):.0f} ms | {1e3 * pct(ttfts, 0.99):.0f} ms | "
              f"{sent / len(results):.0%} |")


async def run_clients(url: str, clients: int, per_client: int, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as client:
        async def one(c):
            return [await stream_once(client, url, f"Client {c} request {i}: " + "tell me more " * 10, max_tokens)
                    for i in range(per_client)]
        return [r for rs in await asyncio.gather(*(one(c) for c in range(clients))) for r in rs]


def overhead_rows(name: str, url: str, args) -> None:
    asyncio.run(run_clients(url, 1, 1, 8))                     # warm the path
    single = asyncio.run(run_clients(url, 1, 5, args.max_tokens))
    loaded = asyncio.run(run_clients(url, 16, 2, args.max_tokens))
    for label, rs in (("1 stream", single), ("16 clients", loaded)):
        itl = [x for r in rs for x in r["itl"]]
        print(f"| {name} | {label} | {1e3 * pct([r['ttft'] for r in rs], 0.5):.1f} ms | "
              f"{1e3 * pct([r['ttft'] for r in rs], 0.99):.1f} ms | {1e3 * pct(itl, 0.5):.2f} ms | "
              f"{1e3 * pct(itl, 0.99):.2f} ms |")


def section_overhead(cluster: Cluster, args, runtime: RuntimeConfig) -> None:
    print(f"\n## overhead: {args.max_tokens}-token streams")
    print("| server | load | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("| --- | --- | --- | --- | --- | --- |")
    port = free_port()
    kiln = Path(sys.executable).parent / "kiln"
    proc = subprocess.Popen([str(kiln), "serve", args.artifact, "--port", str(port), "--ttft-slo", "0",
                             "--no-response-cache", "--kv-cache-memory", args.overhead_kv, "--threads", "1",
                             "--served-model-name", "m"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        overhead_rows("kiln serve", url, args)
    finally:
        proc.terminate()
        proc.wait(30)
    big = RuntimeConfig(kv_cache_memory=parse_bytes(args.overhead_kv), threads=1)
    for replicas in (1, 2):
        url = cluster.deploy(args.artifact, big, replicas=replicas, replica_cpus=1)
        overhead_rows(f"Ray Serve, {replicas} replica{'s' * (replicas > 1)}", url, args)
        cluster.undeploy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--section", choices=["prefix", "hedge", "overhead", "all"], default="all")
    ap.add_argument("--kv-cache-memory", default="1MiB", help="per replica, for the prefix section")
    ap.add_argument("--overhead-kv", default="64MiB", help="per replica, for the hedge and overhead sections")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=40)
    ap.add_argument("--hedge-requests", type=int, default=80)
    ap.add_argument("--slow-every", type=int, default=20, help="the slow replica holds every n-th of its streams")
    ap.add_argument("--slow-delay", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    cluster = Cluster(cpus=3)
    try:
        if args.section in ("prefix", "all"):
            section_prefix(cluster, args, RuntimeConfig(kv_cache_memory=parse_bytes(args.kv_cache_memory), threads=1))
        big = RuntimeConfig(kv_cache_memory=parse_bytes(args.overhead_kv), threads=1)
        if args.section in ("hedge", "all"):
            section_hedge(cluster, args, big)
        if args.section in ("overhead", "all"):
            section_overhead(cluster, args, big)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
