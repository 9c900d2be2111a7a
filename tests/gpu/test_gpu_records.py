"""The TensorRT engine record's toolchain and device checks, and the Polygraphy comparison wiring
(run for real on ONNX Runtime CPU: the same engine passes, an fp16 graph fails a tight tolerance)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.compiler.backends.gpu.compare import batch_to_feeds, compare_engines, engine_runner, feeds_to_batch, probe_steps
from kiln.engines.gpu.compat import check_tensorrt_record, release
from kiln.engines.gpu.device import DeviceInfo

H200 = DeviceInfo("NVIDIA H200", "9.0")
RECORD = {"tensorrt": "10.8.0.43", "device": H200.to_dict(), "profiles": [], "precision": "fp16"}


def test_release_keeps_major_minor_patch():
    assert release("10.8.0.43") == "10.8.0" and release("11.4.0.106+cuda13") == "11.4.0"


def test_the_same_release_and_gpu_load():
    check_tensorrt_record(Path("a"), RECORD, "10.8.0.99", DeviceInfo("NVIDIA H200", "9.0", 1 << 30))


@pytest.mark.parametrize("version, device, message", [
    ("10.9.0.34", H200, r"TensorRT 10.8.0.43 engine, but this machine has TensorRT 10.9.0.34; "
                        r"install tensorrt==10.8.0.43 or rebuild it on this machine"),
    ("10.8.0.43", DeviceInfo("NVIDIA L4", "8.9"), r"built for NVIDIA H200 \(compute capability 9.0\); "
                                                   r"this GPU is NVIDIA L4 \(compute capability 8.9\)"),
    ("10.8.0.43", DeviceInfo("NVIDIA H100 80GB HBM3", "9.0"), r"tuned on NVIDIA H200; this GPU is NVIDIA H100"),
])
def test_another_release_or_gpu_is_refused_with_what_to_do(version, device, message):
    with pytest.raises(ArtifactError, match=message) as e:
        check_tensorrt_record(Path("a"), RECORD, version, device)
    assert "kiln build --backend tensorrt" in str(e.value)


def test_a_record_without_its_device_is_refused():
    with pytest.raises(ArtifactError, match="has no 'device'"):
        check_tensorrt_record(Path("a"), {k: v for k, v in RECORD.items() if k != "device"}, "10.8.0.43", H200)


def test_paged_batches_survive_the_feed_dict_form():
    for step in probe_steps(50, 16):
        back = feeds_to_batch(batch_to_feeds(step))
        assert [t.tolist() for t in back.block_tables] == [t.tolist() for t in step.block_tables]
        assert back.slot_mapping.tolist() == step.slot_mapping.tolist()


def test_polygraphy_compares_engines_per_output(tiny_llama_standard_artifact, tmp_path):
    from kiln.engines.load import load_engine
    from kiln.compiler.backends.gpu.onnx_files import save_onnx, with_weights_inline
    from kiln.engines.ort.engine import OrtEngine
    from kiln.compiler.backends.tensorrt.graph import in_precision

    artifact = EngineArtifact.load(tiny_llama_standard_artifact)
    m = artifact.manifest
    steps = probe_steps(m.spec.vocab_size, m.kv_layout.block_size)
    same = compare_engines(engine_runner("a", lambda: load_engine(artifact)),
                           engine_runner("b", lambda: load_engine(artifact)), steps)
    assert same["passed"] and same["outputs"]["logits"]["max_abs_error"] == 0.0 and same["steps"] == 3

    import onnx

    half, _ = save_onnx(in_precision(with_weights_inline(onnx.load(artifact.path / m.engines[0]["file"])), "fp16"),
                        tmp_path)
    fp16 = engine_runner("fp16", lambda: OrtEngine(half, m.buckets, replace(m.kv_layout, dtype="float16")))
    tight = compare_engines(engine_runner("fp32", lambda: load_engine(artifact)), fp16, steps,
                            {"logits": (1e-6, 1e-6)})
    assert not tight["passed"] and tight["outputs"]["logits"]["max_abs_error"] > 1e-4


def _as_ort_cuda_artifact(source: Path, tmp_path: Path, **record) -> Path:
    """A copy of an artifact whose engine record says ort-cuda, with these record fields."""
    import json
    import shutil

    copy = tmp_path / "ort-cuda"
    shutil.copytree(source, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["engines"][0] |= {"backend": "ort-cuda", **record}
    for key in [k for k, v in record.items() if v is None]:
        del manifest["engines"][0][key]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _other_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) - 1}.1"


def test_an_ort_cuda_artifact_of_another_onnxruntime_minor_release_is_refused(tiny_llama_artifact, tmp_path):
    """Refused before anything else, GPU or not: the message names both releases and what to do."""
    import onnxruntime as ort

    from kiln.engines.load import load_engine

    built = _other_minor(ort.__version__)
    copy = _as_ort_cuda_artifact(tiny_llama_artifact, tmp_path, onnxruntime=built)
    with pytest.raises(ArtifactError, match=rf"built with onnxruntime {built}; this machine has onnxruntime "
                                            rf"{ort.__version__}") as e:
        load_engine(EngineArtifact.load(copy))
    major, minor = built.split(".")[:2]
    assert f"onnxruntime-gpu=={major}.{minor}.*" in str(e.value) and "kiln build --backend ort-cuda" in str(e.value)


def test_the_onnxruntime_release_check(tmp_path):
    from kiln.engines.gpu.compat import check_onnxruntime_record

    check_onnxruntime_record(tmp_path, {"onnxruntime": "1.32.0"}, "1.32.1")          # a patch release loads
    with pytest.raises(ArtifactError, match="records no onnxruntime release"):
        check_onnxruntime_record(tmp_path, {}, "1.32.0")
    with pytest.raises(ArtifactError, match="built with onnxruntime 1.31.1; this machine has onnxruntime 1.32.0"):
        check_onnxruntime_record(tmp_path, {"onnxruntime": "1.31.1"}, "1.32.0")


def test_the_same_onnxruntime_release_goes_on_to_the_gpu_check(tiny_llama_artifact, tmp_path):
    import onnxruntime as ort

    from kiln.engines.gpu.device import cuda_device_count
    from kiln.engines.load import load_engine

    if cuda_device_count() > 0:
        pytest.skip("checks the refusal of a machine without a GPU")
    copy = _as_ort_cuda_artifact(tiny_llama_artifact, tmp_path, onnxruntime=ort.__version__)
    with pytest.raises(ArtifactError, match="needs a CUDA GPU"):
        load_engine(EngineArtifact.load(copy))


def test_the_cuda_session_preloads_the_cuda_libraries_first(monkeypatch, tmp_path):
    """onnxruntime-gpu installed with its [cuda,cudnn] extras finds CUDA and cuDNN in the nvidia pip
    packages only once preload_dlls() has loaded them: it runs before the session is made."""
    from kiln.engines.ort_cuda import engine

    calls = []

    class Session:
        def __init__(self, path, opts, providers):
            calls.append("session")

        def get_providers(self):
            return [engine.CUDA, "CPUExecutionProvider"]

    monkeypatch.setattr(engine.ort, "get_available_providers", lambda: [engine.CUDA, "CPUExecutionProvider"])
    monkeypatch.setattr(engine.ort, "preload_dlls", lambda **kw: calls.append("preload"), raising=False)
    monkeypatch.setattr(engine.ort, "InferenceSession", Session)
    engine.cuda_session(tmp_path / "model.onnx")
    assert calls == ["preload", "session"]
