"""Which extra (pyproject.toml's [project.optional-dependencies]) brings each optional module, so a
command run without one can name what to install instead of ending in a traceback."""

from __future__ import annotations

# extra -> the top-level modules its packages provide; keep in step with pyproject.toml
EXTRAS = {
    "build": ("onnx", "onnx_ir", "onnx_graphsurgeon", "gguf", "safetensors", "transformers", "sentencepiece",
              "nncf"),
    "parity": ("torch", "accelerate"),
    "bench": ("httpx", "matplotlib"),
    "peers": ("onnxruntime_genai",),
    "triton": ("pytriton", "tritonclient"),
    "scale": ("ray",),
    "gpu": ("tensorrt", "cuda", "polygraphy"),
    "semantic-cache": ("torch", "transformers", "safetensors"),
}

# A module several extras bring: the one a command needs it for, where that is not the first listed
# (kiln serve needs torch only to export the semantic cache's embedding model).
COMMAND_EXTRA = {"serve": "semantic-cache"}


def extra_for(module: str, command: str = "") -> str | None:
    """The extra that brings `module` (a dotted name counts as its top-level package), or None when
    no extra does: then the module is kiln's own or a base dependency, and its absence is a bug."""
    top = module.partition(".")[0]
    extras = [extra for extra, modules in EXTRAS.items() if top in modules]
    preferred = COMMAND_EXTRA.get(command)
    return preferred if preferred in extras else next(iter(extras), None)


def install_hint(extra: str) -> str:
    return f"pip install 'kiln[{extra}]'"
