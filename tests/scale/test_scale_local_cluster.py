"""The local Ray cluster `kiln serve --replicas` starts: its own ports on loopback unless asked, and
one KV budget shared by the replicas on the machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the scale extra: pip install -e '.[scale]'")

from kiln.config import RuntimeConfig  # noqa: E402
from kiln.runtime.memory import default_kv_budget  # noqa: E402
from kiln.scale.app import ScaleOptions, shared_kv_budget  # noqa: E402

# Started in a process of its own: Ray's address choice is process-wide, and this test's must not
# reach the other Ray tests of the session.
LISTENERS = """
import json, psutil, ray
from kiln.scale.app import start_local_ray
start_local_ray(1)
try:
    me = psutil.Process()
    pids = {me.pid, *(p.pid for p in me.children(recursive=True))}
    print(json.dumps(sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                             if c.status == psutil.CONN_LISTEN and c.pid in pids})))
finally:
    ray.shutdown()
"""


def test_the_local_clusters_ports_listen_on_loopback_only():
    done = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    addresses = json.loads(done.stdout.strip().splitlines()[-1])
    assert addresses, "no listening port found for Ray's processes"
    assert set(addresses) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, addresses


def test_replicas_on_one_machine_share_one_kv_budget():
    runtime = RuntimeConfig()
    one = default_kv_budget(runtime)
    shared = shared_kv_budget(runtime, ScaleOptions(replicas=2)).kv_cache_memory
    # the machine's free memory moves between two reads: within a percent
    assert abs(shared - one // 2) <= one // 100
    # autoscaling: split over the most replicas it may run
    assert abs(shared_kv_budget(runtime, ScaleOptions(replicas=1, max_replicas=4)).kv_cache_memory - one // 4) <= one // 100
    # a budget the user gave is each replica's, as given
    assert shared_kv_budget(RuntimeConfig(kv_cache_memory=1 << 30), ScaleOptions(replicas=3)).kv_cache_memory == 1 << 30
