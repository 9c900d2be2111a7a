"""deploy/ray/kiln.yaml is a valid Serve config whose application kiln's builder builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="the scale extra: pip install -e '.[scale]'")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from kiln.scale.app import build_app  # noqa: E402
from kiln.units import parse_bytes  # noqa: E402

CONFIG = Path(__file__).parents[2] / "deploy" / "ray" / "kiln.yaml"


def test_the_serve_config_validates_and_builds(tiny_llama_artifact):
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "kiln.scale.app:build_app"
    args = {**app.args, "artifact": str(tiny_llama_artifact)}     # the file names a mount path
    built = build_app(args)
    replicas = built._bound_deployment.init_args[0]._bound_deployment      # the ingress's first argument
    assert replicas.name == "kiln-replica"
    assert replicas._deployment_config.autoscaling_config.max_replicas == app.args["max_replicas"]
    assert replicas._deployment_config.graceful_shutdown_timeout_s == app.args["drain_timeout"]
    assert replicas.ray_actor_options["num_cpus"] == app.args["replica_cpus"]
    runtime = replicas.init_args[1]
    assert runtime.kv_cache_memory == parse_bytes(app.args["kv_cache_memory"])     # the file states it


def test_the_builder_refuses_what_it_does_not_know(tiny_llama_artifact):
    with pytest.raises(ValueError, match="needs artifact"):
        build_app({"replicas": 2})
    with pytest.raises(ValueError, match="does not know replicaz"):
        build_app({"artifact": str(tiny_llama_artifact), "replicaz": 2})
    with pytest.raises(ValueError, match="max_replicas"):
        build_app({"artifact": str(tiny_llama_artifact), "replicas": 3, "max_replicas": 2})
