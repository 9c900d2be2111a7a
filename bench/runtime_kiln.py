"""kiln's side of bench_runtime.py: its artifacts (built into the cache) and a runner that times
decode-only steps apart from prefill."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.peers import Run
from bench.runtime_console import console

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig

@dataclass
class DecodeSteps:
    """Sums over the steps kiln's engine core counted as decode-only (no prefill chunk in them)."""
    steps: int = 0
    wall_s: float = 0.0           # the whole step as the caller sees it, detokenization included
    core_s: float = 0.0           # EngineCore.step alone (schedule, runner, update)
    engine_s: float = 0.0         # inside engine.run

    @property
    def overhead(self) -> float:
        return 1 - self.engine_s / self.wall_s if self.wall_s else float("nan")

    @property
    def core_overhead(self) -> float:
        return 1 - self.engine_s / self.core_s if self.core_s else float("nan")


@dataclass
class KilnRun(Run):
    decode: DecodeSteps = field(default_factory=DecodeSteps)


class KilnRunner:
    """LLM.generate's loop, step by step, so decode-only steps can be timed apart from prefill."""

    def __init__(self, artifact: Path, threads: int, label: str):
        self.name = f"kiln {label}"
        # NOTE: no prefix caching: every repetition sends the same prompts, and a cache hit would
        # skip the prefill the peers pay for.
        scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, enable_prefix_caching=False)
        self.llm = LLM(artifact, RuntimeConfig(kv_cache_memory=2 << 30, threads=threads, scheduler=scheduler))

    def generate(self, prompts: list[list[int]], n: int) -> KilnRun:
        llm, core = self.llm, self.llm.core
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        requests = [llm.make_request(p, params) for p in prompts]
        decode, first = DecodeSteps(), None
        t0 = time.perf_counter()
        for r in requests:
            core.add_request(r)
            llm.outputs.add(r)
        while core.has_unfinished():
            if self._step(decode) and first is None:
                first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        return KilnRun(first, total, [llm.outputs.result(r).token_ids for r in requests], decode)

    def _step(self, decode: DecodeSteps) -> bool:
        core = self.llm.core
        engine0, core0, decode0 = core.runner.stats.engine_seconds, core.stats.step_seconds, core.stats.decode_seconds
        t0 = time.perf_counter()
        deltas = core.step()
        for d in deltas:
            self.llm.outputs.process(d)
        wall = time.perf_counter() - t0
        if core.stats.decode_seconds > decode0:        # the core classified this step decode-only
            decode.steps += 1
            decode.wall_s += wall
            decode.core_s += core.stats.step_seconds - core0
            decode.engine_s += core.runner.stats.engine_seconds - engine0
        return bool(deltas)


def ensure_kiln(cache: Path, backend: str, quant: str, reuse: bool = False) -> Path:
    """The kiln artifact for one backend and precision, rebuilt into the cache when kiln's build code
    changes; `reuse` takes the newest one cached whatever code built it (smoke runs in a busy checkout)."""
    name = f"kiln-{backend}-{quant}-{_build_code_hash()}"
    cached = sorted(cache.glob(f"kiln-{backend}-{quant}-*/manifest.json"), key=lambda p: p.stat().st_mtime)
    if reuse and cached and cached[-1].parent.name != name:
        console.print(f"[yellow]reusing {cached[-1].parent.name}: kiln's build code changed since it was built[/]")
        name = cached[-1].parent.name
    out, marker = cache / name, cache / f"{name}.UNVERIFIED"
    if not (out / "manifest.json").is_file():
        # NOTE: the dot-folders are builds a killed process left half-written (the OOM killer, Ctrl-C).
        for stale in [*cache.glob(f"kiln-{backend}-{quant}-*"), *cache.glob(f".kiln-{backend}-{quant}-*.building-*")]:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        _build_kiln(out, backend, quant, marker)
    if marker.is_file():
        console.print(f"[bold red]kiln {backend} {quant} was built without its numeric checks "
                      f"({marker.read_text()}); delete {out}* to retry the checked build[/]")
    return out


def _build_code_hash() -> str:
    """A hash of the code that shapes an artifact: others change passes while a cache lives on."""
    import hashlib

    import kiln

    root = Path(kiln.__file__).parent
    files = sorted(f for d in ("contract", "compiler", "engines") for f in (root / d).rglob("*.py"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()[:10]


def _build_kiln(out: Path, backend: str, quant: str, marker: Path) -> None:
    from kiln.compiler.build import build
    from kiln.compiler.passes.base import PassCheckError
    from kiln.contract.quant import QuantMode

    # QUANT may name a prefill engine, int8+w8a8 (engines per bucket range, `--prefill-engine`),
    # and an attention core, int8+w8a8@gqa (`--attention`)
    quant, _, attention = quant.partition("@")
    weights, _, prefill = quant.partition("+")
    # auto: the build's own choice (`kiln build` with no --quant / --backend), recorded in the manifest
    mode = None if weights == "auto" else QuantMode.NONE if weights == "fp32" else QuantMode(weights)
    with console.status(f"building kiln {backend} {quant}") as status:
        try:
            build(_build_config(out, backend, mode, True, prefill, attention), stage=lambda name: _stage(status, name))
        except PassCheckError as e:
            # NOTE: speed does not depend on the check; the agreement line shows what quality is left.
            marker.write_text(str(e))
            build(_build_config(out, backend, mode, False, prefill, attention), stage=lambda name: _stage(status, name))


def _build_config(out: Path, backend: str, mode, verify: bool, prefill_engine: str = "", attention: str = ""):
    from dataclasses import fields

    from kiln.compiler.build import BuildConfig

    if "backend" not in {f.name for f in fields(BuildConfig)}:
        raise SystemExit(f"this kiln has no {backend!r} build backend (BuildConfig has no backend field)")
    extra = {"backend": backend}
    if prefill_engine:
        extra["prefill_engine"] = prefill_engine
    if attention:
        extra["attention"] = attention
    return BuildConfig("smollm2-135m", out, quant=mode, verify=verify, **extra)


def _stage(status, name: str):
    from contextlib import nullcontext

    status.update(f"building kiln: {name}")
    return nullcontext()

