"""First contact: the mistakes a new user makes on the command line, each answered with one line
that says what to run instead: a model where an artifact belongs, a misspelled preset, a Hugging
Face hub id, a folder that holds artifacts, and a command run without the extra it needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main

ARTIFACT_COMMANDS = [["serve"], ["generate", "--prompt", "hi"], ["inspect"]]


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """Run in an empty folder, so the messages name the paths as the user typed them."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def kiln(*args: str) -> str:
    """Run the CLI; it must refuse with exit code 1 and one line."""
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 1, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert res.output.startswith("error: "), res.output
    return res.output.strip()


def fake_artifact(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


# -- a model source where an artifact belongs ------------------------------------------------------

@pytest.mark.parametrize("command", ARTIFACT_COMMANDS, ids=lambda c: c[0])
def test_a_gguf_file_is_a_model_to_build_first(here, command):
    (here / "some.gguf").write_bytes(b"GGUF")
    said = kiln(command[0], "some.gguf", *command[1:])
    assert "some.gguf is a model file, not a kiln artifact" in said
    assert "`kiln build some.gguf --out engines/some`" in said


@pytest.mark.parametrize("command", ARTIFACT_COMMANDS, ids=lambda c: c[0])
def test_a_hugging_face_folder_is_a_model_to_build_first(here, command):
    (here / "SmolLM2").mkdir()
    (here / "SmolLM2" / "config.json").write_text("{}")
    said = kiln(command[0], "SmolLM2", *command[1:])
    assert "SmolLM2 is a Hugging Face model folder, not a kiln artifact" in said
    assert "`kiln build SmolLM2 --out engines/SmolLM2`" in said


@pytest.mark.parametrize("command", ARTIFACT_COMMANDS, ids=lambda c: c[0])
def test_a_preset_name_is_a_model_to_build_first(here, command):
    said = kiln(command[0], "smollm2-135m", *command[1:])
    assert "smollm2-135m is a model preset, not a kiln artifact" in said
    assert "`kiln build smollm2-135m --out engines/smollm2-135m`" in said


def test_the_python_api_names_a_model_file_too(here):
    """The artifact checks themselves say it, for LLM(...) and every other loader."""
    from kiln.contract.artifact import ArtifactError, EngineArtifact

    (here / "some.gguf").write_bytes(b"GGUF")
    with pytest.raises(ArtifactError, match="some.gguf is a model file.*kiln build some.gguf --out engines/some"):
        EngineArtifact.load("some.gguf")


# -- a source kiln build cannot read ---------------------------------------------------------------

def test_a_misspelled_preset_gets_the_closest_name(here):
    said = kiln("build", "smolm2-135m", "--out", "engines/x")
    assert "is neither a preset" in said and "did you mean 'smollm2-135m'?" in said


def test_a_hub_id_says_kiln_does_not_download_and_how_to_get_the_files(here):
    said = kiln("build", "HuggingFaceTB/SmolLM2-135M-Instruct", "--out", "engines/x")
    assert "kiln does not download models" in said
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir models/SmolLM2-135M-Instruct`" in said
    assert "`kiln build models/SmolLM2-135M-Instruct --out engines/SmolLM2-135M-Instruct`" in said


def test_a_missing_gguf_path_is_not_taken_for_a_hub_id(here):
    said = kiln("build", "models/x.gguf", "--out", "engines/x")
    assert "download" not in said and "is neither a preset" in said


# -- a folder of artifacts -------------------------------------------------------------------------

@pytest.mark.parametrize("command", ARTIFACT_COMMANDS, ids=lambda c: c[0])
def test_a_folder_holding_one_artifact_names_it_and_the_command(here, command):
    fake_artifact(here / "engines" / "smollm2")
    said = kiln(command[0], "engines", *command[1:])
    assert f"engines is not an artifact; it holds one: engines/smollm2 — kiln {command[0]} engines/smollm2" in said


def test_a_folder_holding_several_artifacts_lists_a_few(here):
    for name in "abcde":
        fake_artifact(here / "engines" / name)
    (here / "engines" / ".f.building-1").mkdir()             # a build under way is no artifact
    said = kiln("serve", "engines")
    assert "engines is not an artifact; it holds 5: engines/a, engines/b, engines/c, engines/d, …" in said


# -- a missing extra -------------------------------------------------------------------------------

def run_without(modules: list[str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter where importing `modules` fails as if they were not installed."""
    code = f"import sys; sys.modules.update(dict.fromkeys({modules!r})); from kiln.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("missing, args, line", [
    ("httpx", ["bench", "--url", "http://127.0.0.1:9/v1", "--max-requests", "1"],
     "error: kiln bench needs the 'bench' extra (httpx is not installed): pip install 'kiln[bench]'"),
    ("onnx", ["build", "tiny-llama", "--out", "engines/tiny"],
     "error: kiln build needs the 'build' extra (onnx is not installed): pip install 'kiln[build]'"),
], ids=["bench", "build"])
def test_a_command_without_its_extra_ends_in_one_line_naming_it(tmp_path, missing, args, line):
    done = run_without([missing], *args, cwd=tmp_path)
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 1, said
    assert said == line


def test_a_missing_module_no_extra_brings_keeps_its_traceback(monkeypatch, here):
    """kiln's own module missing is a bug, not an install to suggest."""
    monkeypatch.setitem(sys.modules, "kiln.compiler.build", None)
    res = CliRunner().invoke(main, ["build", "tiny-llama", "--out", "engines/tiny"])
    assert isinstance(res.exception, ModuleNotFoundError), res.output
    assert "extra" not in res.output


def test_each_module_maps_to_the_extra_that_brings_it():
    from kiln.extras import extra_for

    assert extra_for("httpx") == "bench" and extra_for("onnx.helper") == "build"
    assert extra_for("onnxruntime_genai") == "peers" and extra_for("cuda.bindings") == "gpu"
    assert extra_for("torch", "bench") == "parity" and extra_for("torch", "serve") == "semantic-cache"
    assert extra_for("numpy") is None and extra_for("kiln.runtime") is None


def test_every_extra_named_is_one_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")     # Python 3.11+
    from kiln.extras import EXTRAS

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert set(EXTRAS) <= set(pyproject["project"]["optional-dependencies"])
