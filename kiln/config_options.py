"""User-facing runtime knobs (the `--kv-cache-memory`, `--policy` … options of generate, serve, bench
and the Triton repository's parameters) turned into a RuntimeConfig, in one place."""

from __future__ import annotations

from kiln.config import RuntimeConfig, SchedulerConfig, SpeculativeConfig
from kiln.units import parse_bytes

# The knob names, as keyword arguments of runtime_config() and as Triton model parameters.
RUNTIME_KNOBS = ("kv_cache_memory", "policy", "max_num_seqs", "token_budget", "max_model_len",
                 "no_prefix_caching", "threads", "target_itl", "speculative", "num_speculative_tokens",
                 "batch_wait_ms")
UNBOUNDED_MODEL_LEN = 1 << 30      # clipped to the artifact's context by the engine core


def runtime_config(kv_cache_memory: str | None = None, policy: str | None = None,
                   max_num_seqs: int | None = None, token_budget: int | None = None,
                   max_model_len: int | None = None, no_prefix_caching: bool = False,
                   threads: int | None = None, target_itl: float | str | None = None,
                   speculative: str | None = None, num_speculative_tokens: int | str | None = None,
                   batch_wait_ms: float | str | None = None) -> RuntimeConfig:
    """kv_cache_memory is a size text ("2GiB"); policy a scheduler preset; target_itl seconds (a
    number or its text, as Triton parameters carry it); batch_wait_ms milliseconds (likewise); speculative `ngram` or `draft:PATH`;
    None keeps the default."""
    knobs = {k: v for k, v in dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget,
                                   max_model_len=max_model_len).items() if v is not None}
    if target_itl is not None:
        knobs["target_itl"] = float(target_itl)
    if batch_wait_ms is not None:
        knobs["batch_wait"] = float(batch_wait_ms) / 1e3
    knobs.setdefault("max_model_len", UNBOUNDED_MODEL_LEN)
    if no_prefix_caching:
        knobs["enable_prefix_caching"] = False
    sched = SchedulerConfig.preset(policy, **knobs) if policy else SchedulerConfig(**knobs)
    return RuntimeConfig(kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory else None,
                         scheduler=sched, threads=threads,
                         speculative=_speculative(speculative, num_speculative_tokens))


def _speculative(method: str | None, num_tokens: int | str | None) -> SpeculativeConfig | None:
    if not method:
        if num_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative ngram|draft:PATH")
        return None
    return SpeculativeConfig.parse(method, None if num_tokens is None else int(num_tokens))
