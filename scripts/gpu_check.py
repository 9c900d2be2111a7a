"""The GPU check of the ort-cuda backend, made to fit a lent GPU machine: no network, at most
64 MiB of files per call, a few minutes of GPU time.

    prepare  (the CPU machine)  the onnxruntime-gpu wheel split into parts under 60 MiB, and two
                                tiny-llama artifacts, ort-cuda and ort (the CPU reference), built
                                under the wheel's onnxruntime (its CPU provider) so the GPU machine
                                loads them under the same release; all under out/gpu_check/
    run      (the GPU machine)  the wheel put back together from its parts and checked, then the
                                GPU probe (the first step that needs CUDA: without one it stops
                                there and says so), the wheel unpacked onto PYTHONPATH, the CUDA
                                provider started, the node placements printed, the ort-cuda engine
                                against the CPU engine (logits and greedy tokens), and the GPU tests

Each step prints one line; the first that fails stops the run with what to do. `run --json PATH`
also writes the steps as JSON (into $OUT on the device machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "out" / "gpu_check"          # git-ignored (/out/): the parts and artifacts to carry
SCRATCH = Path(tempfile.gettempdir()) / "kiln-gpu-check"   # the wheel put together and unpacked: never carried
# A part under 60 MiB, with room left for the working tree that travels in the same call (64 MiB in all).
PART_BYTES = 48 << 20
ARTIFACTS = {"ort-cuda": ["--backend", "ort-cuda", "--quant", "int4"],
             "ort": ["--backend", "ort", "--quant", "int4"]}
NEEDED_MODULES = ("numpy", "onnx", "click", "polygraphy", "pytest", "tokenizers", "jinja2")
GREEDY_TOKENS = 16
STEP_TIMEOUT_S = 240                        # one subprocess step; the whole run stays within 10 minutes


class Refused(SystemExit):
    """A step cannot go on; the message says why and what to do."""


def step(name: str, report: list, ok: str = "", **details) -> None:
    report.append({"step": name, "ok": True, **({"detail": ok} if ok else {}), **details})
    print(f"[ok] {name}{': ' + ok if ok else ''}", flush=True)


def refuse(name: str, report: list, why: str) -> None:
    report.append({"step": name, "ok": False, "detail": why})
    raise Refused(f"[refused] {name}: {why}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- the wheel in parts ----------------------------------------------------------------------------

def split(wheel: Path, folder: Path, part_bytes: int = PART_BYTES) -> dict:
    """wheel -> folder/<wheel>.partNN and folder/parts.json (names, sizes, sha256 of each and of the whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(wheel, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part_bytes), b"")):
            part = folder / f"{wheel.name}.part{i:02d}"
            part.write_bytes(chunk)
            parts.append({"name": part.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    record = {"wheel": wheel.name, "bytes": wheel.stat().st_size, "sha256": sha256(wheel), "parts": parts}
    (folder / "parts.json").write_text(json.dumps(record, indent=1))
    return record


def assemble(folder: Path, out: Path) -> Path:
    """The wheel put back together from folder/parts.json; refuses a missing or altered part."""
    record = json.loads((folder / "parts.json").read_text())
    wheel = out / record["wheel"]
    out.mkdir(parents=True, exist_ok=True)
    with open(wheel, "wb") as f:
        for part in record["parts"]:
            path = folder / part["name"]
            if not path.exists():
                raise ValueError(f"part {part['name']} is missing (carry every part of {folder})")
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise ValueError(f"part {part['name']} is not the one prepare wrote (sha256 differs)")
            f.write(data)
    if sha256(wheel) != record["sha256"]:
        raise ValueError(f"{wheel.name} put together differs from the original (sha256)")
    return wheel


def unpack(wheel: Path, target: Path) -> Path:
    """A wheel's files onto a folder that PYTHONPATH then puts first (what pip --target does, without pip)."""
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    return target


def wheel_release(wheel_name: str) -> str:
    """'onnxruntime_gpu-1.31.1-cp311-...whl' -> '1.31.1'."""
    return wheel_name.split("-")[1]


# -- steps run in a child python (the wheel's onnxruntime first on its path) ---------------------------

def child(code: str, site: Path | None, timeout: int = STEP_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site) if site else "", str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


PROVIDER = """
import onnxruntime as ort
ort.preload_dlls() if hasattr(ort, "preload_dlls") else None
print(ort.__version__, ",".join(ort.get_available_providers()))
"""

PLACEMENTS = """
import json, numpy as np, onnxruntime as ort
from kiln.contract.artifact import EngineArtifact
from kiln.compiler.backends.gpu.compare import probe_steps
from kiln.engines.ort_cuda.feeds import cuda_feeds
ort.preload_dlls() if hasattr(ort, "preload_dlls") else None
m = EngineArtifact.load({artifact!r}).manifest
opts = ort.SessionOptions(); opts.enable_profiling = True; opts.log_severity_level = 3
s = ort.InferenceSession({model!r}, opts, providers=["CUDAExecutionProvider"])
kv, blocks = m.kv_layout, 16
feeds = cuda_feeds(probe_steps(m.spec.vocab_size, kv.block_size)[0], kv.block_size, blocks)
cache = np.zeros((blocks, kv.block_size, kv.num_kv_heads, kv.head_dim), np.float16)
feeds |= {{i.name: cache for i in s.get_inputs() if "_cache." in i.name}}
s.run(["logits"], feeds)
print(json.dumps({{"providers": s.get_providers(), "profile": s.end_profiling()}}))
"""

COMPARE = """
import json, numpy as np
from kiln.contract.artifact import EngineArtifact
from kiln.engines.load import load_engine
from kiln.compiler.backends.gpu.compare import compare_engines, engine_runner, probe_steps
from kiln.compiler.backends.ort_cuda.build import TOLERANCES
cuda, cpu = EngineArtifact.load({cuda!r}), EngineArtifact.load({cpu!r})
m = cpu.manifest
report = compare_engines(engine_runner("ort cpu", lambda: load_engine(cpu)),
                         engine_runner("ort-cuda", lambda: load_engine(cuda)),
                         probe_steps(m.spec.vocab_size, m.kv_layout.block_size), TOLERANCES)
from kiln.config import RuntimeConfig
from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
tokens = []
for path in ({cpu!r}, {cuda!r}):
    llm = LLM(path, RuntimeConfig(kv_cache_memory=1 << 24))
    try:
        [out] = llm.generate(["hello"], SamplingParams(max_tokens={n}, temperature=0.0, ignore_eos=True))
    finally:
        llm.shutdown()
    tokens.append(list(out.token_ids))
print(json.dumps({{"passed": report["passed"], "logits": report["outputs"]["logits"], "greedy_cpu": tokens[0],
                  "greedy_cuda": tokens[1]}}, default=float))
"""


def placements(profile_json: str) -> dict:
    """Node placements from an ONNX Runtime profile: nodes per provider, and those not on CUDA."""
    events = json.loads(Path(profile_json).read_text())
    nodes = {e["name"].removesuffix("_kernel_time"): e.get("args", {}).get("provider", "")
             for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")}
    counts: dict[str, int] = {}
    for provider in nodes.values():
        counts[provider] = counts.get(provider, 0) + 1
    return {"per_provider": counts, "not_on_cuda": sorted(n for n, p in nodes.items() if p != "CUDAExecutionProvider")}


# -- the two commands -----------------------------------------------------------------------------

def prepare(args, report: list) -> None:
    site = None
    if args.wheel:
        wheel = Path(args.wheel)
        if not wheel.is_file():
            refuse("wheel", report, f"{wheel} is not a file; pip download onnxruntime-gpu==<release> --no-deps "
                                    "-d out/gpu_check where PyPI is reachable")
        record = split(wheel, WORK / "parts")
        step("wheel split", report, f"{record['wheel']} into {len(record['parts'])} parts under out/gpu_check/parts")
        site = unpack(wheel, SCRATCH / "site-cpu")
    else:
        print("[note] no --wheel: the artifacts are built under the onnxruntime installed here, and the GPU "
              "machine must then have onnxruntime-gpu of that same release", flush=True)
    for name, options in ARTIFACTS.items():
        out = WORK / f"tiny-llama-{name}"
        proc = subprocess.run([sys.executable, "-c", "from kiln.cli import main; main()", "build", "tiny-llama", "--out", str(out), "--force",
                               *options], cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   p for p in (str(site) if site else "", str(ROOT)) if p)},
                              capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
        if proc.returncode != 0:
            refuse(f"build {name}", report, last_line(proc))
        recorded = json.loads((out / "manifest.json").read_text())["engines"][0].get("onnxruntime", "")
        step(f"build {name}", report, f"{out.relative_to(ROOT)}" + (f" (onnxruntime {recorded})" if recorded else ""))
    print("carry out/gpu_check/parts (one part per call if need be: ignored files stay between calls on a "
          "warm machine) and out/gpu_check/tiny-llama-*, then run: python scripts/gpu_check.py run", flush=True)


def run(args, report: list) -> None:
    artifacts = {name: WORK / f"tiny-llama-{name}" for name in ARTIFACTS}
    missing = [str(p.relative_to(ROOT)) for p in artifacts.values() if not (p / "manifest.json").exists()]
    if missing:
        refuse("inputs", report, f"no {', '.join(missing)}; run python scripts/gpu_check.py prepare on the CPU "
                                 "machine and carry out/gpu_check")
    absent = [m for m in NEEDED_MODULES if not _importable(m)]
    if absent:
        refuse("python modules", report, f"this python lacks {', '.join(absent)}; use a python with kiln's "
                                         "requirements (scripts/setup.sh)")
    step("inputs", report, ", ".join(str(p.relative_to(ROOT)) for p in artifacts.values()))
    site = None
    if (WORK / "parts" / "parts.json").exists():
        try:
            wheel = assemble(WORK / "parts", SCRATCH / "wheel")
        except ValueError as e:
            refuse("wheel", report, str(e))
        step("wheel", report, f"{wheel.name} put together, sha256 checked")
    else:
        wheel = None
        step("wheel", report, "no parts: the onnxruntime importable here is used")
    from kiln.engines.gpu.device import cuda_device_count

    if cuda_device_count() == 0:
        refuse("GPU", report, "no CUDA GPU here (no libcuda.so.1 or no device); every step from here needs one: "
                              "run python scripts/gpu_check.py run on the GPU machine")
    step("GPU", report, f"{cuda_device_count()} device(s)")
    if wheel is not None:
        site = unpack(wheel, SCRATCH / "site")
        step("onnxruntime-gpu", report, f"unpacked onto PYTHONPATH ({wheel_release(wheel.name)})")
    proc = child(PROVIDER, site)
    if proc.returncode != 0 or "CUDAExecutionProvider" not in proc.stdout:
        refuse("CUDA provider", report, f"{last_line(proc)}; onnxruntime-gpu needs CUDA and cuDNN of the majors "
                                        "it was built for, system-wide or as nvidia pip packages")
    step("CUDA provider", report, proc.stdout.strip())
    model = artifacts["ort-cuda"] / "engines" / "ort-cuda" / "model.onnx"
    proc = child(PLACEMENTS.format(artifact=str(artifacts["ort-cuda"]), model=str(model)), site)
    if proc.returncode != 0:
        refuse("CUDA session", report, last_line(proc))
    session = json.loads(proc.stdout.strip().splitlines()[-1])
    placed = placements(session["profile"]) if Path(session["profile"]).exists() else {}
    step("node placements", report, json.dumps(placed.get("per_provider", {})), placements=placed)
    proc = child(COMPARE.format(cuda=str(artifacts["ort-cuda"]), cpu=str(artifacts["ort"]), n=GREEDY_TOKENS), site)
    if proc.returncode != 0:
        refuse("ort-cuda vs CPU", report, last_line(proc))
    compared = json.loads(proc.stdout.strip().splitlines()[-1])
    same = sum(a == b for a, b in zip(compared["greedy_cpu"], compared["greedy_cuda"]))
    step("ort-cuda vs CPU", report, f"logits {'within' if compared['passed'] else 'OUTSIDE'} tolerance "
                                    f"({compared['logits']}); greedy tokens equal {same}/{GREEDY_TOKENS}", **compared)
    if not args.no_tests:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site) if site else "", str(ROOT)) if p)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/gpu",
                               "-k", "ort_cuda or cuda_memory"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=STEP_TIMEOUT_S)
        step("GPU tests", report, last_line(proc), returncode=proc.returncode, tail=proc.stdout[-4000:])


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="on the CPU machine: wheel parts and the two tiny-llama artifacts")
    p.add_argument("--wheel", help="the onnxruntime-gpu wheel (pip download onnxruntime-gpu==<release> --no-deps)")
    r = sub.add_parser("run", help="on the GPU machine")
    r.add_argument("--no-tests", action="store_true", help="skip the pytest step")
    for q in (p, r):
        q.add_argument("--json", help="also write the steps as JSON to this file")
    args = parser.parse_args(argv)
    started, report, code = time.perf_counter(), [], 0
    try:
        (prepare if args.command == "prepare" else run)(args, report)
    except Refused as e:
        print(e.code, flush=True)
        code = 1
    except subprocess.TimeoutExpired as e:
        print(f"[refused] a step ran past {e.timeout} s: {' '.join(map(str, e.cmd))[:200]}", flush=True)
        code = 1
    if args.json:
        Path(args.json).write_text(json.dumps({"command": args.command, "exit": code, "report": report,
                                               "seconds": round(time.perf_counter() - started, 1)}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
