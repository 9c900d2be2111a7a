"""What model.py needs to start, carried in config.pbtxt `parameters` (strings only).

The renderer writes them with to_parameters() and the backend reads them back with
from_parameters(), so the two sides cannot drift apart. Runtime knobs use the names of the
`kiln generate` options and go through the same RuntimeConfig builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.config import RuntimeConfig
from kiln.config_options import RUNTIME_KNOBS, runtime_config

# Triton's python backend reads this one itself: it activates that environment before starting
# the stub, so model.py imports kiln and its numpy<2 from there (PYTHONPATH is ignored by the stub).
EXECUTION_ENV_PATH = "EXECUTION_ENV_PATH"

_INT_KNOBS = {"max_num_seqs", "token_budget", "max_model_len", "threads"}


@dataclass(frozen=True)
class BackendSettings:
    artifact_path: Path
    manifest_sha256: str                 # the manifest the repository was rendered from
    max_queue: int = 256                 # waiting requests beyond this are refused (UNAVAILABLE)
    runtime: dict = field(default_factory=dict)   # RUNTIME_KNOBS -> value; absent = kiln's default

    def __post_init__(self):
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        unknown = set(self.runtime) - set(RUNTIME_KNOBS)
        if unknown:
            raise ValueError(f"unknown runtime knobs {sorted(unknown)}; known: {list(RUNTIME_KNOBS)}")

    def runtime_config(self) -> RuntimeConfig:
        knobs = {k: self.runtime.get(k) for k in RUNTIME_KNOBS}
        knobs["no_prefix_caching"] = bool(knobs["no_prefix_caching"])
        return runtime_config(**knobs)

    def to_parameters(self) -> dict[str, str]:
        params = {"artifact_path": str(self.artifact_path), "manifest_sha256": self.manifest_sha256,
                  "max_queue": str(self.max_queue)}
        params.update({k: _knob_text(v) for k, v in self.runtime.items() if v not in (None, False)})
        return params

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "BackendSettings":
        """From config.pbtxt parameters as the backend sees them (plain strings)."""
        runtime = {k: _knob_value(k, params[k]) for k in RUNTIME_KNOBS if params.get(k, "") != ""}
        return cls(Path(params["artifact_path"]), params["manifest_sha256"],
                   int(params.get("max_queue", 256)), runtime)


def model_config_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt parameters from the JSON model config Triton hands to initialize()."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


def _knob_text(value) -> str:
    return "true" if value is True else str(value)


def _knob_value(name: str, text: str):
    if name == "no_prefix_caching":
        return text.lower() == "true"
    return int(text) if name in _INT_KNOBS else text
