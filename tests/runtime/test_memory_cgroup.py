"""The default KV pool respects the container: available_memory() reads the cgroup limit (v2 and v1)
from a cgroup tree given as a folder, so these tests lay out the files a kernel would."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.config import RuntimeConfig
from kiln.contract.engine import KvLayout
from kiln.runtime.memory import available_memory, cgroup_memory_room, plan_kv_blocks

GiB = 1 << 30
V1_NO_LIMIT = 9223372036854771712          # what a v1 memory.limit_in_bytes says without a limit


def write(folder: Path, **files: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name.replace("__", ".")).write_text(f"{value}\n")
    return folder


def machine(tmp_path: Path, own_cgroup: str, host_available: int = 64 * GiB) -> dict[str, Path]:
    """available_memory()'s inputs: a cgroup root, /proc/self/cgroup and /proc/meminfo."""
    (tmp_path / "cgroup").write_text(own_cgroup)
    (tmp_path / "meminfo").write_text(f"MemTotal: {128 * GiB // 1024} kB\nMemAvailable: {host_available // 1024} kB\n")
    return {"cgroup_root": tmp_path / "fs", "self_cgroup": tmp_path / "cgroup", "meminfo": tmp_path / "meminfo"}


def test_v2_a_containers_limit_less_its_working_set(tmp_path):
    paths = machine(tmp_path, "0::/\n")
    # a container with a cgroup namespace: its own group is the root of what it sees
    write(paths["cgroup_root"], cgroup__controllers="cpu memory", memory__max=8 * GiB, memory__current=3 * GiB,
          memory__stat=f"anon {2 * GiB}\nfile {GiB}\ninactive_file {GiB // 2}\n")
    # 8 GiB - (3 GiB used - 0.5 GiB inactive file cache, which the kernel reclaims first)
    assert cgroup_memory_room(paths["cgroup_root"], paths["self_cgroup"]) == 8 * GiB - (3 * GiB - GiB // 2)
    assert available_memory(**paths) == 8 * GiB - (3 * GiB - GiB // 2)


def test_v2_the_tightest_of_the_groups_ancestors(tmp_path):
    paths = machine(tmp_path, "0::/kubepods/pod1/ctr\n")
    root = write(paths["cgroup_root"], cgroup__controllers="memory")
    write(root / "kubepods", memory__max="max", memory__current=40 * GiB)
    write(root / "kubepods" / "pod1", memory__max=6 * GiB, memory__current=5 * GiB)      # the pod: 1 GiB left
    write(root / "kubepods" / "pod1" / "ctr", memory__max=4 * GiB, memory__current=GiB)  # the container: 3 GiB
    assert available_memory(**paths) == 1 * GiB


def test_v2_without_a_limit_the_hosts_available_memory(tmp_path):
    paths = machine(tmp_path, "0::/user.slice/session-1.scope\n", host_available=20 * GiB)
    root = write(paths["cgroup_root"], cgroup__controllers="memory")
    write(root / "user.slice" / "session-1.scope", memory__max="max", memory__current=GiB)
    assert cgroup_memory_room(paths["cgroup_root"], paths["self_cgroup"]) is None
    assert available_memory(**paths) == 20 * GiB


def test_the_host_is_the_bound_when_it_has_less_than_the_limit_leaves(tmp_path):
    paths = machine(tmp_path, "0::/\n", host_available=2 * GiB)
    write(paths["cgroup_root"], cgroup__controllers="memory", memory__max=16 * GiB, memory__current=GiB)
    assert available_memory(**paths) == 2 * GiB


def test_v1_limit_in_bytes_and_its_no_limit_value(tmp_path):
    paths = machine(tmp_path, "12:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n")
    v1 = write(paths["cgroup_root"] / "memory", memory__limit_in_bytes=V1_NO_LIMIT, memory__usage_in_bytes=50 * GiB)
    write(v1 / "docker" / "abc", memory__limit_in_bytes=8 * GiB, memory__usage_in_bytes=2 * GiB,
          memory__stat=f"cache {GiB}\ntotal_inactive_file {GiB}\n")
    assert available_memory(**paths) == 8 * GiB - GiB
    # without a limit anywhere: the host's
    write(v1 / "docker" / "abc", memory__limit_in_bytes=V1_NO_LIMIT)
    assert available_memory(**paths) == 64 * GiB


def test_v1_inside_a_container_that_sees_the_hosts_path(tmp_path):
    """Without a cgroup namespace /proc/self/cgroup names the host's path, and the container's own
    group is mounted at the root of what it sees."""
    paths = machine(tmp_path, "4:memory:/kubepods/burstable/pod9/abc\n")
    write(paths["cgroup_root"] / "memory", memory__limit_in_bytes=4 * GiB, memory__usage_in_bytes=GiB)
    assert available_memory(**paths) == 3 * GiB


def test_no_cgroup_files_at_all(tmp_path):
    paths = machine(tmp_path, "")
    assert cgroup_memory_room(paths["cgroup_root"], paths["self_cgroup"]) is None
    assert available_memory(**paths) == 64 * GiB


def test_a_group_over_its_limit_leaves_no_room(tmp_path):
    paths = machine(tmp_path, "0::/\n")
    write(paths["cgroup_root"], cgroup__controllers="memory", memory__max=GiB, memory__current=2 * GiB)
    assert available_memory(**paths) == 0


def test_the_default_budget_is_a_fraction_of_available_memory():
    import kiln.runtime.memory as memory

    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    expected = int(memory.available_memory() * 0.25) // layout.bytes_per_block
    plan = plan_kv_blocks(layout, RuntimeConfig(), 2048)
    # the machine's memory moves between the two reads; a block either way
    assert abs(plan.num_blocks - expected) <= max(1, expected // 100)
    assert plan_kv_blocks(layout, RuntimeConfig(kv_cache_memory=10 * layout.bytes_per_block), 2048).num_blocks == 10


@pytest.mark.parametrize("text", ["max\n", "garbage\n"])
def test_unreadable_limits_are_no_limits(tmp_path, text):
    paths = machine(tmp_path, "0::/\n")
    write(paths["cgroup_root"], cgroup__controllers="memory", memory__max=text.strip())
    assert cgroup_memory_room(paths["cgroup_root"], paths["self_cgroup"]) is None
