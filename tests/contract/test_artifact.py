"""Artifact round trip, and every corruption / mismatch refused with a message that says what to do."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln.contract.artifact import EngineArtifact
from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.contract.manifest import MANIFEST, SCHEMA_VERSION, ArtifactError


@pytest.fixture
def artifact_copy(tiny_llama_artifact, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(tiny_llama_artifact, dst)
    return dst


def _edit_manifest(path, fn):
    m = json.loads((path / MANIFEST).read_text())
    fn(m)
    (path / MANIFEST).write_text(json.dumps(m))


def test_round_trip(tiny_llama_artifact):
    art = EngineArtifact.load(tiny_llama_artifact)
    m = art.manifest
    assert m.schema_version == SCHEMA_VERSION
    assert m.spec.family == "llama" and m.spec.num_layers == 2
    assert m.quant["mode"] == "none"
    assert m.kv_layout.block_size == 16 and m.kv_layout.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert [p["name"] for p in m.passes][0] == "cleanup" and m.passes[-1]["name"] == "kv_io"
    assert [e["backend"] for e in m.engines] == ["ort"]
    assert (art.path / m.engines[0]["file"]).is_file()
    assert (art.tokenizer_dir / "tokenizer.json").is_file()
    assert m.generation["eos_token_ids"] == [258]


def test_an_artifact_from_before_the_build_plan_loads(artifact_copy):
    """The manifest's plan is optional: an artifact without one loads and inspects as before."""
    from kiln.inspect_view import render_manifest

    assert EngineArtifact.load(artifact_copy).manifest.plan["recipe"]["mode"] == "none"
    _edit_manifest(artifact_copy, lambda m: m.pop("plan"))
    art = EngineArtifact.load(artifact_copy)
    assert art.manifest.plan == {} and "plan" not in art.manifest.to_json()
    render_manifest(art, 1024, 1 << 20)


def test_corrupt_engine_refused(artifact_copy):
    engine = next((artifact_copy / "engines" / "ort").glob("*.onnx"))
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    engine.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupt.*rebuild"):
        EngineArtifact.load(artifact_copy)


def test_truncated_engine_refused(artifact_copy):
    engine = next((artifact_copy / "engines" / "ort").glob("*.onnx"))
    engine.write_bytes(engine.read_bytes()[:1000])
    with pytest.raises(ArtifactError, match="truncated"):
        EngineArtifact.load(artifact_copy)


def test_missing_file_refused(artifact_copy):
    (artifact_copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        EngineArtifact.load(artifact_copy)


def test_missing_manifest_refused(artifact_copy):
    (artifact_copy / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match="no manifest.json"):
        EngineArtifact.load(artifact_copy)


def test_garbled_manifest_refused(artifact_copy):
    (artifact_copy / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupt"):
        EngineArtifact.load(artifact_copy)


def test_newer_schema_refused(artifact_copy):
    _edit_manifest(artifact_copy, lambda m: m.update(schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(ArtifactError, match="newer than this kiln.*upgrade kiln"):
        EngineArtifact.load(artifact_copy)


def test_onnxruntime_mismatch_refused(artifact_copy):
    _edit_manifest(artifact_copy, lambda m: m["versions"].update(onnxruntime="1.2.0"))
    with pytest.raises(ArtifactError, match="built with onnxruntime 1.2.0"):
        EngineArtifact.load(artifact_copy)


def test_kv_layout_mismatch_refused(artifact_copy):
    _edit_manifest(artifact_copy, lambda m: m["kv_layout"].update(block_size=32))
    with pytest.raises(ArtifactError, match="KV layout"):
        EngineArtifact.load(artifact_copy)


def test_model_config_mismatch_refused(artifact_copy):
    _edit_manifest(artifact_copy, lambda m: m["model"]["config"].update(num_kv_heads=4))
    with pytest.raises(ArtifactError, match="does not match the model config"):
        EngineArtifact.load(artifact_copy)


def test_existing_folder_not_overwritten_without_force(tiny_llama_artifact):
    with pytest.raises(ArtifactError, match="--force"):
        build(BuildConfig(source="tiny-llama", out=tiny_llama_artifact))


def test_failed_build_leaves_no_folder(tmp_path, monkeypatch):
    import kiln.compiler.backends.ort as ort_builder

    def explode(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(ort_builder, "compile_ort", explode)
    out = tmp_path / "art"
    with pytest.raises(RuntimeError, match="boom"):
        build(BuildConfig(source="tiny-llama", out=out))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []       # no half-built temporary folder either


def test_force_replaces_existing(tmp_path):
    out = tmp_path / "art"
    build(BuildConfig(source="tiny-llama", out=out))
    (out / "stale.txt").write_text("old")
    build(BuildConfig(source="tiny-qwen2", out=out, force=True))
    assert not (out / "stale.txt").exists()
    assert EngineArtifact.load(out).manifest.spec.family == "qwen2"


def test_force_never_replaces_a_folder_that_is_not_an_artifact(tmp_path):
    """Someone's notes survive `kiln build --out DIR --force`."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="is not a kiln artifact"):
        build(BuildConfig(source="tiny-llama", out=out, force=True))
    assert (out / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]      # no temporary folder left


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.onnx", "engines/../../outside.onnx"])
def test_a_manifest_file_outside_the_artifact_is_refused(tiny_llama_artifact, tmp_path, name):
    art = tmp_path / "art"
    shutil.copytree(tiny_llama_artifact, art)
    raw = json.loads((art / MANIFEST).read_text())
    raw["engines"][0]["file"] = name
    (art / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="outside the artifact folder"):
        EngineArtifact.load(art)


def test_a_symlinked_engine_file_is_refused(tiny_llama_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_llama_artifact, art)
    engine = art / EngineArtifact.load(art).manifest.engines[0]["file"]
    real = tmp_path / "elsewhere.onnx"
    engine.rename(real)
    engine.symlink_to(real)
    with pytest.raises(ArtifactError, match="symbolic link"):
        EngineArtifact.load(art)


def test_an_unlisted_chat_template_is_refused(tiny_llama_artifact, tmp_path):
    """A template dropped into tokenizer/ after the build would be rendered unchecked."""
    art = tmp_path / "art"
    shutil.copytree(tiny_llama_artifact, art)
    (art / "tokenizer" / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(ArtifactError, match="tokenizer/chat_template.jinja is not listed"):
        EngineArtifact.load(art)


def test_the_runtime_refuses_a_corrupt_file_even_while_it_loads_the_engine(tiny_llama_artifact, tmp_path):
    """LLM checks the sha256s on a thread beside the engine load, and still refuses a flipped byte."""
    from kiln.runtime.llm import LLM

    art = tmp_path / "art"
    shutil.copytree(tiny_llama_artifact, art)
    template = art / "tokenizer" / "tokenizer.json"
    data = bytearray(template.read_bytes())
    data[-3] ^= 1                                   # same size: only the checksum can tell
    template.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="tokenizer.json is corrupt"):
        LLM(art)
