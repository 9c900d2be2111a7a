"""`kiln triton-repo`: render a Triton model repository from an artifact's manifest.

    model_repository/
      <name>/config.pbtxt     decoupled python-backend model; parameters carry the artifact path,
                              its manifest hash, runtime knobs and EXECUTION_ENV_PATH
      <name>/1/model.py       a shim importing kiln.serving.triton.backend

The artifact is loaded (and checked) here, so a corrupt one is refused now with kiln's
ArtifactError message, not later in the Triton log.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kiln.contract.artifact import EngineArtifact
from kiln.contract.manifest import MANIFEST, sha256_file
from kiln.serving.triton.settings import EXECUTION_ENV_PATH, BackendSettings
from kiln.serving.triton.templates import CONFIG_PBTXT, MODEL_PY, pbtxt_parameters
from kiln.serving.triton.tensors import INPUTS, OUTPUTS, pbtxt_list

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class RepoOptions:
    name: str = "kiln"
    instances: int = 1
    max_queue: int = 256
    runtime: dict = field(default_factory=dict)    # settings.RUNTIME_KNOBS -> value
    # The environment model.py runs in: this interpreter's venv, which holds kiln and numpy<2.
    execution_env: Path | None = None

    def __post_init__(self):
        if not MODEL_NAME.match(self.name):
            raise ValueError(f"model name {self.name!r}: use letters, digits, '_', '.', '-'")
        if self.instances < 1:
            raise ValueError(f"instances must be at least 1, got {self.instances}")


def render_repository(artifact_path: str | Path, out: str | Path, options: RepoOptions = RepoOptions()) -> Path:
    """Write (or overwrite) the model folder <out>/<name>; other models in <out> are kept."""
    artifact_path = Path(artifact_path).resolve()
    artifact = EngineArtifact.load(artifact_path)          # raises ArtifactError with what to do
    settings = BackendSettings(artifact_path, sha256_file(artifact_path / MANIFEST),
                               options.max_queue, dict(options.runtime))
    settings.runtime_config()                              # refuse bad knobs now, not at load
    model_dir = Path(out) / options.name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_config(artifact, settings, options))
    (model_dir / "1" / "model.py").write_text(MODEL_PY)
    return model_dir


def render_config(artifact: EngineArtifact, settings: BackendSettings, options: RepoOptions) -> str:
    m = artifact.manifest
    params = settings.to_parameters()
    env = options.execution_env or default_execution_env()
    if env is not None:
        params[EXECUTION_ENV_PATH] = str(env)
    return CONFIG_PBTXT.substitute(
        manifest=artifact.path / MANIFEST, family=m.spec.family, num_layers=m.spec.num_layers,
        hidden_size=m.spec.hidden_size, vocab_size=m.spec.vocab_size, quant=m.quant.get("mode", "none"),
        max_model_len=m.generation["max_model_len"], block_size=m.kv_layout.block_size,
        max_batch=m.buckets.max_batch, name=options.name, inputs=pbtxt_list(INPUTS),
        outputs=pbtxt_list(OUTPUTS), instances=options.instances, parameters=pbtxt_parameters(params))


def default_execution_env() -> Path | None:
    """The running venv (kiln is installed there), or None outside a venv: then the launcher's
    PATH decides which Python the stub uses."""
    return Path(sys.prefix) if sys.prefix != sys.base_prefix else None
