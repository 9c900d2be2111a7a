"""The `kiln` command line: parse, call, print. No logic lives here."""

from __future__ import annotations

import json
import shlex
import time
from functools import partial
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console
from rich.markup import escape

from kiln.bench.cli_options import bench_options
from kiln.compiler.progress import console, rich_stage
from kiln.config import LOG_LEVELS
from kiln.config_options import runtime_config
from kiln.contract.backends import BACKENDS
from kiln.contract.quant import QuantMode
from kiln.scale.cli_options import SCALE_OPTIONS, run_on_ray, scale_options, wants_ray


def runtime_options(fn):
    """The runtime knobs shared by generate, serve and bench."""
    opts = [
        click.option("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB (default: a share of free memory)."),
        click.option("--policy", type=click.Choice(["latency", "throughput"]), default=None,
                     help="Scheduler preset; the knobs below override it one by one."),
        click.option("--max-num-seqs", type=int, default=None,
                     help="Cap on running sequences (default auto: the largest batch bucket, KV and --target-itl permitting)."),
        click.option("--token-budget", type=int, default=None, help="Tokens per step (decodes + prefill chunks)."),
        click.option("--target-itl", type=float, default=None,
                     help="Seconds a step may take while streams decode; prefill chunks fit the rest (0 = off)."),
        click.option("--max-model-len", type=int, default=None, help="Context cap (default: the model's)."),
        click.option("--no-prefix-caching", is_flag=True, help="Disable prefix caching."),
        click.option("--threads", type=int, default=None, help="Engine threads (default: usable CPUs)."),
        click.option("--speculative", default=None, metavar="ngram|draft:PATH",
                     help="Speculative decoding: prompt lookup (ngram) or a draft artifact's proposals, "
                          "verified k+1 tokens per engine call (greedy output unchanged)."),
        click.option("--num-speculative-tokens", type=int, default=None,
                     help="Most tokens proposed per request and step (default 5; adapts to acceptance and load)."),
        click.option("--batch-wait-ms", type=float, default=None,
                     help="While nothing decodes, hold new prompts up to MS milliseconds so several share one "
                          "prefill step (default 0 = off; --policy throughput: 5)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


class _KilnGroup(click.Group):
    """Runs a command; one that needs an optional package that is not installed ends in one line
    naming the extra that brings it, not in a traceback."""

    def invoke(self, ctx):
        from kiln.extras import extra_for, install_hint

        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:
            command = ctx.invoked_subcommand or ""
            extra = extra_for(e.name or "", command)
            if extra is None:
                raise                  # kiln's own module or a base dependency: a bug, keep its traceback
            _error(f"kiln {command} needs the {extra!r} extra ({e.name.partition('.')[0]} is not installed): "
                   f"{install_hint(extra)}")


@click.group(cls=_KilnGroup)
@click.version_option(package_name="kiln")
def main():
    """kiln: build LLM engines and serve them."""


def _artifact_argument(fn):
    """The ARTIFACT argument, checked as it is parsed, before any engine or server loads."""
    return click.argument("artifact", type=click.Path(path_type=Path), callback=_check_artifact_argument)(fn)


def _check_artifact_argument(ctx, _param, path: Path) -> Path:
    """Refuse the two mistakes only the CLI can name in full: a preset's name (the presets are the
    compiler's, which the artifact checks must not import), and a folder that holds one artifact
    (the command to run on it). The artifact checks name the rest when the engine loads."""
    from kiln.compiler.export.presets import PRESETS
    from kiln.contract.checks import MANIFEST, artifacts_inside, build_first, not_an_artifact

    if not path.exists() and str(path) in PRESETS:
        _error(build_first(str(path), "model preset", str(path)))
    inside = artifacts_inside(path) if not (path / MANIFEST).is_file() else []
    if len(inside) == 1:
        _error(f"{not_an_artifact(path)} — kiln {ctx.info_name} {shlex.quote(str(inside[0]))}")
    return path


@main.command()
@click.argument("model")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Artifact folder to create.")
@click.option("--quant", type=click.Choice(["auto", *(m.value for m in QuantMode)]), default="auto", show_default=True,
              help="Weights: auto (int8 unless the model is too small to gain), none (fp32), int8 / int4 "
                   "weight-only, w8a8 (int8 weights and int8 activations per call: faster prefill and "
                   "batches, less exact), or f16 (16-bit float weights, computed in f32; openvino backend).")
@click.option("--prefill-engine", type=click.Choice(["w8a8", "int8", "int4"]), default=None,
              help="ort backend: a second engine, quantized this way, for calls of 4+ tokens (prefill "
                   "chunks, decode batches); the --quant engine keeps single decodes.")
@click.option("--attention", type=click.Choice(["auto", "standard", "gqa", "native"]), default="auto", show_default=True,
              help="ort backend: the paged graph's attention core; auto: native where kiln's op library is "
                   "built and the KV cache is fp32, else standard; gqa: ONNX Runtime's GroupQueryAttention "
                   "(faster prefill and single decodes, slower large decode batches: passes/attention_gqa.py); "
                   "native: kiln's PagedAttention op, which reads the KV pool in place (needs kiln's op "
                   "library and an fp32 KV cache); with --prefill-engine only the decode engine takes it. "
                   "With --backend openvino, native is kiln's own paged attention over its u8 KV cache "
                   "(kiln.PagedAttentionU8) in place of OpenVINO's, which auto takes for int8 builds on a CPU "
                   "with AMX tiles (standard keeps OpenVINO's).")
@click.option("--kv-dtype", type=click.Choice(["fp32", "fp16", "int8"]), default="fp32", show_default=True,
              help="ort backend: the KV cache's element type; fp16 halves its memory, int8 (one scale per "
                   "token and head) takes ~0.27x; attention still computes in fp32.")
@click.option("--block-size", default=16, show_default=True, help="KV cache block size in tokens.")
@click.option("--backend", type=click.Choice(["auto", *BACKENDS]), default="auto", show_default=True,
              help="Engine backend: auto (the fastest this machine and model support; the build says which and "
                   "why), ONNX Runtime CPU (paged gather in the graph), OpenVINO (native paged attention), "
                   "TensorRT (GPU, a profile per bucket range) or ONNX Runtime CUDA (PagedAttention).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="GPU backends' compute precision (default: fp16).")
@click.option("--kv-cache-memory", default=None,
              help="tensorrt backend: the KV pool the engine is planned for, e.g. 4GiB (required); give kiln "
                   "serve the same size or less.")
@click.option("--no-fuse", is_flag=True, help="Skip the fusion passes.")
@click.option("--no-verify", is_flag=True, help="Skip the numeric check after each pass.")
@click.option("--force", is_flag=True, help="Overwrite an existing artifact folder.")
def build(model, out, quant, prefill_engine, attention, kv_dtype, block_size, backend, precision, kv_cache_memory,
          no_fuse, no_verify, force):
    """Build an engine artifact from MODEL: a preset (smollm2-135m, tiny-llama, tiny-qwen2),
    a .gguf file or a Hugging Face checkpoint folder."""
    from kiln.compiler.build import build as run_build
    from kiln.config import BuildConfig
    from kiln.units import parse_bytes

    cfg = BuildConfig(source=model, out=out, quant=None if quant == "auto" else QuantMode(quant), block_size=block_size,
                      fuse=not no_fuse, verify=not no_verify, force=force, backend=backend,
                      precision=precision or "", prefill_engine=prefill_engine or "", attention=attention,
                      kv_dtype={"fp32": "float32", "fp16": "float16", "int8": "int8"}[kv_dtype],
                      kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory else None)
    t0 = time.perf_counter()
    path = _guarded(lambda: run_build(cfg, stage=rich_stage))
    console.print(f"[bold green]built[/] {path} in {time.perf_counter() - t0:.1f} s")


@main.command()
@_artifact_argument
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--context", type=int, default=None,
              help="Context length for the capacity line (default: the artifact's longest, as `kiln serve` sizes).")
@click.option("--memory", default=None,
              help="KV memory budget for the capacity line, e.g. 2GiB (default: what `kiln serve` takes here, "
                   "a share of available memory).")
def inspect(artifact, as_json, context, memory):
    """Show what an artifact holds: model, quantization, buckets, KV layout, passes, files."""
    from kiln.contract.artifact import EngineArtifact
    from kiln.inspect_view import render_manifest
    from kiln.units import parse_bytes

    art = _guarded(lambda: EngineArtifact.load(artifact, verify=False))
    if as_json:
        click.echo(json.dumps(art.manifest.to_json(), indent=1))
        return
    wide = Console(width=max(Console().width, 160))   # tables must not wrap their lines when piped
    wide.print(render_manifest(art, context_len=context, memory_bytes=parse_bytes(memory) if memory else None))


@main.command()
@_artifact_argument
@click.option("--prompt", "prompts", multiple=True, help="A raw prompt (repeatable).")
@click.option("--chat", "chats", multiple=True, help="A user message, wrapped in the chat template (repeatable).")
@click.option("--prompt-file", type=click.Path(exists=True, path_type=Path), help="JSONL of prompts or {messages}.")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per output line.")
@runtime_options
def generate(artifact, prompts, chats, prompt_file, max_tokens, temperature, top_p, top_k, seed, stop,
             as_json, **runtime):
    """Generate from an artifact: every prompt joins one in-flight batch."""
    from kiln.cli_generate import collect_prompts, run_generate
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    def go():
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=stop)
        llm = LLM(artifact, runtime_config(**runtime))
        console.print(f"[dim]{llm.core.plan.describe()}[/]")
        run_generate(llm, collect_prompts(llm, prompts, chats, prompt_file), params, as_json)
    _guarded(go)


@main.command("triton-repo")
@_artifact_argument
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Model repository folder.")
@click.option("--instances", default=1, show_default=True, help="Model instances (each its own engine).")
@click.option("--max-queue", default=256, show_default=True, help="Waiting requests before new ones are refused.")
@click.option("--name", default="kiln", show_default=True, help="Model name in the repository.")
@click.option("--print-command", is_flag=True, help="Also print the tritonserver command that serves it.")
@runtime_options
def triton_repo(artifact, out, instances, max_queue, name, print_command, **runtime):
    """Render a Triton model repository serving ARTIFACT (python backend, decoupled streaming)."""
    from kiln.serving.triton.launch import command_text
    from kiln.serving.triton.repo import RepoOptions, render_repository

    options = RepoOptions(name=name, instances=instances, max_queue=max_queue, runtime=runtime)
    path = _guarded(lambda: render_repository(artifact, out, options))
    console.print(f"[bold green]rendered[/] {path}")
    if print_command:
        click.echo(_guarded(lambda: command_text(out)))


def _security_options(fn):
    """Who may call the server and from where (docs/serving.md, Security and tenants)."""
    options = [
        click.option("--api-key-file", "api_key_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
                     help="Accept several API keys: a file of 'name key [priority=LOW:HIGH]' lines; each key gets "
                          "its own prefix cache."),
        click.option("--allowed-hosts", "allowed_hosts", default=None,
                     help="Comma-separated Host names served ('*': any; default: loopback names on loopback)."),
        click.option("--cors-origins", "cors_origins", default=None,
                     help="Comma-separated browser origins allowed to call the API (default: none)."),
        click.option("--allow-control-tokens-in-messages", "allow_control_tokens_in_messages", is_flag=True,
                     help="Parse special-token text inside messages as control tokens (the old behaviour)."),
        click.option("--public-endpoints", "public_endpoints", default=None,
                     help="Comma-separated endpoints answered without the API key (default: /health,/ready)."),
        click.option("--max-key-contexts", "max_key_contexts", type=int, default=None,
                     help="With API keys: a key's requests in flight may reserve N contexts of tokens "
                          "(choices x (prompt + max_tokens)); 429 past it (default 64; 0 = no bound)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


SECURITY_OPTIONS = ("api_key_file", "allowed_hosts", "cors_origins", "allow_control_tokens_in_messages",
                    "public_endpoints", "max_key_contexts")


def _security_config(api_key_file, allowed_hosts, cors_origins, allow_control_tokens_in_messages,
                     public_endpoints, max_key_contexts) -> dict:
    from kiln.serving.http.http_io import read_api_key_file, read_api_key_grants

    def names(text):
        return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())
    out = dict(api_keys=read_api_key_file(api_key_file) if api_key_file else (),
               key_priorities=read_api_key_grants(api_key_file) if api_key_file else (),
               allowed_hosts=names(allowed_hosts), cors_origins=names(cors_origins) or (),
               allow_control_tokens_in_messages=allow_control_tokens_in_messages)
    if public_endpoints is not None:
        out["public_endpoints"] = names(public_endpoints)
    if max_key_contexts is not None:
        out["max_key_contexts"] = max_key_contexts or None
    return out


def _api_options(fn):
    """How the OpenAI/vLLM request surface behaves (docs/serving.md, The API)."""
    options = [
        click.option("--strict-api", is_flag=True,
                     help="Refuse (400) unknown request fields instead of ignoring them with a header."),
        click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default=None,
                     help="Waiting-queue order: fcfs (default) or priority (a request's `priority`, lower first)."),
        click.option("--chat-template", "chat_template", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     default=None, help="A Jinja chat template file to use instead of the artifact's."),
        click.option("--tool-call-parser", type=click.Choice(["hermes", "llama3_json", "mistral"]), default=None,
                     help="The tool-call syntax replies are parsed in (default: the chat template's)."),
        click.option("--ttft-refuse-factor", type=float, default=None,
                     help="Refuse (429) a request predicted past F times --ttft-slo (default 5; 1 = at the objective)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


API_OPTIONS = ("strict_api", "scheduling_policy", "chat_template", "ttft_refuse_factor", "tool_call_parser")


def _limit_options(fn):
    """Connection, time and fault limits, on by default (docs/serving.md, Limits and faults)."""
    options = [
        click.option("--limit-concurrency", type=int, default=None,
                     help="Answer 503 past N open connections or requests in flight (default 512; 0 = no limit)."),
        click.option("--keep-alive-timeout", type=float, default=None,
                     help="Close an idle keep-alive connection after S seconds (default 5)."),
        click.option("--body-timeout", type=float, default=None,
                     help="Answer 408 when a request body takes over S seconds to arrive (default 30; 0 = off)."),
        click.option("--max-body-size", default=None, help="Answer 413 past this body size, e.g. 8MiB (default 4MiB)."),
        click.option("--step-timeout", type=float, default=None,
                     help="Fault the server (503, requests errored) when an engine step runs over S seconds "
                          "(default 60; 0 = no watchdog)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


LIMIT_OPTIONS = ("limit_concurrency", "keep_alive_timeout", "body_timeout", "max_body_size", "step_timeout")


def _semantic_options(fn):
    """The semantic response cache, opt-in (docs/serving.md, The semantic cache)."""
    options = [
        click.option("--semantic-cache", "semantic_cache", is_flag=True, default=None,
                     help="Answer deterministic chat questions that paraphrase an earlier one from its stored "
                          "answer (X-Cache: semantic); numbers, dates, negations and names must agree."),
        click.option("--semantic-cache-model", "semantic_cache_model", type=click.Path(path_type=Path), default=None,
                     help="Folder of the sentence-embedding model (model.onnx, tokenizer.json; default: "
                          "all-MiniLM-L6-v2, exported on first use)."),
        click.option("--semantic-cache-threshold", "semantic_cache_threshold", type=float, default=None,
                     help="Cosine similarity at or above which a stored question matches (default 0.9)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


# option name -> its SemanticCacheConfig field
SEMANTIC_OPTIONS = {"semantic_cache": "enabled", "semantic_cache_model": "model",
                    "semantic_cache_threshold": "threshold"}


def _admission_config(ttft_slo, ttft_refuse_factor, max_waiting, max_waiting_tokens):
    """The admission bounds given on the command line (--max-waiting 0: none); the others keep
    AdmissionConfig's defaults."""
    from kiln.config import AdmissionConfig

    given = dict(ttft_slo=ttft_slo, ttft_refuse_factor=ttft_refuse_factor, max_waiting_tokens=max_waiting_tokens)
    out = {name: value for name, value in given.items() if value is not None}
    if max_waiting is not None:
        out["max_waiting"] = max_waiting or None
    return AdmissionConfig(**out)


def _limits_config(request_timeout, limit_concurrency, keep_alive_timeout, body_timeout, max_body_size,
                   step_timeout) -> dict:
    """The limits given on the command line (0: off); the others keep ServeConfig's defaults."""
    from kiln.units import parse_bytes

    given = dict(request_timeout=request_timeout, limit_concurrency=limit_concurrency, body_timeout=body_timeout,
                 step_timeout=step_timeout)
    out = {name: value or None for name, value in given.items() if value is not None}
    if keep_alive_timeout is not None:
        out["keep_alive_timeout"] = keep_alive_timeout
    if max_body_size is not None:
        out["max_body_bytes"] = parse_bytes(max_body_size)
    return out


@main.command()
@_artifact_argument
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="KILN_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize and the endpoints --public-endpoints "
                   "does not name (or set KILN_API_KEY, kept out of ps).")
@click.option("--served-model-name", default=None, help="Model id clients send (default: the folder name).")
@click.option("--ttft-slo", type=float, default=None,
              help="The TTFT objective, S seconds (default 2; 0 = no TTFT check): requests predicted past it "
                   "queue; past --ttft-refuse-factor times it they get 429; a prompt waiting half of it gets "
                   "longer steps (a larger share beside the decodes).")
@click.option("--max-waiting", type=int, default=None,
              help="Refuse when N requests await their first token (default 256; 0 = no bound).")
@click.option("--max-waiting-tokens", type=int, default=None, help="Refuse when their prompts exceed N tokens.")
@click.option("--request-timeout", type=float, default=None,
              help="End requests after S seconds, finish_reason timeout (default 600; 0 = never).")
@click.option("--no-response-cache", is_flag=True, help="Do not cache deterministic responses.")
@click.option("--no-console", is_flag=True, help="Do not serve the playground and dashboard at /.")
@click.option("--no-engine-process", is_flag=True,
              help="Run the engine on a thread of the server's process, not in a process of its own.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info",
              show_default=True, help="kiln's logs; debug traces admission and every engine step.")
@_security_options
@_api_options
@_limit_options
@scale_options
@_semantic_options
@runtime_options
def serve(artifact, host, port, api_key, served_model_name, ttft_slo, max_waiting, max_waiting_tokens,
          request_timeout, no_response_cache, no_console, no_engine_process, log_level, **runtime):
    """Serve an artifact over an OpenAI-compatible HTTP API."""
    from kiln.config import ResponseCacheConfig, SemanticCacheConfig, ServeConfig
    from kiln.serving.http.server import run_server

    security = {name: runtime.pop(name) for name in SECURITY_OPTIONS}
    limits = {name: runtime.pop(name) for name in LIMIT_OPTIONS}
    api = {name: runtime.pop(name) for name in API_OPTIONS}
    scale = {name: runtime.pop(name) for name in SCALE_OPTIONS}
    semantic = {key: value for name, key in SEMANTIC_OPTIONS.items() if (value := runtime.pop(name)) is not None}

    def go():
        admission = _admission_config(ttft_slo, api["ttft_refuse_factor"], max_waiting, max_waiting_tokens)
        cfg = ServeConfig(**_security_config(**security), **_limits_config(request_timeout, **limits),
                          host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                          admission=admission, response_cache=ResponseCacheConfig(enabled=not no_response_cache),
                          semantic_cache=SemanticCacheConfig(**semantic),
                          console=not no_console, engine_process=not no_engine_process, log_level=log_level,
                          strict_api=api["strict_api"], chat_template=api["chat_template"],
                          tool_call_parser=api["tool_call_parser"])
        run = partial(run_on_ray, scale=scale) if wants_ray(scale) else \
            partial(run_server, drain_timeout=scale["drain_timeout"])
        _export_default_embedder(cfg)
        run(artifact, _with_policy(runtime_config(**runtime), api["scheduling_policy"]), cfg,
            announce=lambda m: console.print(f"[dim]{m}[/]"))
    _guarded(go)


def _export_default_embedder(cfg) -> None:
    """With the semantic cache on and no model given, the default embedder (what the server loads
    then) is exported here on first use: the export is build-side code (torch), which the server
    never imports. A Ray replica on another machine needs it exported there (scripts/setup.sh)."""
    if cfg.semantic_cache.enabled and cfg.semantic_cache.model is None:
        from kiln.compiler.export.embedder import ensure_exported
        ensure_exported()


def _with_policy(runtime, policy: str | None):
    from dataclasses import replace

    from kiln.config import SchedulingPolicy
    return runtime if policy is None else replace(
        runtime, scheduler=replace(runtime.scheduler, policy=SchedulingPolicy(policy)))


@main.command()
@bench_options
@runtime_options
def bench(kv_cache_memory, policy, max_num_seqs, token_budget, max_model_len, no_prefix_caching, threads,
          target_itl, speculative, num_speculative_tokens, batch_wait_ms, **options):
    """Load-test a server (--url) or an artifact in-process (--engine): TTFT, ITL, e2e percentiles,
    throughput and goodput per concurrency or rate level; tables, JSON and plots."""
    from kiln.bench.cli_options import run_bench_command

    runtime = dict(kv_cache_memory=kv_cache_memory, policy=policy, max_num_seqs=max_num_seqs,
                   token_budget=token_budget, max_model_len=max_model_len,
                   no_prefix_caching=no_prefix_caching, threads=threads, target_itl=target_itl,
                   speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                   batch_wait_ms=batch_wait_ms)
    wide = Console(width=max(Console().width, 160))   # tables must not wrap their cells when piped
    _guarded(lambda: run_bench_command(console, wide, lambda: runtime_config(**runtime), **options))


def _guarded(fn):
    """Turn the errors a user can act on into a one-line message and exit code 1."""
    from kiln.contract.artifact import ArtifactError
    from kiln.contract.model_spec import UnsupportedModelError

    try:
        from kiln.compiler.passes.base import PassCheckError
    except ModuleNotFoundError:      # a runtime install (no build extra: no onnx) runs no pass
        PassCheckError = ArtifactError

    try:
        return fn()
    except (ArtifactError, UnsupportedModelError, PassCheckError, FileNotFoundError, ValueError) as e:
        _error(str(e))
    except Exception as e:
        from kiln.compiler.disk_space import out_of_space

        if not out_of_space(e):
            raise
        _error(f"out of disk space (or over a file-size limit) while writing: {e}. "
               "Nothing was published; free space or write elsewhere and run it again.")


def _error(message: str) -> NoReturn:
    """Every refusal the CLI reports: one line on stderr, exit code 1. The message is escaped, so the
    brackets in `kiln[bench]` or a path print as they are instead of reading as rich markup."""
    console.print(f"[bold red]error:[/] {escape(message)}")
    raise SystemExit(1)


if __name__ == "__main__":      # python -m kiln.cli, as the console script does
    main()
