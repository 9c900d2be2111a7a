"""What the console reads from `kiln serve` (the card, the stats history and stream), --no-console,
and the Grafana dashboard shipped in deploy/grafana: HTTP on loopback, no browser."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import promql_parser

from kiln.contract.artifact import EngineArtifact

from serving_flags import TINY_FLAGS

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kiln.json"
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def test_the_page_and_its_static_files(tiny_server):
    page = httpx.get(f"{tiny_server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in re.findall(r'(?:src|href)="(/console/static/[^"]+)"', page.text):
        r = httpx.get(f"{tiny_server.url}{src}")
        assert r.status_code == 200 and len(r.content) > 100, src
    assert "http://" not in page.text and "https://" not in page.text      # nothing from a CDN


def test_card_describes_the_loaded_artifact(tiny_server, tiny_llama_artifact):
    card = httpx.get(f"{tiny_server.url}/console/api/card").json()
    manifest = EngineArtifact.load(tiny_llama_artifact, verify=False).manifest
    assert card["model"] == "tiny-llama-none"
    assert card["architecture"]["layers"] == manifest.spec.num_layers
    assert card["quantization"]["mode"] == manifest.quant["mode"]
    assert card["buckets"] == manifest.buckets.to_dict()
    assert [p["name"] for p in card["passes"]] == [p["name"] for p in manifest.passes]
    assert card["kv"]["blocks"] == tiny_server.metrics()["kiln_kv_blocks_total"]
    assert card["kv"]["block_size"] == manifest.kv_layout.block_size
    assert card["max_model_len"] == manifest.generation["max_model_len"]


def test_stats_stream_sends_history_then_points(tiny_server):
    with httpx.stream("GET", f"{tiny_server.url}/console/api/stats/stream", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
        name, history = next(events)
        assert name == "history" and history["period"] == 1.0
        name, p = next(events)                   # within about one period
    assert name == "point" and p["kv_total"] == tiny_server.metrics()["kiln_kv_blocks_total"]
    assert set(p) >= {"t", "running", "waiting", "kv_used", "batch", "tokens_per_s", "prefix_hit_rate",
                      "rejected_429", "ttft", "itl"}
    points = httpx.get(f"{tiny_server.url}/console/api/stats").json()["points"]
    assert points and points[-1]["t"] >= p["t"]


def _sse(lines):
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])


def test_no_console(start_server, tiny_llama_artifact):
    server = start_server(tiny_llama_artifact, *TINY_FLAGS, "--no-console")
    for path in ("/", "/console/api/card", "/console/api/stats", "/console/static/console.js"):
        assert httpx.get(f"{server.url}{path}").status_code == 404, path
    assert httpx.get(f"{server.url}/v1/models").status_code == 200


def _exported_names(metrics_text: str) -> set[str]:
    """Every sample name /metrics can show: the samples present, and those a labelled family
    without children yet (no 429 so far, say) would show."""
    names = {line.split("{")[0].split(" ")[0] for line in metrics_text.splitlines() if line and line[0] != "#"}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", metrics_text, re.M):
        if kind == "counter":
            family = family.removesuffix("_total")     # some prometheus-client versions name it so
        names.update(family + suffix for suffix in SAMPLE_SUFFIXES.get(kind, ("",)))
    return names


# Grafana's variables, replaced by what they stand for before a query is parsed as PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


def _metric_names(node) -> set[str]:
    """The metric names a parsed PromQL expression selects."""
    if isinstance(node, promql_parser.VectorSelector):
        return {node.name}
    names = set()
    for attr in ("expr", "lhs", "rhs", "args", "vector_selector", "param"):
        child = getattr(node, attr, None)
        for c in child if isinstance(child, list) else [child]:
            if c is not None and not isinstance(c, (str, int, float)):
                names |= _metric_names(c)
    return names


def _queried_metrics(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            names |= _metric_names(promql_parser.parse(expr))      # ValueError on bad PromQL
    for variable in dashboard["templating"]["list"]:
        if "definition" in variable:                              # label_values(metric, label)
            names.add(re.fullmatch(r"label_values\((\w+), *\w+\)", variable["definition"]).group(1))
    return names


def test_grafana_dashboard_queries_only_metrics_the_server_exports(tiny_server):
    dashboard = json.loads(GRAFANA.read_text())
    exported = _exported_names(httpx.get(f"{tiny_server.url}/metrics").text)
    queried = _queried_metrics(dashboard)
    assert len(queried) >= 15
    assert queried <= exported, f"not in /metrics: {sorted(queried - exported)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
