"""One system of bench_runtime.py, measured in a process of its own.

    python -m bench.runtime_worker SYSTEM --plan PLAN.json --out RESULT.json

SYSTEM is `kiln:BACKEND:QUANT` (kiln:ort:int8), `genai:QUANT`, `openvino:QUANT` or `hf:fp32`;
bench_gguf_peers.py's are `artifact:PATH` (a kiln artifact built already) and `llamacpp:PATH` (a
GGUF file, run by llama.cpp).
The plan (written by bench_runtime.py) holds the sizes, the threads, the cache folder and the
prompts as token ids. The worker sets its system up (builds or exports the model into the cache:
setup, not measurement), then times every workload and writes the runs as JSON.

NOTE: one system per process, one process at a time: two ONNX Runtime processes on 2 cores
collapse each other, and a process that held another runtime's threads and arenas is not a fair
start. This module imports kiln only for kiln systems: the OpenVINO GenAI peer runs it in an
environment without kiln.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")      # NOTE: transformers' GGUF loader draws tqdm bars
from bench.runtime_workloads import Sizes, measure_system


def _kiln(variant: str, plan: dict):
    import logging

    from bench.runtime_kiln import KilnRunner, ensure_kiln

    logging.getLogger("kiln").setLevel(logging.WARNING)
    backend, quant = variant.split(":")
    artifact = ensure_kiln(Path(plan["cache"]), backend, quant, reuse=plan.get("reuse_kiln", False))
    return KilnRunner(artifact, plan["threads"], _label(artifact, backend, quant))


def _label(artifact: Path, backend: str, quant: str) -> str:
    """auto:auto is `kiln build` with no flags: the label names what the build chose (its manifest)."""
    if "auto" not in (backend, quant):
        return f"{backend} {quant}"
    choices = json.loads((artifact / "manifest.json").read_text())["choices"]
    flags = "no flags" if (backend, quant) == ("auto", "auto") else f"--quant {quant}"
    return f"defaults ({flags}): {choices['backend']['value']} {choices['quant']['value']}"


def _artifact(path: str, plan: dict):
    import logging

    from bench.runtime_kiln import KilnRunner

    logging.getLogger("kiln").setLevel(logging.WARNING)
    choices = json.loads((Path(path) / "manifest.json").read_text())["choices"]
    flags = " ".join(f"--{k} {c['value']}" for k, c in choices.items() if c["chosen_by"] == "user") or "no flags"
    return KilnRunner(Path(path), plan["threads"], f"{flags}: {choices['backend']['value']} {choices['quant']['value']}")


def _llamacpp(path: str, plan: dict):
    from bench.peer_llamacpp import LlamaCppRunner

    sizes = plan["sizes"]
    chat = max(len(p) for p in plan["prompts"]["chat"]) + sizes["chat_tokens"]
    longest = max(sizes["ttft_prompt"] + 1, sizes["prompt"] + max(sizes["batch_tokens"], sizes["decode_tokens"]), chat)
    return LlamaCppRunner(Path(path), plan["threads"], max(sizes["ways"]), longest, Path(path).stem)


def _genai(quant: str, plan: dict):
    from bench.peers import GenAIRunner, build_genai

    cache = Path(plan["cache"])
    model_dir = build_genai(Path(plan["hf_dir"]), cache / f"genai-{quant}", quant, cache / "genai-cache")
    return GenAIRunner(model_dir, plan["threads"], quant)


def _openvino(quant: str, plan: dict):
    from bench.peer_openvino import OpenVINORunner, export_openvino

    model_dir = export_openvino(Path(plan["hf_dir"]), Path(plan["cache"]) / f"openvino-{quant}", quant)
    return OpenVINORunner(model_dir, plan["threads"], quant)


def _hf(quant: str, plan: dict):
    import torch
    from bench.peers import HFRunner
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if quant != "fp32":
        raise SystemExit("HF transformers runs fp32 only here")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # NOTE: the plain folder the peers read (the GGUF's weights), not the GGUF-loaded model: that one
    # ran batched generate ~20x slower here (8 prompts: 7 s to the first token against 0.3 s).
    model = AutoModelForCausalLM.from_pretrained(plan["hf_dir"], dtype=torch.float32).eval()
    return HFRunner(model, plan["threads"])


FAMILIES = {"kiln": _kiln, "genai": _genai, "openvino": _openvino, "hf": _hf, "artifact": _artifact,
            "llamacpp": _llamacpp}


def load_plan(path: Path) -> tuple[dict, Sizes]:
    plan = json.loads(path.read_text())
    sizes = plan["sizes"]
    return plan, Sizes(**{**sizes, "ways": tuple(sizes["ways"])})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("system")
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--setup-only", action="store_true", help="build or export the model, measure nothing")
    args = ap.parse_args(argv)
    plan, sizes = load_plan(args.plan)
    family, _, variant = args.system.partition(":")
    t0 = time.perf_counter()
    runner = FAMILIES[family](variant, plan)
    setup_s = time.perf_counter() - t0
    if args.setup_only:
        args.out.write_text(json.dumps({"system": args.system, "name": runner.name, "setup_s": setup_s}))
        return
    runs = measure_system(runner, plan["prompts"], sizes)
    args.out.write_text(json.dumps({"system": args.system, "name": runner.name, "setup_s": setup_s, "runs": runs}))


if __name__ == "__main__":
    main()
