"""scripts/gpu_check.py on the CPU machine: the wheel split into parts and put back together (a
missing or altered part refused), the node placements read from an ONNX Runtime profile, and the
run stopping at the GPU probe, the first step that needs CUDA, with what to do."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

from kiln.engines.gpu.device import cuda_device_count

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture
def gpu_check(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "WORK", tmp_path / "gpu_check")
    monkeypatch.setattr(module, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    return module


def _stand_in_wheel(tmp_path: Path) -> Path:
    """A zip named like the wheel (the real one is not in this machine's mirrors)."""
    wheel = tmp_path / "onnxruntime_gpu-1.31.1-cp311-cp311-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("onnxruntime/__init__.py", "__version__ = '1.31.1'\n")
        z.writestr("onnxruntime/blob.bin", bytes(range(256)) * 400)
    return wheel


def test_the_wheel_goes_into_parts_and_back(gpu_check, tmp_path):
    wheel = _stand_in_wheel(tmp_path)
    record = gpu_check.split(wheel, tmp_path / "parts", part_bytes=4096)
    assert len(record["parts"]) > 1 and all(p["bytes"] <= 4096 for p in record["parts"])
    back = gpu_check.assemble(tmp_path / "parts", tmp_path / "back")
    assert back.read_bytes() == wheel.read_bytes() and gpu_check.wheel_release(back.name) == "1.31.1"
    site = gpu_check.unpack(back, tmp_path / "site")
    assert (site / "onnxruntime" / "__init__.py").exists()
    assert gpu_check.PART_BYTES < 60 << 20


def test_a_missing_or_altered_part_is_refused(gpu_check, tmp_path):
    record = gpu_check.split(_stand_in_wheel(tmp_path), tmp_path / "parts", part_bytes=4096)
    second = tmp_path / "parts" / record["parts"][1]["name"]
    second.write_bytes(b"x" + second.read_bytes()[1:])
    with pytest.raises(ValueError, match="is not the one prepare wrote"):
        gpu_check.assemble(tmp_path / "parts", tmp_path / "back")
    second.unlink()
    with pytest.raises(ValueError, match="is missing"):
        gpu_check.assemble(tmp_path / "parts", tmp_path / "back")


def test_node_placements_come_from_the_profile(gpu_check, tmp_path):
    events = [{"cat": "Session", "name": "model_run"},
              {"cat": "Node", "name": "/a/MatMul_kernel_time", "args": {"provider": "CUDAExecutionProvider"}},
              {"cat": "Node", "name": "/a/Shape_kernel_time", "args": {"provider": "CPUExecutionProvider"}},
              {"cat": "Node", "name": "/a/Shape_fence_before", "args": {}}]
    (tmp_path / "profile.json").write_text(json.dumps(events))
    assert gpu_check.placements(str(tmp_path / "profile.json")) == {
        "per_provider": {"CUDAExecutionProvider": 1, "CPUExecutionProvider": 1}, "not_on_cuda": ["/a/Shape"]}


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the stop of a machine without a GPU")
def test_run_stops_at_the_gpu_probe_with_what_to_do(gpu_check, tmp_path, capsys):
    for name in gpu_check.ARTIFACTS:
        folder = gpu_check.WORK / f"tiny-llama-{name}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
    gpu_check.split(_stand_in_wheel(tmp_path), gpu_check.WORK / "parts", part_bytes=4096)
    assert gpu_check.main(["run", "--json", str(tmp_path / "run.json")]) == 1
    printed = capsys.readouterr().out
    assert "[ok] wheel: onnxruntime_gpu-1.31.1" in printed
    assert "[refused] GPU: no CUDA GPU here" in printed and "on the GPU machine" in printed
    steps = json.loads((tmp_path / "run.json").read_text())["report"]
    assert [s["step"] for s in steps] == ["inputs", "wheel", "GPU"] and not steps[-1]["ok"]


def test_run_without_the_prepared_artifacts_says_to_prepare(gpu_check, capsys):
    assert gpu_check.main(["run"]) == 1
    assert "run python scripts/gpu_check.py prepare on the CPU machine" in capsys.readouterr().out
