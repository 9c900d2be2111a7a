"""kiln on a Ray cluster of two nodes, as on two machines: `ray start --head` and `ray start --address`
on this machine (each node its own processes, its own loopback address and its own custom resource),
`kiln serve --ray-address` joining it with one replica on each node (one CPU per node, one per
replica), requests through the ingress, then the second node killed (its raylet and every process
under it, SIGKILL) and requests succeeding on the first.

Loopback only: the nodes are 127.0.0.2 and 127.0.0.3 (Ray turns 127.0.0.1 into the machine's
routable address; other loopback addresses it keeps), the HTTP entry point 127.0.0.1. Token
authentication on, as Ray starts a cluster by default. One module-scoped cluster; slow: starting two
nodes and a Serve application on two cores takes most of a minute."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="the scale extra: pip install -e '.[scale]'")
psutil = pytest.importorskip("psutil")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
HEAD_IP, SECOND_IP = "127.0.0.2", "127.0.0.3"
MODEL = "tiny-llama"
START_DEADLINE = 300.0     # seconds for the nodes and the application to come up on a busy machine
RECOVERY_DEADLINE = 90.0   # seconds after the node's death within which 5 requests in a row succeed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ok, deadline: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended ({proc.returncode}):\n{_tail(log)}")
        if ok():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {deadline:.0f}s\n{_tail(log)}")


def _tail(log: Path | None) -> str:
    return log.read_text()[-4000:] if log is not None and log.exists() else ""


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


class Node:
    """One `ray start --block`: the node lives in the processes under it (raylet, agents, workers)."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", *args], env=env,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """Every process of the node at once, as when its machine goes away."""
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait(timeout=30)


# Placement as the cluster's control store (GCS) records it, read by a driver of its own: each live
# kiln actor with the custom resources of the node it runs on.
PLACEMENT = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], log_to_driver=False)
nodes = {n["NodeID"]: n for n in ray.nodes()}
rows = []
for actor in state.actors().values():
    if actor["State"] == "ALIVE" and "kiln" in actor["ActorClassName"]:
        node = nodes[actor["Address"]["NodeID"]]
        rows.append([actor["ActorClassName"], node["NodeManagerAddress"],
                     sorted(k for k in node["Resources"] if k.startswith("kiln-"))])
alive = sorted(n["NodeManagerAddress"] for n in nodes.values() if n["Alive"])
print(json.dumps({"actors": rows, "alive_nodes": alive}))
"""


@pytest.fixture(scope="module")
def two_nodes(tiny_llama_artifact):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    # a short path: Ray's Unix sockets live under it (at most 107 characters)
    temp = Path(tempfile.mkdtemp(prefix="kiln-ray-"))
    gcs = _free_port()
    address = f"{HEAD_IP}:{gcs}"
    common = ["--num-cpus", "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats",
              "--dashboard-agent-listen-port"]
    nodes: list[Node] = []
    server = None
    try:
        nodes.append(Node(["--head", "--node-ip-address", HEAD_IP, "--port", str(gcs), "--temp-dir", str(temp),
                           "--include-dashboard", "false", "--dashboard-port", str(_free_port()),
                           "--ray-client-server-port", str(_free_port()),
                           "--resources", json.dumps({"kiln-head": 1}), *common, str(_free_port())],
                          env, temp / "head.log"))
        _wait("the head node", lambda: _listening(HEAD_IP, gcs), START_DEADLINE, nodes[0].proc, nodes[0].log)
        nodes.append(Node(["--address", address, "--node-ip-address", SECOND_IP,
                           "--resources", json.dumps({"kiln-second": 1}), *common, str(_free_port())],
                          env, temp / "second.log"))
        port = _free_port()
        server_log = temp / "serve.log"
        # two replicas of one CPU on two nodes of one CPU each: one replica per node
        server = subprocess.Popen(
            [str(BIN / "kiln"), "serve", str(tiny_llama_artifact), "--ray-address", address, "--replicas", "2",
             "--replica-cpus", "1", "--threads", "1", "--kv-cache-memory", "32MiB", "--host", "127.0.0.1",
             "--port", str(port), "--served-model-name", MODEL],
            env=env, stdout=server_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            # kiln serve announces its URL once Serve runs the application: every replica placed and
            # started (the second node joins while the first replica loads)
            if "serving on Ray Serve" not in server_log.read_text():
                return False
            try:
                return httpx.get(f"{url}/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        _wait("kiln serve --ray-address", ready, START_DEADLINE, server, server_log)
        yield url, address, env, nodes
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        for node in reversed(nodes):
            node.kill()
        shutil.rmtree(temp, ignore_errors=True)


def _cluster(address: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", PLACEMENT, address], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _replicas(address: str, env: dict) -> list[tuple[str, list[str]]]:
    """(node address, the node's kiln resources) of each live kiln replica."""
    return sorted((ip, res) for name, ip, res in _cluster(address, env)["actors"] if "kiln-replica" in name)


def _complete(url: str, prompt: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def _routed(url: str) -> dict[str, float]:
    """The ingress's kiln_ingress_requests_total, by the replica each request went to."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kiln_ingress_requests_total"}


def _sent_to(url: str, prompts: list[str]) -> set[str]:
    """The replicas these prompts went to, from the ingress's books before and after."""
    before = _routed(url)
    for prompt in prompts:
        _complete(url, prompt)
    after = _routed(url)
    moved = {replica for replica, n in after.items() if n > before.get(replica, 0)}
    assert sum(after.values()) - sum(before.get(r, 0) for r in after) == len(prompts), (before, after)
    return moved


def test_one_replica_on_each_node_both_serving_through_the_ingress(two_nodes):
    url, address, env, _ = two_nodes
    assert _replicas(address, env) == [(HEAD_IP, ["kiln-head"]), (SECOND_IP, ["kiln-second"])]
    # distinct prefixes spread over both replicas, so both nodes answer
    assert len(_sent_to(url, [f"Topic {i} " * 40 for i in range(8)])) == 2
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4


def test_requests_succeed_on_the_first_node_after_the_second_is_killed(two_nodes):
    url, address, env, nodes = two_nodes
    both = _sent_to(url, [f"Subject {i} " * 40 for i in range(8)])
    assert len(both) == 2
    nodes[1].kill()
    killed = time.monotonic()
    # requests keep coming while Ray finds the node gone (its health checks) and Serve reacts; then
    # 5 in a row must succeed, all within the deadline
    in_a_row, failures, sent, seen_dead, last_look = 0, 0, 0, False, 0.0
    while not (seen_dead and in_a_row >= 5):
        assert time.monotonic() - killed < RECOVERY_DEADLINE, \
            f"not recovered within {RECOVERY_DEADLINE:.0f}s: node seen dead {seen_dead}, {failures} failed"
        if not seen_dead and time.monotonic() - last_look > 3:
            seen_dead, last_look = SECOND_IP not in _cluster(address, env)["alive_nodes"], time.monotonic()
            in_a_row = 0 if seen_dead else in_a_row       # the 5 count from the death's detection on
        try:
            _complete(url, f"After the loss {sent} " * 20)
            in_a_row += 1
        except (AssertionError, httpx.HTTPError):
            in_a_row, failures = 0, failures + 1
            time.sleep(1)
        sent += 1
    # what follows goes to the survivor alone: one of the two replicas from before, on the head node
    survivor = _sent_to(url, [f"Then {i} " * 40 for i in range(5)])
    assert len(survivor) == 1 and survivor <= both, (survivor, both)
    assert _replicas(address, env) == [(HEAD_IP, ["kiln-head"])]
