"""Small frozen configs per concern: build, scheduler, runtime, server. Runtime-derived values
(e.g. the number of KV blocks) are computed from these at start-up and never written back.

NOTE: this module sits below everything that reads a config: it imports nothing from kiln.runtime,
kiln.serving or kiln.cli (tests/repository/test_layering.py checks it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.contract.engine import BucketGrid
    from kiln.contract.quant import QuantMode


# NOTE: the build defaults import lazily, so reading a runtime or server config (the CLI, the
# Triton stub) does not load numpy.
def _default_buckets() -> BucketGrid:
    from kiln.contract.engine import BucketGrid

    return BucketGrid()


@dataclass(frozen=True)
class BuildConfig:
    source: str
    out: Path
    quant: QuantMode | None = None   # None: auto (kiln.compiler.defaults.choose_quant)
    block_size: int = 16
    buckets: BucketGrid = field(default_factory=_default_buckets)
    fuse: bool = True
    verify: bool = True           # numeric check after every pass
    force: bool = False
    backend: str = "auto"         # a key of kiln.contract.backends.BACKENDS, or "auto" (kiln.compiler.defaults)
    precision: str = ""           # GPU backends: fp32 | fp16 | bf16 ("": the backend's default)
    prefill_engine: str = ""      # ORT: a second engine (a QuantMode value, e.g. "w8a8") for calls of many tokens
    attention: str = "auto"       # ORT: the paged graph's attention core, a key of passes.kv_io.ATTENTION_CORES (auto: compiler/defaults.py)
    kv_dtype: str = "float32"     # ORT: the KV pool's element type, a key of passes.kv_io.KV_DTYPES
    kv_cache_memory: int | None = None   # tensorrt: bytes of the KV pool its optimization profiles are planned for


MAX_BATCH_WAIT = 1.0        # seconds: a window is meant to stay far below any TTFT budget


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"       # lower SamplingParams.priority first, then arrival


AUTO_BATCH_FLOOR = 32       # sequences the auto batch always allows (the batch cap before it grew)


@dataclass(frozen=True)
class SchedulerConfig:
    # 0 = auto: the running set grows to the artifact's largest batch bucket while the KV pool has
    # blocks and, past AUTO_BATCH_FLOOR sequences, while a decode step of one more sequence is
    # predicted within target_itl (itl_bounds_batch; the engine core resolves it). A number: a
    # fixed cap, bounded by the KV pool alone.
    max_num_seqs: int = 0
    itl_bounds_batch: bool = False
    max_num_batched_tokens: int = 512       # the per-step token budget
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    long_prefill_token_threshold: int = 0   # cap on one request's chunk; 0 = no cap
    # Decode-aware chunked prefill: while streams decode, prefill chunks get only the tokens that
    # keep a step within target_itl seconds and within itl_stretch times a decode-only step (by
    # the measured step costs), never fewer than min_prefill_chunk. target_itl 0 = prefill bounded
    # only by the token budget; itl_stretch 0 = no bound relative to the decode step.
    target_itl: float = 0.1
    # Off by default: the absolute target alone bounds the ITL. NOTE: a stretch (the earlier default)
    # held a prompt arriving beside a few fast decodes to a small chunk a step, and under 16 chat
    # clients TTFT p50 about doubled and goodput halved, for an ITL p99 only a little lower than
    # without it (docs/results/2026-12-06-figures-from-code-comments.md).
    itl_stretch: float = 0.0
    min_prefill_chunk: int = 16
    # The TTFT objective the scheduler serves beside target_itl (0 = none; kiln serve passes its
    # --ttft-slo): while a prompt has waited LATE_SHARE of it for its first token, a step may take
    # LATE_STEP_FACTOR times target_itl (runtime/step_costs.py, StepCosts.late), so a burst of
    # prompts gets a larger share of each step while every decoding stream still gets its token.
    target_ttft: float = 0.0
    # The batch wait window (runtime/batch_wait.py): while nothing decodes, hold new prompts up to
    # batch_wait seconds after the oldest arrived, until batch_wait_batch of them wait (0: max_num_seqs).
    # 0 = off: it trades TTFT for fuller prefill steps.
    batch_wait: float = 0.0
    batch_wait_batch: int = 0

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_model_len", "min_prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_seqs < 0:
            raise ValueError(f"max_num_seqs must be >= 0 (0 = auto), got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 = no cap)")
        if not 0 <= self.target_itl < float("inf"):
            raise ValueError(f"target_itl must be a finite number of seconds >= 0 (0 = off), got {self.target_itl}")
        if not 0 <= self.target_ttft < float("inf"):
            raise ValueError(f"target_ttft must be a finite number of seconds >= 0 (0 = off), got {self.target_ttft}")
        if not (self.itl_stretch == 0 or 1 <= self.itl_stretch < float("inf")):
            raise ValueError(f"itl_stretch must be 0 (off) or a finite factor >= 1, got {self.itl_stretch}")
        if not 0 <= self.batch_wait <= MAX_BATCH_WAIT:
            raise ValueError(f"batch_wait must be in [0, {MAX_BATCH_WAIT:g}] seconds (0 = off), got {self.batch_wait}")
        if self.batch_wait_batch < 0:
            raise ValueError(f"batch_wait_batch must be >= 0 (0 = max_num_seqs), got {self.batch_wait_batch}")

    @classmethod
    def preset(cls, name: str, **overrides) -> SchedulerConfig:
        if name not in SCHEDULER_PRESETS:
            raise ValueError(f"unknown scheduler preset {name!r}; choose from {sorted(SCHEDULER_PRESETS)}")
        return cls(**{**SCHEDULER_PRESETS[name], **overrides})


# Latency: small steps so decodes are never stuck behind a long prefill. Throughput: big batches,
# prefill allowed to stretch a step further (newcomers start sooner, running streams pay for it).
SCHEDULER_PRESETS = {
    "latency": dict(max_num_batched_tokens=256, max_num_seqs=16, target_itl=0.05, itl_stretch=1.5, batch_wait=0.0),
    "throughput": dict(max_num_batched_tokens=2048, max_num_seqs=64, target_itl=0.25, itl_stretch=0.0,
                       batch_wait=0.005),
}


class SpeculativeMethod(enum.Enum):
    NGRAM = "ngram"             # prompt lookup: continue an earlier occurrence of the last n-gram
    DRAFT = "draft"             # a second, smaller kiln artifact with the same tokenizer


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to num_speculative_tokens next tokens of a
    decoding request and one engine call verifies them with the next token's own logits."""
    method: SpeculativeMethod = SpeculativeMethod.NGRAM
    num_speculative_tokens: int = 5     # k, the most proposals per request and step
    draft_path: Path | None = None      # the draft artifact (method DRAFT)
    # Load: decodes plus proposals one step may verify. Past it the engine turns compute-bound
    # and proposals stop paying; k shrinks as the decode batch grows (0 from this many decodes).
    max_step_tokens: int = 16
    # Speculate only while at most this many requests decode: the ORT planner runs k+1-token
    # verifications and single-token decodes in separate calls, so beside other decodes proposals
    # cost a weight read of their own (4 chat streams on SmolLM2 measured slower with it:
    # docs/results/2026-11-30-speculative-decoding.md).
    max_decodes: int = 1
    ngram_min: int = 2                  # prompt lookup's shortest and longest suffix to match
    ngram_max: int = 4

    def __post_init__(self):
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if self.max_decodes < 1:
            raise ValueError(f"max_decodes must be at least 1, got {self.max_decodes}")
        if self.max_step_tokens < 2:
            raise ValueError(f"max_step_tokens must be at least 2, got {self.max_step_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if (self.method is SpeculativeMethod.DRAFT) != (self.draft_path is not None):
            raise ValueError("a draft path goes with the draft method, and only with it")

    @classmethod
    def parse(cls, text: str, num_speculative_tokens: int | None = None) -> SpeculativeConfig:
        """`ngram` or `draft:PATH`, as --speculative takes it."""
        name, _, path = text.partition(":")
        try:
            method = SpeculativeMethod(name)
        except ValueError:
            raise ValueError(f"--speculative takes ngram or draft:PATH, got {text!r}") from None
        if method is SpeculativeMethod.DRAFT and not path:
            raise ValueError("--speculative draft:PATH needs the draft artifact's folder")
        if method is SpeculativeMethod.NGRAM and path:
            raise ValueError(f"--speculative ngram takes no path, got {text!r}")
        k = {} if num_speculative_tokens is None else {"num_speculative_tokens": num_speculative_tokens}
        return cls(method, draft_path=Path(path) if path else None, **k)


@dataclass(frozen=True)
class RuntimeConfig:
    kv_cache_memory: int | None = None     # bytes for the KV pool; None = a fraction of free memory
    kv_cache_fraction: float = 0.25        # of available memory, when kv_cache_memory is None
    max_kv_blocks: int | None = None       # hard cap (tests use tiny pools)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int | None = None             # engine intra-op threads; None = the CPUs we may use
    seed: int | None = None                # default seed for requests that set none
    speculative: SpeculativeConfig | None = None     # None: one token per decode step

    def with_ttft_target(self, seconds: float) -> RuntimeConfig:
        """This config with the scheduler serving a TTFT objective of `seconds` (a late prompt
        gets longer steps: SchedulerConfig.target_ttft), unless it names its own."""
        if self.scheduler.target_ttft or not seconds:
            return self
        return replace(self, scheduler=replace(self.scheduler, target_ttft=seconds))

    def __post_init__(self):
        if not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError("kv_cache_fraction must be in (0, 0.95]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")


DEFAULT_TTFT_SLO = 2.0      # seconds: the bound the project's goodput figures use
# Past this multiple of the objective (10 s by default) a queued request is refused: an interactive client has
# given up by then, and a benchmark's closed loop at any sane concurrency stays far below it.
DEFAULT_TTFT_REFUSE_FACTOR = 5.0


LOG_LEVELS = ("debug", "info", "warning", "error")


# The endpoints outside /v1 that need the API key when one is set, unless public_endpoints names them.
KEYED_ENDPOINTS = ("/health", "/ready", "/metrics", "/version", "/openapi.json", "/docs")


def _at_least_one(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _positive_seconds(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value}")


@dataclass(frozen=True)
class AdmissionConfig:
    """Admission control: a request over any bound is refused at once with 429."""
    ttft_slo: float = DEFAULT_TTFT_SLO       # seconds: the TTFT objective admission predicts against; 0 = off
    # Refuse (429) only past this multiple of the objective: a request predicted later than the
    # objective but within it queues, as a vLLM-like server would (1: refuse at the objective).
    ttft_refuse_factor: float = DEFAULT_TTFT_REFUSE_FACTOR
    max_waiting: int | None = 256            # admitted requests still waiting for their first token
    max_waiting_tokens: int | None = None    # their prompt tokens

    def __post_init__(self):
        if not 0 <= self.ttft_slo < float("inf"):
            raise ValueError(f"ttft_slo must be a finite number of seconds >= 0 (0 = off), got {self.ttft_slo}")
        if not 1 <= self.ttft_refuse_factor < float("inf"):
            raise ValueError(f"ttft_refuse_factor must be a finite number >= 1, got {self.ttft_refuse_factor}")
        _at_least_one(self, "max_waiting", "max_waiting_tokens")


@dataclass(frozen=True)
class ResponseCacheConfig:
    """The exact-match response cache for deterministic requests (temperature 0 or a fixed seed);
    --no-response-cache turns it off."""
    enabled: bool = True
    max_entries: int = 1024
    max_bytes: int = 64 << 20
    ttl: float = 600.0                       # seconds an entry lives

    def __post_init__(self):
        _at_least_one(self, "max_entries", "max_bytes")
        _positive_seconds(self, "ttl")


@dataclass(frozen=True)
class SemanticCacheConfig:
    """The semantic response cache (opt-in, --semantic-cache; docs/serving.md): a stored answer for a
    paraphrase of a deterministic chat question."""
    enabled: bool = False
    model: Path | None = None                # the embedding model's folder; None: the exported all-MiniLM-L6-v2
    threshold: float = 0.9                   # the cosine at or above which a stored question matches
    max_entries: int = 1024
    max_bytes: int = 32 << 20
    ttl: float = 600.0

    def __post_init__(self):
        if not -1 <= self.threshold <= 1:
            raise ValueError(f"the semantic cache's threshold is a cosine in [-1, 1], got {self.threshold}")
        _at_least_one(self, "max_entries", "max_bytes")
        _positive_seconds(self, "ttl")


@dataclass(frozen=True)
class ServeConfig:
    """The HTTP server's own knobs, a nested config per concern (admission, the two response caches),
    each checking itself; the runtime's (KV memory, scheduler) stay in RuntimeConfig."""
    host: str = "127.0.0.1"                  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None     # default: the artifact folder's name
    console: bool = True                     # the playground and dashboard at / (--no-console)
    # The engine in a process of its own (kiln/runtime/engine_process.py); False: on a thread of
    # the server's process (--no-engine-process).
    engine_process: bool = True
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    request_timeout: float | None = 600.0    # seconds; the request ends with finish_reason "timeout"
    response_cache: ResponseCacheConfig = field(default_factory=ResponseCacheConfig)
    semantic_cache: SemanticCacheConfig = field(default_factory=SemanticCacheConfig)
    max_body_bytes: int = 4 << 20            # larger bodies get 413 before they are parsed
    # Limits and faults (docs/serving.md, Limits and faults); None: off.
    limit_concurrency: int | None = 512      # open connections (or requests) past which uvicorn answers 503
    keep_alive_timeout: float = 5.0          # seconds an idle keep-alive connection stays open
    body_timeout: float | None = 30.0        # seconds a request's whole body may take to arrive; 408 past it
    step_timeout: float | None = 60.0        # seconds one engine step may run before the server faults
    # kiln's own loggers: "debug" adds admission's predicted-vs-realised TTFT and a line per engine
    # step (decodes, prefill tokens, budget, engine / own / cycle ms); libraries stay at info.
    log_level: str = "info"
    # Security and tenants (docs/serving.md). api_keys: (name, key) pairs, from --api-key-file;
    # each key gets its own prefix-cache salt unless per_key_cache_salt is off.
    api_keys: tuple[tuple[str, str], ...] = ()
    # (key name, lowest, highest): the `priority` range a key may send (--api-key-file's
    # priority=LOW:HIGH); other keys get requests.DEFAULT_PRIORITY_RANGE.
    key_priorities: tuple[tuple[str, int, int], ...] = ()
    # With API keys: a key's requests in flight reserve at most this many contexts of tokens
    # (choices x (prompt + max_tokens)); past it 429. None: no bound.
    max_key_contexts: int | None = 64
    # Endpoints outside /v1 that answer without the key when one is set (the health probes).
    public_endpoints: tuple[str, ...] = ("/health", "/ready")
    per_key_cache_salt: bool = True
    allow_control_tokens_in_messages: bool = False   # special-token text in messages stays text
    allowed_hosts: tuple[str, ...] | None = None     # None: loopback names when bound to loopback
    cors_origins: tuple[str, ...] = ()               # browser origins allowed (none by default)
    # Unknown body fields: False (vLLM's way) drops them, names them in the X-Kiln-Ignored-Fields
    # header and logs them; True (--strict-api) refuses them with 400.
    strict_api: bool = False
    chat_template: Path | None = None                # a template file replacing the artifact's (--chat-template)
    tool_call_parser: str | None = None              # the tool-call syntax; None: the template's (--tool-call-parser)

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a key, or none to serve without one")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        unknown = sorted(set(self.public_endpoints) - set(KEYED_ENDPOINTS))
        if unknown:
            raise ValueError(f"public_endpoints may name {', '.join(KEYED_ENDPOINTS)}; got {', '.join(unknown)}")
        _at_least_one(self, "limit_concurrency", "max_body_bytes", "max_key_contexts")
        _positive_seconds(self, "body_timeout", "step_timeout", "keep_alive_timeout")
