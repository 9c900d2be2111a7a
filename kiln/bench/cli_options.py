"""The `kiln bench` options (click), and the call they make; kiln/cli.py only wires them in."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from kiln.bench.workloads import WORKLOADS

OPTIONS = [
    click.option("--url", default=None, help="An OpenAI-compatible server, e.g. http://127.0.0.1:8000 (loopback)."),
    click.option("--engine", type=click.Path(exists=True, path_type=Path), default=None,
                 help="An artifact folder, run in this process."),
    click.option("--workload", default="chat", show_default=True,
                 type=click.Choice(list(WORKLOADS))),
    click.option("--concurrency", default=None, help="Closed-loop clients per level, e.g. 1,4,16,64."),
    click.option("--rate", default=None, help="Open-loop Poisson arrival rates per level (req/s), e.g. 2,4,8."),
    click.option("--duration", default=30.0, show_default=True, help="Seconds of issuing requests per level."),
    click.option("--max-requests", type=int, default=None, help="At most N requests per level."),
    click.option("--timeout", default=120.0, show_default=True, help="Seconds before a request counts as timed out."),
    click.option("--seed", default=0, show_default=True, help="Workload seed: same seed, same requests."),
    click.option("--max-tokens", type=int, default=None, help="Cap on every reply length the workload asks for."),
    click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True),
    click.option("--temperature", default=1.0, show_default=True,
                 help="Sampling temperature (> 0 without a seed keeps a server's response cache out of it)."),
    click.option("--slo-ttft", type=float, default=None, help="Goodput SLO: seconds to the first token."),
    click.option("--slo-itl", type=float, default=None, help="Goodput SLO: a request's mean inter-token seconds."),
    click.option("--slo-e2e", type=float, default=None, help="Goodput SLO: seconds end to end."),
    click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write results as JSON."),
    click.option("--plot", type=click.Path(path_type=Path), default=None,
                 help="PNG: throughput vs p99 TTFT and p99 ITL across the sweep (the knee)."),
    click.option("--cdf-plot", type=click.Path(path_type=Path), default=None, help="PNG: latency CDFs per level."),
    click.option("--tokenizer", default=None,
                 help="With --url: an artifact (or tokenizer folder) for exact prompt lengths."),
    click.option("--model", default=None, help="With --url: the model id to send (default: the server's first)."),
    click.option("--api-key", default=None, help="With --url: sent as 'Authorization: Bearer KEY'."),
    click.option("--allow-remote", is_flag=True, help="Allow a --url whose host is not loopback."),
    click.option("--metrics-interval", default=0.5, show_default=True, help="Seconds between /metrics scrapes."),
    click.option("--ttft-warn", default=0.25, show_default=True,
                 help="Warn when client and server mean TTFT differ by more than this fraction."),
    click.option("--export-requests", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Write the workload's first --max-requests requests (prompt text, reply length) as JSONL "
                      "for another load generator (AIPerf: --input-file FILE --custom-dataset-type single_turn) "
                      "and exit; needs --tokenizer."),
    click.option("--compare", is_flag=True, help="With --engine: also run HF transformers on the same weights."),
    click.option("--hf-model", default="smollm2-135m", show_default=True,
                 help="With --compare: the model source for transformers (preset, .gguf or HF folder; 'none' skips it)."),
    click.option("--genai-model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                 help="With --compare: an onnxruntime-genai model folder of the same weights (optional peer)."),
]


def bench_options(fn):
    for opt in reversed(OPTIONS):
        fn = opt(fn)
    return fn


def run_bench_command(console, out, runtime_config, *, url, engine, workload, concurrency, rate, duration,
                      max_requests, timeout, seed, max_tokens, endpoint, temperature, slo_ttft, slo_itl,
                      slo_e2e, json_path, plot, cdf_plot, tokenizer, model, api_key, allow_remote,
                      metrics_interval, ttft_warn, export_requests, compare, hf_model, genai_model) -> None:
    """console: progress and notes (stderr); out: the tables (stdout); runtime_config: a thunk."""
    from kiln.bench import main

    if export_requests:
        _export(console, export_requests, workload, seed, max_requests, tokenizer, max_tokens)
        return
    if (url is None) == (engine is None):
        raise ValueError("give exactly one target: --url or --engine")
    if compare and engine is None:
        raise ValueError("--compare runs the artifact in-process: give --engine")
    if (plot or cdf_plot) and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot and --cdf-plot need matplotlib: pip install 'kiln[bench]'")
    config = main.bench_config(workload, concurrency, rate, duration, timeout, max_requests, seed, max_tokens,
                               slo_ttft, slo_itl, slo_e2e, metrics_interval, ttft_warn)
    sampling = dict(endpoint=endpoint, temperature=temperature)
    if url:
        results = [main.bench_url(url, config, console, tokenizer=tokenizer, model=model, api_key=api_key,
                                  allow_remote=allow_remote, **sampling)]
    elif compare:
        hf_model = None if hf_model == "none" else hf_model
        results = main.bench_compare(engine, runtime_config(), hf_model, genai_model, config, console, **sampling)
    else:
        results = [main.bench_engine(engine, runtime_config(), config, console, **sampling)]
    main.publish(results, out, json_path, plot, cdf_plot, log=lambda m: console.print(f"[dim]{m}[/]"))


def _export(console, path: Path, workload, seed, max_requests, tokenizer, max_tokens) -> None:
    from kiln.bench.export import export_requests

    if tokenizer is None:
        raise ValueError("--export-requests cuts prompts with the model's tokenizer: give --tokenizer ARTIFACT")
    written = export_requests(path, workload, seed, max_requests or 0, tokenizer, max_tokens)
    console.print(f"wrote {written} {workload} requests (seed {seed}) to {path}")
