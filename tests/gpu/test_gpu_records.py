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
