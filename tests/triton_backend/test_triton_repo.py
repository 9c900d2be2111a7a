"""Rendering a Triton model repository from the manifest, and the launcher; no server runs here."""

from __future__ import annotations

import shutil
import sys

import pytest
from click.testing import CliRunner
from google.protobuf import text_format

from kiln.contract.artifact import EngineArtifact
from kiln.contract.manifest import MANIFEST, ArtifactError, sha256_file
from kiln.cli import main
from kiln.serving.triton.launch import Ports, TritonInstall, command_text, prepare_backends, server_command
from kiln.serving.triton.repo import RepoOptions, render_repository
from kiln.serving.triton.settings import BackendSettings, model_config_parameters
from kiln.serving.triton.tensors import INPUTS, OUTPUTS

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")


def _parse(config_path):
    """config.pbtxt through Triton's own ModelConfig schema: a typo would not parse."""
    return text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())


def test_config_is_filled_from_the_manifest(tiny_llama_artifact, tmp_path):
    options = RepoOptions(name="tiny", instances=2, max_queue=7, runtime={"kv_cache_memory": "64MiB",
                                                                            "max_num_seqs": 8})
    model_dir = render_repository(tiny_llama_artifact, tmp_path / "repo", options)
    cfg = _parse(model_dir / "config.pbtxt")
    manifest = EngineArtifact.load(tiny_llama_artifact).manifest

    assert (cfg.name, cfg.backend, cfg.max_batch_size) == ("tiny", "python", 0)
    assert cfg.model_transaction_policy.decoupled
    assert cfg.instance_group[0].count == 2
    assert [i.name for i in cfg.input] == [s.name for s in INPUTS]
    assert [o.name for o in cfg.output] == [s.name for s in OUTPUTS]
    assert [i.name for i in cfg.input if not i.optional] == ["text_input"]
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["artifact_path"] == str(tiny_llama_artifact.resolve())
    assert params["manifest_sha256"] == sha256_file(tiny_llama_artifact / MANIFEST)
    assert params["max_queue"] == "7" and params["max_num_seqs"] == "8"
    assert params["EXECUTION_ENV_PATH"] == sys.prefix      # the venv holding kiln and numpy<2
    text = (model_dir / "config.pbtxt").read_text()
    assert f"{manifest.spec.family}, {manifest.spec.num_layers} layers" in text
    assert f"Context {manifest.generation['max_model_len']} tokens" in text
    assert "from kiln.serving.triton.backend import TritonPythonModel" in (model_dir / "1" / "model.py").read_text()


def test_backend_settings_round_trip(tiny_llama_artifact, tmp_path):
    model_dir = render_repository(tiny_llama_artifact, tmp_path / "repo",
                                  RepoOptions(runtime={"policy": "latency", "no_prefix_caching": True,
                                                       "token_budget": 64}))
    cfg = _parse(model_dir / "config.pbtxt")
    as_triton_gives_it = {"parameters": {k: {"string_value": v.string_value} for k, v in cfg.parameters.items()}}
    settings = BackendSettings.from_parameters(model_config_parameters(as_triton_gives_it))
    runtime = settings.runtime_config()
    assert settings.artifact_path == tiny_llama_artifact.resolve()
    assert runtime.scheduler.max_num_batched_tokens == 64
    assert runtime.scheduler.max_num_seqs == 16                # the latency preset
    assert not runtime.scheduler.enable_prefix_caching


def test_corrupt_artifact_refused_at_render_time(tiny_llama_artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_artifact, copy)
    engine = next((copy / "engines" / "ort").glob("*.onnx"))
    engine.write_bytes(engine.read_bytes()[:1000])
    with pytest.raises(ArtifactError) as refused:
        EngineArtifact.load(copy)
    with pytest.raises(ArtifactError, match="truncated"):
        render_repository(copy, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()

    res = CliRunner().invoke(main, ["triton-repo", str(copy), "--out", str(tmp_path / "repo")])
    assert res.exit_code == 1
    assert str(refused.value) in " ".join(res.output.split())


def test_bad_options_refused(tiny_llama_artifact, tmp_path):
    with pytest.raises(ValueError, match="max_num_seqs"):
        render_repository(tiny_llama_artifact, tmp_path / "r", RepoOptions(runtime={"max_num_seqs": -1}))
    with pytest.raises(ValueError, match="model name"):
        RepoOptions(name="../escape")
    with pytest.raises(ValueError, match="max_queue"):
        render_repository(tiny_llama_artifact, tmp_path / "r", RepoOptions(max_queue=0))


def test_cli_renders_and_prints_the_launch_command(tiny_llama_artifact, tmp_path):
    res = CliRunner().invoke(main, ["triton-repo", str(tiny_llama_artifact), "--out", str(tmp_path / "repo"),
                                    "--name", "m", "--instances", "3", "--kv-cache-memory", "32MiB",
                                    "--print-command"])
    assert res.exit_code == 0, res.output
    cfg = _parse(tmp_path / "repo" / "m" / "config.pbtxt")
    assert cfg.instance_group[0].count == 3
    assert cfg.parameters["kv_cache_memory"].string_value == "32MiB"
    assert "tritonserver --model-repository=" in res.output
    assert "--backend-directory=" in res.output and "LD_LIBRARY_PATH=" in res.output


@pytest.fixture(scope="module")
def install():
    try:
        return TritonInstall.find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_backends_folder_gets_the_stub(install, tmp_path):
    backends = prepare_backends(install, tmp_path / "backends")
    names = {p.name for p in (backends / "python").iterdir()}
    assert {"libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"} <= names
    assert prepare_backends(install, backends) == backends      # a second call is a no-op


def test_server_command_flags(install, tmp_path):
    cmd = server_command(install, tmp_path / "repo", tmp_path / "b", Ports(1, 2, 3))
    assert cmd[0].endswith("bin/tritonserver")
    assert {"--http-port=1", "--grpc-port=2", "--metrics-port=3", "--disable-auto-complete-config"} <= set(cmd)
    assert "--backend-directory" in command_text(tmp_path / "repo", backends=tmp_path / "b")
