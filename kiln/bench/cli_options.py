"""The `kiln bench` options (click), and the call they make; kiln/cli.py only wires them in."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, fields
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


@dataclass(frozen=True)
class Target:
    """What `kiln bench` loads: a server (--url) or an artifact run in this process (--engine), and
    with --compare the peers run on the artifact's weights."""
    url: str | None = None
    engine: Path | None = None
    compare: bool = False
    hf_model: str | None = "smollm2-135m"
    genai_model: Path | None = None

    def __post_init__(self):
        if (self.url is None) == (self.engine is None):
            raise ValueError("give exactly one target: --url or --engine")
        if self.compare and self.engine is None:
            raise ValueError("--compare runs the artifact in-process: give --engine")

    @property
    def hf_peer(self) -> str | None:
        return None if self.hf_model == "none" else self.hf_model


@dataclass(frozen=True)
class Requests:
    """How each request is sent: the API and sampling, and with --url how the server is reached."""
    endpoint: str = "chat"
    temperature: float = 1.0
    tokenizer: str | None = None
    model: str | None = None
    api_key: str | None = None
    allow_remote: bool = False

    def sampling(self) -> dict:
        return dict(endpoint=self.endpoint, temperature=self.temperature)

    def server(self) -> dict:
        return dict(tokenizer=self.tokenizer, model=self.model, api_key=self.api_key, allow_remote=self.allow_remote)


@dataclass(frozen=True)
class Outputs:
    """Where the results go besides the tables: JSON and the two plots."""
    json_path: Path | None = None
    plot: Path | None = None
    cdf_plot: Path | None = None

    def __post_init__(self):
        if (self.plot or self.cdf_plot) and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot and --cdf-plot need matplotlib: pip install 'kiln[bench]'")


@dataclass(frozen=True)
class Load:
    """The load itself: the workload, its levels, their limits and the goodput objectives."""
    workload: str = "chat"
    concurrency: str | None = None
    rate: str | None = None
    duration: float = 30.0
    timeout: float = 120.0
    max_requests: int | None = None
    seed: int = 0
    max_tokens: int | None = None
    slo_ttft: float | None = None
    slo_itl: float | None = None
    slo_e2e: float | None = None
    metrics_interval: float = 0.5
    ttft_warn: float = 0.25

    def config(self):
        from kiln.bench import main

        return main.bench_config(**asdict(self))


@dataclass(frozen=True)
class BenchCommand:
    """One `kiln bench` run, its options grouped by concern; each group checks itself when made."""
    target: Target
    requests: Requests
    load: Load
    outputs: Outputs

    @classmethod
    def from_options(cls, options: dict) -> BenchCommand:
        """The click options (every name once, as OPTIONS declares them) into their groups."""
        unknown = set(options) - {f.name for group in (Target, Requests, Load, Outputs) for f in fields(group)}
        if unknown:
            raise TypeError(f"kiln bench options with no group: {sorted(unknown)}")
        return cls(*(group(**_fields_of(group, options)) for group in (Target, Requests, Load, Outputs)))


def _fields_of(group, options: dict) -> dict:
    return {f.name: options[f.name] for f in fields(group) if f.name in options}


def run_bench_command(console, out, runtime_config, *, export_requests: Path | None = None, **options) -> None:
    """console: progress and notes (stderr); out: the tables (stdout); runtime_config: a thunk."""
    if export_requests:
        _export(console, export_requests, options)
        return
    command = BenchCommand.from_options(options)
    _publish(command, _run(command, console, runtime_config), out, console)


def _run(command: BenchCommand, console, runtime_config) -> list:
    from kiln.bench import main

    target, requests, config = command.target, command.requests, command.load.config()
    if target.url:
        return [main.bench_url(target.url, config, console, **requests.server(), **requests.sampling())]
    if target.compare:
        return main.bench_compare(target.engine, runtime_config(), target.hf_peer, target.genai_model, config,
                                  console, **requests.sampling())
    return [main.bench_engine(target.engine, runtime_config(), config, console, **requests.sampling())]


def _publish(command: BenchCommand, results: list, out, console) -> None:
    from kiln.bench import main

    outputs = command.outputs
    main.publish(results, out, outputs.json_path, outputs.plot, outputs.cdf_plot,
                 log=lambda m: console.print(f"[dim]{m}[/]"))


def _export(console, path: Path, options: dict) -> None:
    from kiln.bench.export import export_requests

    load, tokenizer = Load(**_fields_of(Load, options)), options.get("tokenizer")
    if tokenizer is None:
        raise ValueError("--export-requests cuts prompts with the model's tokenizer: give --tokenizer ARTIFACT")
    written = export_requests(path, load.workload, load.seed, load.max_requests or 0, tokenizer, load.max_tokens)
    console.print(f"wrote {written} {load.workload} requests (seed {load.seed}) to {path}")
