"""`kiln bench`'s options reach the run grouped by concern (target, requests, load, outputs), and each
group refuses what cannot work when it is made, before anything loads."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import click
import pytest

from kiln.bench.cli_options import BenchCommand, Load, Outputs, Requests, Target, bench_options


def _parsed(*args: str) -> dict:
    """What click hands the `kiln bench` command for these arguments: every declared option."""
    command = bench_options(click.Command("bench"))
    return command.make_context("bench", list(args)).params


def test_every_declared_option_has_exactly_one_group():
    declared = set(_parsed()) - {"export_requests"}
    grouped = [f.name for group in (Target, Requests, Load, Outputs) for f in fields(group)]
    assert sorted(grouped) == sorted(declared)


def test_the_options_land_in_their_groups(tmp_path: Path):
    options = _parsed("--url", "http://127.0.0.1:9", "--concurrency", "1,4", "--slo-ttft", "2",
                      "--json", str(tmp_path / "r.json"), "--api-key", "k")
    options.pop("export_requests")
    command = BenchCommand.from_options(options)
    assert command.target.url == "http://127.0.0.1:9" and command.target.engine is None
    assert command.requests.server()["api_key"] == "k"
    assert command.outputs.json_path == tmp_path / "r.json"
    config = command.load.config()
    assert [level.concurrency for level in config.levels] == [1, 4]
    assert config.slo.ttft == 2.0


def test_an_option_without_a_group_is_refused():
    with pytest.raises(TypeError, match="no group"):
        BenchCommand.from_options({"url": "http://127.0.0.1:9", "warp_speed": 9})


@pytest.mark.parametrize("target, message", [
    (dict(), "exactly one target"),
    (dict(url="http://127.0.0.1:9", engine=Path(".")), "exactly one target"),
    (dict(url="http://127.0.0.1:9", compare=True), "--compare runs the artifact in-process"),
])
def test_a_target_that_cannot_run_is_refused_when_made(target, message):
    with pytest.raises(ValueError, match=message):
        Target(**target)


def test_hf_model_none_skips_the_transformers_peer():
    assert Target(engine=Path("."), compare=True, hf_model="none").hf_peer is None
    assert Target(engine=Path("."), compare=True).hf_peer == "smollm2-135m"
