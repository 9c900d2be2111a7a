"""A PagedBatch as TensorRT calls: the ORT backend's bucketed [B, S] calls (same graph), each
given the optimization profile that covers it, split by rows where a prefill profile's batch
range is smaller than the call (its activations are capped at MAX_TOKENS), and run once per slice
of logits positions where the call reads more than the profiles plan for (perplexity reads every
position; serving reads the last token or the drafts)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.contract.engine import BucketGrid, PagedBatch
from kiln.engines.gpu.profiles import Profile, logits_positions, select_profile
from kiln.engines.ort.batching import OrtCall, plan_calls


@dataclass
class TrtCall:
    profile: int                       # index into the engine's optimization profiles
    call: OrtCall                      # feeds and token/logit bookkeeping, rows local to this call

    @property
    def shape(self) -> tuple[int, int]:
        return self.call.feeds["input_ids"].shape


def call_dims(feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """The graph's dynamic dimensions (passes/kv_io.py names them) for these feeds."""
    batch, seq = feeds["input_ids"].shape
    return {"batch": batch, "seq": seq, "max_blocks": feeds["block_tables"].shape[1],
            "logits_positions": feeds["logits_index"].shape[1]}


def plan_trt_calls(batch: PagedBatch, grid: BucketGrid, block_size: int, profiles: list[Profile]) -> list[TrtCall]:
    out = []
    positions = logits_positions(profiles)
    for call in plan_calls(batch, grid, block_size):
        for sliced in split_positions(call, positions):
            index, rows = select_profile(profiles, call_dims(sliced.feeds))
            out += [TrtCall(index, part) for part in split_rows(sliced, rows)]
    return out


def split_positions(call: OrtCall, positions: int) -> list[OrtCall]:
    """The call as calls reading at most `positions` logits per row. Each slice runs the same
    tokens again: their K/V go to the same slots with the same values (the graph reads the pool
    only below each sequence's past length), so only the work repeats."""
    width = call.feeds["logits_index"].shape[1]
    if width <= positions:
        return [call]
    parts = []
    for lo in range(0, width, positions):
        hi = min(lo + positions, width)
        wanted = (call.logit_rows[:, 1] >= lo) & (call.logit_rows[:, 1] < hi)
        feeds = {**call.feeds, "logits_index": call.feeds["logits_index"][:, lo:hi]}
        parts.append(OrtCall(feeds, call.rows, call.cols, call.slots, call.logit_rows[wanted] - [0, lo],
                             call.logit_order[wanted], call.padded, call.seqs))
    return parts


def split_rows(call: OrtCall, rows: int) -> list[OrtCall]:
    """The call as calls of at most `rows` batch rows; rows with no token are dropped at the end."""
    batch = call.feeds["input_ids"].shape[0]
    if batch <= rows:
        return [call]
    used = int(call.rows.max()) + 1 if len(call.rows) else 1
    parts = []
    for lo in range(0, used, rows):
        hi = min(lo + rows, used)
        tokens = (call.rows >= lo) & (call.rows < hi)
        logits = (call.logit_rows[:, 0] >= lo) & (call.logit_rows[:, 0] < hi)
        feeds = {k: v[lo:hi] for k, v in call.feeds.items()}
        parts.append(OrtCall(feeds, call.rows[tokens] - lo, call.cols[tokens], call.slots[tokens],
                             call.logit_rows[logits] - [lo, 0], call.logit_order[logits],
                             (hi - lo) * feeds["input_ids"].shape[1] - int(tokens.sum()), call.seqs[lo:hi]))
    return parts
