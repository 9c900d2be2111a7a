"""Serving side by side: `kiln serve` against vLLM's CPU server, the same closed-loop client
(`kiln bench --url`) against each in turn, one server at a time.

    .venv/bin/python -m bench.bench_serving                      # kiln and vLLM, 1/8/32/64 clients
    .venv/bin/python -m bench.bench_serving --systems kiln --clients 32 --duration 20   # kiln alone

kiln runs its default build (`kiln build smollm2-135m`, no flags) with the server's defaults and
`--kv-cache-memory 1GiB`; vLLM serves the same SmolLM2 weights (an HF folder written from the
GGUF) in bf16 with 1 GiB of KV (VLLM_CPU_KVCACHE_SPACE=1) and both cores for its OpenMP threads.
vLLM's environment is made by bench/setup_vllm.sh. Workloads (kiln/bench/workloads.py):
`serving` (distinct ~250-token chat prompts, 128-token replies with ignore_eos, greedy) and
`system-prompt` (a ~1,000-token shared system prompt before short questions).

Writes bench/results/serving.json (per system, workload and client count: output tokens/s, TTFT
p50/p99, ITL p50/p99, served and refused counts; the machine's CPU class, date and command) and
bench/results/serving.png (throughput and TTFT p99 against clients).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
MODEL_NAME = "smollm2"
READY_WITHIN_S = 600          # vLLM compiles its graphs at every start (minutes on 2 cores)
KV_MEMORY = "1GiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln_artifact(cache: Path) -> Path:
    """The default build, once per kiln build-code state: a change to what shapes an artifact (the build
    plan's defaults among it) names another folder, so a run never serves a stale default."""
    from bench.runtime_kiln import _build_code_hash

    out = cache / f"kiln-default-{_build_code_hash()}"
    if not (out / "manifest.json").is_file():
        subprocess.run([str(VENV_BIN / "kiln"), "build", "smollm2-135m", "--out", str(out), "--force"], check=True)
    return out


def vllm_model(cache: Path) -> Path:
    from bench.peers import ensure_hf_folder

    return ensure_hf_folder(cache / "smollm2-hf")


def kiln_command(cache: Path, port: int) -> tuple[list[str], dict]:
    return ([str(VENV_BIN / "kiln"), "serve", str(kiln_artifact(cache)), "--port", str(port),
             "--kv-cache-memory", KV_MEMORY, "--served-model-name", MODEL_NAME], {})


def vllm_command(cache: Path, port: int) -> tuple[list[str], dict]:
    python = ROOT / "bench" / ".cache" / "venv-vllm" / "bin" / "python"
    if not python.exists():
        subprocess.run(["bash", str(ROOT / "bench" / "setup_vllm.sh")], check=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    return ([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_model(cache)),
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096",
             "--served-model-name", MODEL_NAME], env)


def kiln_thread_command(cache: Path, port: int) -> tuple[list[str], dict]:
    """kiln with its engine on a thread of the server's process (the split's baseline)."""
    command, env = kiln_command(cache, port)
    return [*command, "--no-engine-process"], env


SYSTEMS = {"kiln": kiln_command, "kiln-thread": kiln_thread_command, "vllm": vllm_command}


def process_cpu_seconds(leader: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's processes: the one started ("api") and
    its descendants together ("engine": kiln's engine process; vLLM's engine core and helpers)."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(leader)
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            role = "api" if proc.pid == leader else "engine"
            out[role] = out.get(role, 0.0) + times.user + times.system
    except psutil.Error:          # it exited meanwhile: the level's record says so by its absence
        pass
    return out



@contextmanager
def running(system: str, cache: Path, log_dir: Path):
    port = free_port()
    command, env = SYSTEMS[system](cache, port)
    log = log_dir / f"{system}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_ready(proc, port, log)
        print(f"{system}: serving on port {port} after {time.monotonic() - started:.1f} s", flush=True)
        yield f"http://127.0.0.1:{port}", time.monotonic() - started, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not serving within {READY_WITHIN_S} s:\n{log.read_text()[-3000:]}")


def level_seed(clients: int) -> int:
    """Each level's own requests (the same for every system): a server stays up across levels, and a
    level that replayed the last one's prompts would be answered from caches (kiln's response cache
    streams a repeated greedy request at once, and both servers' prefix caches hold its prompt)."""
    return clients


def run_level(url: str, workload: str, clients: int, duration: float, artifact: Path, out: Path) -> dict:
    """One closed-loop level through `kiln bench --url`, reduced to the side-by-side's figures."""
    subprocess.run([str(VENV_BIN / "kiln"), "bench", "--url", url, "--workload", workload, "--concurrency",
                    str(clients), "--duration", str(duration), "--temperature", "0", "--timeout", "600",
                    "--seed", str(level_seed(clients)),
                    "--tokenizer", str(artifact), "--model", MODEL_NAME, "--json", str(out)], check=True)
    level = json.loads(out.read_text())["runs"][0]["levels"][0]
    return summarize(level)


def summarize(level: dict) -> dict:
    stats, records = level["stats"], level["requests"]
    refused = sum(1 for r in records if "HTTP 429" in (r.get("error") or ""))
    return {"output_tokens_per_s": stats["output_tokens_per_s"], "requests": stats["num_requests"],
            "served": stats["outcomes"]["ok"], "refused_429": refused,
            "timeouts": stats["outcomes"]["timeout"],
            "ttft_p50": stats["ttft"]["p50"], "ttft_p99": stats["ttft"]["p99"],
            "itl_p50": stats["itl"]["p50"], "itl_p99": stats["itl"]["p99"]}


def machine() -> dict:
    from kiln.contract.cpu import host

    cpu = host()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cpu_class": cpu.cpu_class, "cores": os.cpu_count(), "machine": platform.machine()}


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in doc["results"]})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        for system in doc["systems"]:
            rows = sorted((r for r in doc["results"] if r["system"] == system and r["workload"] == workload),
                          key=lambda r: r["clients"])
            clients = [r["clients"] for r in rows]
            axes[0][col].plot(clients, [r["output_tokens_per_s"] for r in rows], marker="o", label=system)
            axes[1][col].plot(clients, [r["ttft_p99"] or 0 for r in rows], marker="o", label=system)
        axes[0][col].set(title=f"{workload}: output tokens/s", xlabel="clients", xscale="log", xticks=clients)
        axes[1][col].set(title=f"{workload}: TTFT p99 (s)", xlabel="clients", xscale="log", xticks=clients)
        for ax in axes[:, col]:
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.legend()
            ax.grid(alpha=0.3)
    fig.suptitle(f"kiln serve vs vLLM CPU, SmolLM2-135M, {doc['cpu']} ({doc['machine']['cores']} cores), "
                 f"{doc['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="kiln,vllm",
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (kiln-thread: the engine on a thread of "
                             "the server's process)")
    parser.add_argument("--workloads", default="serving,system-prompt")
    parser.add_argument("--clients", default="1,8,32,64")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of issuing requests per level")
    parser.add_argument("--cache", type=Path, default=ROOT / "bench" / ".cache" / "serving")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serving.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "serving.png")
    parser.add_argument("--journal", default="docs/results/2026-12-06-serving-vs-vllm.md",
                        help="the docs/results/ entry that tells this run's story (bench/render_results.py links it)")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    systems, workloads = args.systems.split(","), args.workloads.split(",")
    clients = [int(c) for c in args.clients.split(",")]
    now, host = datetime.now(timezone.utc), machine()
    doc = {"date": now.strftime("%Y-%m-%d"), "time_utc": now.strftime("%H:%M"), "cpu": host["cpu"],
           "cpu_class": host["cpu_class"], "journal": args.journal, "machine": host,
           "command": " ".join(["python", "-m", "bench.bench_serving", *sys.argv[1:]]), "systems": systems,
           "kv_cache_memory": KV_MEMORY, "duration_s": args.duration, "results": [], "startup_s": {}}
    artifact = kiln_artifact(args.cache)
    with tempfile.TemporaryDirectory() as tmp:
        for system in systems:
            with running(system, args.cache, Path(tmp)) as (url, startup, pid):
                doc["startup_s"][system] = round(startup, 1)
                for workload in workloads:
                    for n in clients:
                        cpu_before = process_cpu_seconds(pid)
                        row = run_level(url, workload, n, args.duration, artifact, Path(tmp) / "level.json")
                        cpu = {role: round(seconds - cpu_before.get(role, 0.0), 2)
                               for role, seconds in process_cpu_seconds(pid).items()}
                        doc["results"].append({"system": system, "workload": workload, "clients": n, **row,
                                               "cpu_seconds": cpu})
                        print(json.dumps(doc["results"][-1]), flush=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, args.plot)
    print(f"wrote {args.out} and {args.plot}; then: python -m bench.render_results")


if __name__ == "__main__":
    main()
