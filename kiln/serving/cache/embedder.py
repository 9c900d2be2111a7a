"""A sentence embedder on ONNX Runtime, for the semantic response cache: text -> a unit vector, so
that a dot product between two embeddings is their cosine similarity.

The model folder holds model.onnx (pooled and normalised in the graph) and tokenizer.json
(kiln/contract/embedder.py), as kiln/compiler/export/embedder.py writes them. The session runs
on one thread: the engine owns the cores, and one short question embeds in a few milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.contract.embedder import MODEL_FILE, TOKENIZER_FILE, EmbedderError, is_exported

MAX_TOKENS = 128        # all-MiniLM-L6-v2 was trained on 128-token inputs; longer texts get no embedding


class Embedder:
    def __init__(self, folder: Path, threads: int = 1):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        folder = Path(folder)
        model, tokenizer = folder / MODEL_FILE, folder / TOKENIZER_FILE
        if not is_exported(folder):
            raise EmbedderError(f"{folder} holds no embedding model (model.onnx and tokenizer.json); "
                                f"make one with: python -m kiln.compiler.export.embedder {folder}")
        self.folder = folder
        self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding()
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = threads
        self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self.session.get_inputs()}
        self.dim = int(self.embed(["probe"]).shape[1])

    def embed_whole(self, text: str) -> np.ndarray | None:
        """The text's embedding, or None when it is longer than the MAX_TOKENS the model reads:
        an embedding of its head alone would match any text with the same head (a long fixed
        preamble before two different questions), so such a text has none."""
        if self.tokenizer.encode(text).overflowing:
            return None
        return self.embed([text])[0]

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, each row of unit length."""
        encodings = self.tokenizer.encode_batch(list(texts))
        feeds = {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                 "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                 "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64)}
        (out,) = self.session.run(["embedding"], {k: v for k, v in feeds.items() if k in self._inputs})
        return out.astype(np.float32, copy=False)
