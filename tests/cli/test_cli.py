"""The kiln CLI end to end on a tiny preset: build, inspect, generate."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kiln.cli import main


def test_build_inspect_generate(tmp_path):
    runner = CliRunner()
    out = tmp_path / "tiny"
    res = runner.invoke(main, ["build", "tiny-qwen2", "--out", str(out), "--quant", "int8", "--backend", "ort"])
    assert res.exit_code == 0, res.output
    assert "pass kv_io" in res.output and "built" in res.output

    res = runner.invoke(main, ["inspect", str(out), "--context", "1024", "--memory", "1MiB"])
    assert res.exit_code == 0, res.output
    assert "KV bytes / token" in res.output
    # 2 layers x k/v x 2 kv heads x 16 dims x 4 bytes = 512 B/token; 1 MiB = 128 blocks of 16
    assert "128 blocks = 2,048 tokens = 2 sequences at context 1024" in res.output

    assert "build plan" in res.output and "gate_up" in res.output          # each role's kernel, with its reason

    res = runner.invoke(main, ["inspect", str(out), "--json"])
    manifest = json.loads(res.output)
    assert manifest["quant"]["mode"] == "int8" and manifest["schema_version"] == 1
    plan = manifest["plan"]                                                   # the build plan, verbatim
    assert plan["backend"]["value"] == "ort" and plan["recipe"]["mode"] == "int8"
    assert {r["role"] for r in plan["recipe"]["roles"]} == {"qkv", "o", "gate_up", "down", "lm_head", "embedding"}

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hello"\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    res = runner.invoke(main, ["generate", str(out), "--prompt-file", str(prompts), "--max-tokens", "5",
                               "--json", "--kv-cache-memory", "16MiB"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    assert len(lines) == 2 and all(1 <= len(line["token_ids"]) <= 5 for line in lines)


def test_build_refuses_existing_folder(tmp_path):
    (tmp_path / "x").mkdir()
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(tmp_path / "x")])
    assert res.exit_code == 1 and "--force" in res.output


def test_generate_on_missing_artifact_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(main, ["generate", str(tmp_path / "nope"), "--prompt", "hi"])
    assert res.exit_code == 1 and "not an artifact folder" in res.output


def test_build_with_no_flags_says_what_it_chose_and_records_it(tmp_path):
    """--backend auto and --quant auto: a tiny model stays fp32 (too small to gain) on ort."""
    out = tmp_path / "tiny"
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "chose ort none" in res.output and "too small to gain" in res.output
    choices = json.loads((out / "manifest.json").read_text())["choices"]
    assert choices["backend"]["value"] == "ort" and choices["backend"]["chosen_by"] == "auto"
    assert choices["quant"] == {"value": "none", "chosen_by": "auto", "reason": choices["quant"]["reason"]}
    res = CliRunner().invoke(main, ["inspect", str(out)])
    assert "chosen backend" in res.output and "chosen quant" in res.output


def test_a_build_that_runs_out_of_space_publishes_nothing_and_says_so(tmp_path):
    """A disk that fills mid-build, simulated with a file-size limit (RLIMIT_FSIZE: a write past it
    fails with EFBIG, as a full disk fails with ENOSPC): exit 1 with one line that says what
    happened, and neither the artifact nor a half-written folder beside it."""
    import resource
    import signal
    import subprocess
    import sys

    from kiln.compiler.export.presets import write_tiny_checkpoint

    source = write_tiny_checkpoint("tiny-llama", tmp_path / "source")     # written before the limit
    out_parent = tmp_path / "out"
    out_parent.mkdir()

    def file_size_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # the write fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    done = subprocess.run([sys.executable, "-c", "from kiln.cli import main; main()", "build", str(source),
                           "--out", str(out_parent / "art"), "--backend", "ort", "--quant", "none"],
                          preexec_fn=file_size_limit, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "out of disk space" in said and "Nothing was published" in said and "Traceback" not in said
    assert list(out_parent.iterdir()) == []


def test_a_runtime_install_without_onnx_reports_errors_instead_of_needing_the_build_extra():
    """kiln serve in an install without the build extra (the container image): the error guard around
    every command must not import the build code, which needs onnx."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['onnx'] = None\n"          # as if onnx were not installed
            "from kiln.cli import _guarded\n"
            "assert _guarded(lambda: 7) == 7\n"
            "def fails():\n    raise ValueError('a refusal the user can act on')\n"
            "_guarded(fails)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "a refusal the user can act on" in done.stderr and "Traceback" not in done.stderr
