"""Model sources -> (ModelSpec, HF-named fp32 weights, tokenizer folder).

Three kinds of source: an HF checkpoint folder, a GGUF file, or a preset name.
Weights come back in Hugging Face naming and layout ([out, in] for linears), whatever the source.
"""

from __future__ import annotations

import difflib
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.compiler.export import presets
from kiln.compiler.export.families import spec_from_hf_config
from kiln.contract.model_spec import ModelSpec


@dataclass
class ModelSource:
    description: str
    spec: ModelSpec
    weights: dict[str, np.ndarray]
    tokenizer_dir: Path            # holds tokenizer.json (+ tokenizer_config.json)
    hf_dir: Path | None = None     # an HF folder transformers can load (for parity tests)
    # ids that end a turn besides the tokenizer's eos (GGUF eot/eom ids, generation_config.json's list)
    end_token_ids: tuple[int, ...] = ()
    _keepalive: list = field(default_factory=list, repr=False)


def load_source(source: str) -> ModelSource:
    """Resolve a preset name, a .gguf path or an HF folder."""
    if source in presets.PRESETS:
        return _load_preset(presets.PRESETS[source]())
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_folder(path)
    raise FileNotFoundError(_not_a_source(source, path))


# `org/name`, as the Hugging Face hub names a model
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _not_a_source(source: str, path: Path) -> str:
    """Why `source` is none of the three kinds, with the likely intent: a hub id, or a misspelled preset."""
    if HUB_ID.fullmatch(source) and path.suffix != ".gguf" and not path.exists():
        name = source.split("/")[1]
        return (f"{source} is no path here, and kiln does not download models: fetch them from the Hugging "
                f"Face hub with `hf download {source} --local-dir models/{name}`, then "
                f"`kiln build models/{name} --out engines/{name}` (or build from a .gguf file)")
    close = difflib.get_close_matches(source, presets.PRESETS, n=1)
    return (f"{source!r} is neither a preset ({', '.join(presets.PRESETS)}), a .gguf file, "
            "nor a folder with config.json" + (f"; did you mean {close[0]!r}?" if close else ""))


def _load_preset(files: presets.PresetFiles) -> ModelSource:
    src = load_gguf(files.path) if files.path.suffix == ".gguf" else load_hf_folder(files.path)
    src.description = files.description or src.description
    if files.keepalive is not None:
        src._keepalive.append(files.keepalive)
    return src


def load_hf_folder(path: Path) -> ModelSource:
    """An HF folder: bf16/fp16/fp32 safetensors, one file or sharded; checked before it is read."""
    from kiln.compiler.export.checkpoint import load_tensors
    from kiln.compiler.export.families import expected_shapes, family_for, split_fused

    check_links_stay_inside(path)
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    spec = spec_from_hf_config(cfg)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: kiln needs a fast tokenizer")
    fused = family_for(cfg["model_type"]).fused_projections
    weights = load_tensors(path, expected_shapes(spec, fused))
    if fused:
        split_fused(weights, spec)
    return ModelSource(f"HF folder {path}", spec, weights, path, hf_dir=path, end_token_ids=_generation_eos(path))


def check_links_stay_inside(path: Path) -> None:
    """Refuse a symlink in the folder that resolves outside it: a build reads and copies what the
    folder names, so a link must not bring in (or publish into an artifact) a file from elsewhere.
    NOTE: a Hugging Face cache snapshot (.../models--org--name/snapshots/REV/) links every file to
    ../../blobs/; links may resolve anywhere inside that model's cache folder."""
    from kiln.compiler.export.checkpoint import CheckpointError

    root = path.resolve()
    allowed = root.parent.parent if root.parent.name == "snapshots" else root
    for entry in sorted(path.iterdir()):
        if not entry.is_symlink():
            continue
        target = entry.resolve()
        if not target.is_relative_to(allowed):
            raise CheckpointError(f"{entry.name} in {path} is a link to {target}, outside the checkpoint "
                                  "folder; kiln does not follow links out of a source folder (copy the file in)")


# --- GGUF -----------------------------------------------------------------------------------

def load_gguf(path: Path) -> ModelSource:
    """A GGUF file as llama.cpp publishes it: metadata first (an unknown architecture is refused the
    moment it is read), every tensor checked against it, then weights dequantized one at a time as
    the exporter pulls them (kiln.compiler.export.gguf_weights)."""
    from kiln.compiler.export import gguf_config, gguf_tokenizer, gguf_weights
    from kiln.compiler.export.gguf_reader import GGUFFile

    f = GGUFFile(path, gguf_config.check_architecture)
    arch, cfg = gguf_config.hf_config(f)
    spec = spec_from_hf_config(cfg)
    weights = gguf_weights.lazy_weights(f, arch, spec)
    tmp = tempfile.TemporaryDirectory(prefix="kiln-gguf-tok-")
    gguf_tokenizer.save_tokenizer(f, cfg["model_type"], Path(tmp.name))
    ends = tuple(f.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if f.get(k) is not None)
    src = ModelSource(f"GGUF {path}", spec, weights, Path(tmp.name), end_token_ids=ends)
    src._keepalive += [tmp, f]
    return src


def _generation_eos(path: Path) -> tuple[int, ...]:
    """generation_config.json's eos ids (one or a list): instruct models list their end-of-turn token there."""
    f = path / "generation_config.json"
    if not f.is_file():
        return ()
    try:
        eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(int(i) for i in ids if isinstance(i, int))
