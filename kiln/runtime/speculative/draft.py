"""Draft-model proposals (--speculative draft:PATH): a second, smaller kiln artifact with the
same tokenizer decodes k tokens greedily for each request; the target verifies them.

The draft runs its own engine over its own KV blocks: an engine owns the storage of its pool in
its own layout (layers, heads), so the draft's blocks come from a KV manager of its own, sized
to hold as many tokens as the target's. Each request's draft sequence mirrors the target's
committed tokens: before proposing, the draft keeps the KV of the longest prefix it computed
that the target committed (its accepted proposals), trims the rest, and catches up on the
tokens it has not seen in the same call that yields its first proposal. The draft decodes
greedily, so its proposals are point masses, which rejection sampling (verify.py) assumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.config import RuntimeConfig
from kiln.engines.load import load_engine
from kiln.runtime.kv_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.runner import paged_batch
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.step_io import ScheduledRequest

_PARAMS = SamplingParams(temperature=0)


@dataclass
class _DraftSequence:
    tokens: list[int] = field(default_factory=list)    # what the draft's KV was computed from, and its guesses
    computed: int = 0


class DraftProposer:
    def __init__(self, engine, kv: KVCacheManager):
        self.engine, self.kv = engine, kv
        self.block_size = engine.kv_layout.block_size
        self.max_chunk = engine.buckets.max_seq
        self.calls = 0
        self._sequences: dict[str, _DraftSequence] = {}

    @classmethod
    def load(cls, path: Path, target: EngineArtifact, runtime: RuntimeConfig, num_tokens: int) -> DraftProposer:
        """The draft artifact at `path`, with a KV pool holding num_tokens (the target's)."""
        draft = EngineArtifact.load(path)
        if draft.manifest.tokenizer.get("files") != target.manifest.tokenizer.get("files"):
            raise ArtifactError(f"{path}: the draft's tokenizer differs from the target's ({target.path}); "
                                "a draft must share the target's tokenizer")
        engine = load_engine(draft, runtime.threads)
        num_blocks = -(-num_tokens // engine.kv_layout.block_size)
        engine.allocate_kv(num_blocks)
        return cls(engine, KVCacheManager(num_blocks, engine.kv_layout.block_size, enable_caching=False))

    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        want = {r.request_id: k for r, k in requests}
        for request, _ in requests:
            self._sync(request)
        proposals: dict[str, list[int]] = {rid: [] for rid in want}
        active = list(want)
        while active:
            guesses = self._step(active)
            if guesses is None:
                break
            for rid, token in guesses.items():
                proposals[rid].append(token)
            active = [rid for rid in active if len(proposals[rid]) < want[rid]]
        return {rid: p for rid, p in proposals.items() if p}

    def forget(self, request_id: str) -> None:
        if self._sequences.pop(request_id, None) is not None:
            self.kv.free(_shadow(request_id, _DraftSequence()))

    def _sync(self, request: Request) -> None:
        """Keep the draft KV of the longest prefix the target committed; drop the rest."""
        seq = self._sequences.setdefault(request.request_id, _DraftSequence())
        committed = request.all_token_ids
        same = 0
        limit = min(seq.computed, len(committed) - 1)
        while same < limit and seq.tokens[same] == committed[same]:
            same += 1
        seq.tokens, seq.computed = list(committed), same
        self.kv.trim(_shadow(request.request_id, seq))

    def _step(self, request_ids: list[str]) -> dict[str, int] | None:
        """One draft engine call: each sequence's unseen tokens (up to a chunk), one guess each
        for those that reached their end. None: no sequence could be scheduled."""
        scheduled = []
        for rid in request_ids:
            seq = self._sequences[rid]
            n = min(len(seq.tokens) - seq.computed, self.max_chunk)
            shadow = _shadow(rid, seq)
            if self.kv.allocate_slots(shadow, n):      # else: no guess for it this step
                scheduled.append(ScheduledRequest(shadow, n))
        if not scheduled:
            return None
        result = self.engine.execute(paged_batch(scheduled, self.kv, self.block_size))
        self.calls += 1
        guesses, row = {}, 0
        for s in scheduled:
            seq = self._sequences[s.request.request_id]
            seq.computed += s.num_new_tokens
            if s.samples_token:
                token = int(result.logits[row].argmax())
                row += 1
                seq.tokens.append(token)
                guesses[s.request.request_id] = token
        return guesses


def _shadow(request_id: str, seq: _DraftSequence) -> Request:
    """The draft sequence as the KV manager and the batch packer see a request."""
    shadow = Request(request_id, seq.tokens or [0], _PARAMS)
    shadow.num_computed_tokens = seq.computed
    return shadow
