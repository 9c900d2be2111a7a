"""The Kubernetes manifests state each container's KV pool, and it fits under the container's
memory limit with room for the weights and the runtime."""

from __future__ import annotations

from pathlib import Path

import yaml

from kiln.units import parse_bytes

K8S = Path(__file__).parents[2] / "deploy" / "k8s"
QUANTITIES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}


def quantity(text: str) -> int:
    """A Kubernetes memory quantity (8Gi, 512Mi, 1G) in bytes."""
    for suffix in sorted(QUANTITIES, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * QUANTITIES[suffix])
    return int(text)


def kiln_serve_containers() -> list[tuple[str, dict]]:
    """Every container that runs `kiln serve` (a Job running `kiln build` holds no KV pool)."""
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec") or {}
            pod = spec.get("template", {}).get("spec") or spec.get("predictor") or {}
            found += [(path.name, c) for c in pod.get("containers", []) if c.get("command") == ["kiln"] and c.get("args", [None])[0] == "serve"]
    return found


def test_every_kiln_container_states_a_kv_pool_under_its_memory_limit():
    containers = kiln_serve_containers()
    assert {name for name, _ in containers} >= {"kiln.yaml", "kserve.yaml"}
    for name, container in containers:
        args = container["args"]
        assert "--kv-cache-memory" in args, f"{name}: the KV pool is not stated"
        pool = parse_bytes(args[args.index("--kv-cache-memory") + 1])
        limit = quantity(container["resources"]["limits"]["memory"])
        assert pool <= limit // 2, f"{name}: a {pool}-byte pool leaves too little of the {limit}-byte limit"
