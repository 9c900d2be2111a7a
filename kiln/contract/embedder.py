"""The semantic cache's embedding-model folder: what the export writes (kiln/compiler/export/embedder.py)
and the server's embedder reads (kiln/serving/cache/embedder.py).

    DIR/model.onnx       input_ids, attention_mask, token_type_ids [batch, seq] int64
                           -> embedding [batch, 384] float32: mean-pooled over the attention
                              mask and L2-normalised in the graph (what sentence-transformers
                              computes), so a dot product is the cosine
    DIR/tokenizer.json   the model's own WordPiece tokenizer

The default folder holds all-MiniLM-L6-v2 under the user's cache directory.
"""

from __future__ import annotations

import os
from pathlib import Path

MODEL_NAME = "all-MiniLM-L6-v2"
MODEL_FILE, TOKENIZER_FILE = "model.onnx", "tokenizer.json"


class EmbedderError(ValueError):
    """The embedding model is missing or unusable (a configuration error: kiln serve stops)."""


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kiln" / "embedders" / MODEL_NAME


def is_exported(folder: Path) -> bool:
    return (Path(folder) / MODEL_FILE).is_file() and (Path(folder) / TOKENIZER_FILE).is_file()
