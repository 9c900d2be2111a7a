"""The GPU backends on a GPU: device memory, builds with their Polygraphy comparisons, generation.
Marked `gpu`; each test skips with the reason where its hardware or library is missing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from gpu_needs import need_gpu
from device_doubles import FakeDevice

from kiln.cli import main
from kiln.config import RuntimeConfig

pytestmark = pytest.mark.gpu


def _generate(artifact, prompt="hello", n=8) -> list[int]:
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    llm = LLM(str(artifact), RuntimeConfig(kv_cache_memory=1 << 24))
    try:
        [out] = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    finally:
        llm.shutdown()
    return list(out.token_ids)


def test_cuda_memory_does_what_the_fake_device_does():
    """upload, memset, 2-D device copies and download on the real GPU against the test double."""
    need_gpu(cudart=True)
    from kiln.engines.gpu.device import CudaMemory

    data = np.arange(4096, dtype=np.float32)
    results = []
    for device in (CudaMemory(), FakeDevice()):
        a, b = device.alloc(data.nbytes), device.alloc(data.nbytes)
        device.upload(a, data)
        device.memset(b, 0, data.nbytes)
        device.copy_2d(b + 64, 1024, a + 128, 2048, 256, 3)
        out = np.empty_like(data)
        device.download(b, out)
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])


def test_tensorrt_build_checks_against_ort_cpu_and_generates(tmp_path):
    need_gpu(tensorrt=True)
    out = tmp_path / "trt"
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(out), "--backend", "tensorrt", "--no-fuse",
                                  "--kv-cache-memory", "16MiB"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "manifest.json").read_text())["engines"][0]
    assert record["compare"]["passed"] and record["device"]["compute_capability"]
    assert (out / "engines/tensorrt/timing.cache").stat().st_size > 0
    assert len(_generate(out)) == 8


def test_ort_cuda_build_compares_on_the_gpu_and_generates(tmp_path):
    need_gpu(ort_cuda=True)
    out = tmp_path / "ort-cuda"
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(out), "--backend", "ort-cuda"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "manifest.json").read_text())["engines"][0]
    assert record["compare"]["passed"], record["compare"]
    assert len(_generate(out)) == 8


@pytest.mark.parametrize("backend, args", [("ort-cuda", []), ("tensorrt", ["--no-fuse", "--kv-cache-memory", "16MiB"])])
def test_kiln_serve_streams_from_a_gpu_engine(tmp_path, backend, args):
    """The OpenAI-compatible server on a GPU artifact, driven by the official client."""
    need_gpu(tensorrt=backend == "tensorrt", ort_cuda=backend == "ort-cuda")
    from kiln_server import ServerProcess
    from openai import OpenAI

    out = tmp_path / backend
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(out), "--backend", backend, *args])
    assert res.exit_code == 0, res.output
    server = ServerProcess(out, tmp_path / "serve.log", "--kv-cache-memory", "16MiB").wait_ready()
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        stream = client.completions.create(model=out.name, prompt="hello", max_tokens=6, temperature=0,
                                           stream=True)
        pieces = [c.choices[0].text for c in stream if c.choices]
        assert len("".join(pieces)) > 0
    finally:
        server.stop()
