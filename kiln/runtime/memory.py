"""How many KV blocks fit: from an explicit budget or a fraction of available memory (the host's, or
less where the container's cgroup sets a memory limit)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
V1_UNLIMITED = 1 << 60         # cgroup v1 writes "no limit" as 2**63 - 1 rounded down to a page


def available_memory(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP,
                     meminfo: Path = MEMINFO) -> int:
    """Bytes this process can still take: the host's MemAvailable, or less where the cgroup it runs in
    (a container's, a pod's) has a memory limit: a pool sized from the host alone outgrows the
    container, and the kernel kills it under load (pages are touched lazily, so late)."""
    host = host_available_memory(meminfo)
    room = cgroup_memory_room(cgroup_root, self_cgroup)
    return host if room is None else min(host, room)


def host_available_memory(meminfo: Path = MEMINFO) -> int:
    try:
        with open(meminfo) as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"]
    except (OSError, KeyError, IndexError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cgroup_memory_room(root: Path = CGROUP_ROOT, self_cgroup: Path = PROC_SELF_CGROUP) -> int | None:
    """The bytes left under the tightest memory limit on this process's cgroup and its ancestors
    (limit - usage at the level that sets it), or None where no limit is set or none can be read.
    cgroup v2 (root holds cgroup.controllers): memory.max and memory.current; v1: root/memory's
    memory.limit_in_bytes and memory.usage_in_bytes. Usage leaves out the inactive file cache (the
    working set, as the kubelet counts it): the kernel reclaims those pages before it kills."""
    own = _own_cgroups(self_cgroup)
    if (root / "cgroup.controllers").is_file():
        limits = [_v2_room(d) for d in _levels(root, own.get("", "/"))]
    elif (root / "memory").is_dir():
        limits = [_v1_room(d) for d in _levels(root / "memory", own.get("memory", "/"))]
    else:
        return None
    rooms = [r for r in limits if r is not None]
    return min(rooms) if rooms else None


def _own_cgroups(self_cgroup: Path) -> dict[str, str]:
    """controller -> this process's cgroup path, from /proc/self/cgroup ("" for the v2 hierarchy)."""
    own: dict[str, str] = {}
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                own[controller] = parts[2]
    return own


def _levels(base: Path, own: str) -> list[Path]:
    """The process's cgroup folder under `base` and each ancestor up to `base`. Inside a container
    without a cgroup namespace /proc/self/cgroup names the host's path while `base` is already the
    container's own group: then `base` alone."""
    leaf = base / own.strip("/")
    if not leaf.is_dir():
        return [base]
    return [leaf, *[p for p in leaf.parents if p == base or base in p.parents]]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None      # v2's "max": no limit


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _room(limit: int | None, usage: int | None, reclaimable: int) -> int | None:
    if limit is None:
        return None
    return max(limit - max((usage or 0) - reclaimable, 0), 0)


def _v2_room(group: Path) -> int | None:
    return _room(_read_int(group / "memory.max"), _read_int(group / "memory.current"),
                 _inactive_file(group / "memory.stat", "inactive_file"))


def _v1_room(group: Path) -> int | None:
    limit = _read_int(group / "memory.limit_in_bytes")
    return _room(None if limit is None or limit >= V1_UNLIMITED else limit,
                 _read_int(group / "memory.usage_in_bytes"),
                 _inactive_file(group / "memory.stat", "total_inactive_file"))


def default_kv_budget(config: RuntimeConfig) -> int:
    """The KV pool's bytes when --kv-cache-memory is not given: a fraction of what this process can
    still take (available_memory)."""
    return int(available_memory() * config.kv_cache_fraction)


def plan_kv_blocks(layout: KvLayout, config: RuntimeConfig, context_len: int) -> KvPlan:
    budget = config.kv_cache_memory or default_kv_budget(config)
    blocks = budget // layout.bytes_per_block
    if config.max_kv_blocks is not None:
        blocks = min(blocks, config.max_kv_blocks)
    if blocks < 1:
        raise ValueError(f"the KV cache budget {format_bytes(budget)} holds no block "
                         f"({format_bytes(layout.bytes_per_block)} each); raise --kv-cache-memory")
    return KvPlan(blocks, layout.block_size, layout.bytes_per_block, context_len)
