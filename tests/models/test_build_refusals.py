"""`kiln build` on what it cannot build: a non-zero exit, a one-line reason, no artifact left."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln.compiler.export.presets import write_tiny_checkpoint


def _kiln_build(source, out):
    cli = [sys.executable, "-c", "from kiln.cli import main; main()"]
    return subprocess.run([*cli, "build", str(source), "--out", str(out)], capture_output=True, text=True, timeout=300)


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))


def _unsupported_arch(folder):
    _edit_config(folder, model_type="falcon")


def _unsupported_rope(folder):
    _edit_config(folder, rope_scaling={"rope_type": "proportional", "factor": 2.0})


def _damaged(folder):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4096])


@pytest.mark.parametrize("damage,reason", [(_unsupported_arch, "unsupported architecture 'falcon'"),
                                           (_unsupported_rope, "rope scaling 'proportional'"),
                                           (_damaged, "truncated")])
def test_build_refuses_in_one_line_and_leaves_nothing(tmp_path, damage, reason):
    folder = write_tiny_checkpoint("tiny-llama", tmp_path / "ckpt")
    damage(folder)
    out = tmp_path / "out" / "artifact"
    result = _kiln_build(folder, out)
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    assert result.returncode != 0
    assert any(reason in ln for ln in lines), lines
    assert not any("Traceback" in ln for ln in lines), lines
    assert [ln for ln in lines if "error" in ln.lower()] and len([ln for ln in lines if "error:" in ln]) == 1
    assert not out.exists() and not list((tmp_path / "out").glob(".*building*"))
