"""llama.cpp as a peer, on the very GGUF file kiln builds from: its C API through llama-cpp-python.

Runs in the environment bench/setup_llamacpp.sh makes (compiled for this CPU), so this module
imports nothing from kiln. The runner is llama.cpp's batched-generation loop (its `batched`
example): every prompt is a sequence of one context; a step decodes one token of each live
sequence in one llama_decode; llama.cpp's own greedy sampler picks the tokens. The context keeps
each sequence's KV apart (not unified), as many sequences as the widest workload.

    python -m bench.peer_llamacpp quantize IN.gguf OUT.gguf Q4_K_M   # llama-quantize's recipe
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

from bench.peers import Run

FTYPES = {"Q4_K_M": 15, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3}      # llama_ftype


def _llama():
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)          # errors only: llama.cpp logs every tensor it loads
    llama_cpp.llama_backend_init()
    return llama_cpp


class LlamaCppRunner:
    def __init__(self, gguf: Path, threads: int, max_seqs: int, ctx_per_seq: int, label: str = ""):
        L = self.L = _llama()
        self.name = f"llama.cpp {label}".strip()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = L.llama_context_default_params()
        params.n_seq_max, params.n_ctx = max_seqs, max_seqs * ctx_per_seq
        params.n_batch = params.n_ubatch = 512
        # NOTE: the same thread count as kiln and the other peers, prefill and decode alike.
        params.n_threads = params.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = params.n_batch
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.sampler = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(self.sampler, L.llama_sampler_init_greedy())

    def generate(self, prompts: list[list[int]], n: int) -> Run:
        self._clear()
        t0 = time.perf_counter()
        tokens = self._prefill(prompts)
        first = time.perf_counter() - t0
        positions = [len(p) for p in prompts]
        for _ in range(n - 1):
            self._fill([(t[-1], pos, s, True) for s, (t, pos) in enumerate(zip(tokens, positions))])
            self._decode()
            for s in range(len(prompts)):
                tokens[s].append(self._sample(s))
                positions[s] += 1
        return Run(first, time.perf_counter() - t0, tokens)

    def _prefill(self, prompts: list[list[int]]) -> list[list[int]]:
        """Every prompt packed into batches of n_batch tokens; a prompt's first token is sampled
        right after the decode that holds its last position (the next decode overwrites logits)."""
        rows = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        tokens: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(rows), self.n_batch):
            chunk = rows[start:start + self.n_batch]
            self._fill(chunk)
            self._decode()
            for i, (_, _, s, last) in enumerate(chunk):
                if last:
                    tokens[s].append(self._sample(i))
        return tokens

    def _fill(self, rows) -> None:
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)

    def _decode(self) -> None:
        rc = self.L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _sample(self, index: int) -> int:
        return int(self.L.llama_sampler_sample(self.sampler, self.ctx, index))

    def _clear(self) -> None:
        """Every sequence's KV dropped: each repetition starts cold, as the other systems' do."""
        L = self.L
        if hasattr(L, "llama_memory_clear"):
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        else:
            L.llama_kv_self_clear(self.ctx)


def quantize(src: Path, dst: Path, recipe: str, threads: int = 2) -> None:
    """llama-quantize's recipe for `recipe` (its per-tensor mix, e.g. Q6_K for the output matrix)."""
    L = _llama()
    params = L.llama_model_quantize_default_params()
    params.ftype, params.nthread = FTYPES[recipe], threads
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="llama.cpp's own quantizer, as bench_gguf_peers.py runs it")
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="llama-quantize's recipe: IN.gguf to OUT.gguf")
    q.add_argument("src", type=Path)
    q.add_argument("dst", type=Path)
    q.add_argument("recipe", choices=sorted(FTYPES))
    args = ap.parse_args(argv)
    quantize(args.src, args.dst, args.recipe)


if __name__ == "__main__":
    main()
