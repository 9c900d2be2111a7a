"""Small frozen configs per concern. Runtime-derived values (e.g. the number of KV blocks) are
computed from these at start-up and never written back."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.scheduler import SchedulerConfig


@dataclass(frozen=True)
class RuntimeConfig:
    kv_cache_memory: int | None = None     # bytes for the KV pool; None = a fraction of free memory
    kv_cache_fraction: float = 0.25        # of available memory, when kv_cache_memory is None
    max_kv_blocks: int | None = None       # hard cap (tests use tiny pools)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int | None = None             # engine intra-op threads; None = the CPUs we may use
    seed: int | None = None                # default seed for requests that set none

    def __post_init__(self):
        if not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError("kv_cache_fraction must be in (0, 0.95]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
