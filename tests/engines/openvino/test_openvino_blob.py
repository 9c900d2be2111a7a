"""The build's compiled blob: recorded like every engine file, imported at load, refused safely.

The loader imports engines/openvino/compiled.blob (no paged rewrite, no plugin transformations).
The CPU plugin checks the blob's header (OpenVINO release, CPU instruction set) and refuses any
other; the loader then compiles model.xml as an artifact without a blob does, with one warning.
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

pytest.importorskip("openvino")
import openvino as ov  # noqa: E402

from kiln.compiler.backends.openvino.compile import BLOB_FILE, compile_openvino  # noqa: E402
from kiln.compiler.build import build  # noqa: E402
from kiln.config import BuildConfig  # noqa: E402
from kiln.contract.artifact import ArtifactError, EngineArtifact, sha256_file  # noqa: E402
from kiln.contract.engine import BucketGrid, KvLayout  # noqa: E402
from kiln.engines.load import load_engine  # noqa: E402
from kiln.engines.openvino.loader import open_openvino  # noqa: E402
from openvino_testing import standard_graph  # noqa: E402
from test_openvino_engine import Sequences  # noqa: E402

RELEASE = ov.get_version().split("-")[0].encode()        # "2026.4.1", as the blob's header names it


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    spec, model = standard_graph("tiny-llama")
    root = tmp_path_factory.mktemp("ov-blob")
    record = compile_openvino(model, spec, root / "engines" / "openvino", root=root)[0]
    return spec, record, root


def _open(built, root=None, record=None, **kw):
    spec, rec, built_root = built
    record = record or rec
    e = open_openvino(root or built_root, record, spec, BucketGrid(), KvLayout(**record["kv_layout"]), threads=2, **kw)
    e.allocate_kv(16)
    return e


def _logits(engine, spec) -> np.ndarray:
    rng = np.random.default_rng(0)
    seqs = Sequences([rng.integers(0, spec.vocab_size, n).tolist() for n in (20, 45)], engine.block_size,
                     engine.num_blocks)
    return np.concatenate([engine.execute(seqs.batch(c)).logits for c in ({0: 12, 1: 45}, {0: 8})])


def test_blob_is_recorded_with_its_sha256(built):
    _, record, root = built
    blob = record["compiled"]
    assert blob["file"] == f"engines/openvino/{BLOB_FILE}"
    assert blob["sha256"] == sha256_file(root / blob["file"]) and blob["bytes"] == (root / blob["file"]).stat().st_size
    assert blob["openvino"] == ov.get_version() and blob["device"]


def test_imported_blob_computes_what_the_compiled_ir_does(built):
    spec = built[0]
    imported, compiled = _open(built), _open(built, use_blob=False)
    assert (imported.loaded_from, compiled.loaded_from) == ("blob", "compiled")
    assert imported.kv_cache == compiled.kv_cache == built[1]["kv_cache"]
    for key in ("INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION",
                "DYNAMIC_QUANTIZATION_GROUP_SIZE", "NUM_STREAMS"):      # the load's threads, the build's precisions
        assert str(imported.compiled.get_property(key)) == str(compiled.compiled.get_property(key)), key
    np.testing.assert_allclose(_logits(imported, spec), _logits(compiled, spec), rtol=0, atol=1e-5)


def _copy_with_blob(built, tmp_path, edit) -> dict:
    _, record, root = built
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    blob = tmp_path / record["compiled"]["file"]
    blob.write_bytes(edit(blob.read_bytes()))
    return record


def _other_patch_release(blob: bytes) -> bytes:
    """The header of a blob from another patch release (same major.minor: the record's check passes)."""
    other = RELEASE[:-1] + (b"0" if RELEASE[-1:] != b"0" else b"1")
    assert blob.count(b"ov=" + RELEASE) == 1
    return blob.replace(b"ov=" + RELEASE, b"ov=" + other)


def _other_cpu(blob: bytes) -> bytes:
    """The header of a blob compiled for another instruction set."""
    at = blob.index(b"isa=") + 4
    return blob[:at] + bytes([blob[at] ^ 0x20]) + blob[at + 1:]


@pytest.mark.parametrize("edit,said", [(_other_patch_release, "OpenVINO version/isa mismatch"),
                                       (_other_cpu, "OpenVINO version/isa mismatch"),
                                       (lambda b: b"not a blob" * 10, "magic")])
def test_a_refused_blob_falls_back_to_compiling_the_ir(built, tmp_path, caplog, edit, said):
    """Another release's or CPU's blob (as its header says) or a damaged one: the plugin refuses it
    before reading the graph, and the engine compiles model.xml, with one warning saying why."""
    record = _copy_with_blob(built, tmp_path, edit)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        engine = _open(built, root=tmp_path, record=record)
    assert engine.loaded_from == "compiled"
    warned = [r.getMessage() for r in caplog.records if "compiled blob" in r.getMessage()]
    assert len(warned) == 1 and said in warned[0] and "rebuild the artifact" in warned[0], warned
    np.testing.assert_allclose(_logits(engine, built[0]), _logits(_open(built), built[0]), rtol=0, atol=1e-5)


def test_an_artifact_without_a_blob_still_loads(built):
    record = {k: v for k, v in built[1].items() if k != "compiled"}
    assert _open(built, record=record).loaded_from == "compiled"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build(BuildConfig(source="tiny-llama", out=tmp_path_factory.mktemp("ov") / "a", backend="openvino"))


def test_kiln_build_saves_the_blob_and_the_loader_imports_it(artifact):
    art = EngineArtifact.load(artifact)
    assert "compiled" in art.manifest.engines[0]
    assert load_engine(art, threads=2).loaded_from == "blob"


def test_a_corrupt_blob_is_refused_when_the_artifact_loads(artifact, tmp_path):
    copy = tmp_path / "a"
    shutil.copytree(artifact, copy)
    record = json.loads((copy / "manifest.json").read_text())["engines"][0]["compiled"]
    blob = copy / record["file"]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="compiled.blob is corrupt"):
        EngineArtifact.load(copy)
