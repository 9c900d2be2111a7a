"""`kiln serve --replicas ...` turns its options into the Ray application's ScaleOptions; the
cluster start itself (kiln.scale.app.run) is replaced here, test_scale_ray.py runs the real one."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

pytest.importorskip("ray", reason="the scale extra: pip install -e '.[scale]'")

import kiln.scale.app  # noqa: E402
from kiln.cli import main  # noqa: E402


@pytest.fixture
def started(monkeypatch):
    calls = []
    monkeypatch.setattr(kiln.scale.app, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    return calls


def test_replicas_start_the_ray_application(started, tmp_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--replicas", "2", "--max-replicas", "3",
                                       "--replica-cpus", "0.5", "--hedge", "--drain-timeout", "12", "--port", "8123"])
    assert result.exit_code == 0, result.output
    (args, kwargs), = started
    artifact, runtime, config, options = args
    assert (options.replicas, options.max_replicas, options.replica_cpus, options.hedge, options.drain_timeout) == \
        (2, 3, 0.5, True, 12.0)
    assert config.port == 8123 and kwargs["ray_address"] is None and kwargs["ray_node_ip"] is None


def test_ray_node_ip_reaches_the_local_cluster_start(started, tmp_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--replicas", "2", "--ray-node-ip", "10.0.0.5"])
    assert result.exit_code == 0, result.output
    (args, kwargs), = started
    assert kwargs["ray_node_ip"] == "10.0.0.5" and args[3].replicas == 2


def test_ray_address_alone_joins_with_one_replica(started, tmp_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--ray-address", "auto"])
    assert result.exit_code == 0, result.output
    (args, kwargs), = started
    assert args[3].replicas == 1 and kwargs["ray_address"] == "auto"


def test_bad_scale_options_are_refused_before_ray_starts(started, tmp_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--replicas", "3", "--max-replicas", "2"])
    assert result.exit_code != 0 and "max_replicas" in result.output and not started


def test_drain_timeout_reaches_plain_kiln_serve(monkeypatch, tmp_path):
    import kiln.serving.http.server

    calls = []
    monkeypatch.setattr(kiln.serving.http.server, "run_server", lambda *args, **kwargs: calls.append(kwargs))
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--drain-timeout", "20"])
    assert result.exit_code == 0, result.output
    assert calls[0]["drain_timeout"] == 20.0
