"""How many KV blocks fit: from an explicit budget or a fraction of available memory."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kiln.config import RuntimeConfig
from kiln.contract.engine import KvLayout
from kiln.units import format_bytes


@dataclass(frozen=True)
class KvPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    context_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_sequences(self) -> int:
        return self.num_blocks // -(-self.context_len // self.block_size)

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks:,} blocks = {self.num_tokens:,} tokens = "
                f"{self.num_sequences:,} sequences at context {self.context_len} "
                f"({format_bytes(self.num_blocks * self.bytes_per_block)})")


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"]
    except (OSError, KeyError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_kv_blocks(layout: KvLayout, config: RuntimeConfig, context_len: int) -> KvPlan:
    budget = config.kv_cache_memory or int(available_memory() * config.kv_cache_fraction)
    blocks = budget // layout.bytes_per_block
    if config.max_kv_blocks is not None:
        blocks = min(blocks, config.max_kv_blocks)
    if blocks < 1:
        raise ValueError(f"the KV cache budget {format_bytes(budget)} holds no block "
                         f"({format_bytes(layout.bytes_per_block)} each); raise --kv-cache-memory")
    return KvPlan(blocks, layout.block_size, layout.bytes_per_block, context_len)
