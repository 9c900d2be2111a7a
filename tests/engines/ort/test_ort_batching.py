"""How the ONNX Runtime engine turns a packed PagedBatch into padded bucket calls (no model)."""

from __future__ import annotations

import numpy as np

from kiln.contract.engine import BucketGrid, PagedBatch
from kiln.engines.ort.batching import group_by_length, plan_calls

BS = 4
GRID = BucketGrid(batch_sizes=(1, 2, 4, 8), seq_lens=(1, 4, 8, 16, 32))


def make_batch(query_lens, past_lens, logits_at=None) -> PagedBatch:
    ids, pos, slots, tables, wanted = [], [], [], [], []
    offset = 0
    for s, (n, p) in enumerate(zip(query_lens, past_lens)):
        table = np.arange(100 * s, 100 * s + -(-(p + n) // BS), dtype=np.int64)[::-1].copy()
        positions = np.arange(p, p + n)
        ids.append(1000 * s + positions)
        pos.append(positions)
        slots.append(table[positions // BS] * BS + positions % BS)
        tables.append(table)
        offset += n
        wanted += [offset - 1] if logits_at is None else [offset - n + k for k in logits_at[s]]
    return PagedBatch(np.concatenate(ids), np.concatenate(pos), np.asarray(query_lens), np.asarray(past_lens),
                      tables, np.concatenate(slots), np.asarray(wanted, np.int64))


def test_decodes_and_prefill_chunks_go_in_separate_calls():
    calls = plan_calls(make_batch([1, 9, 1, 7], [5, 0, 12, 3]), GRID, BS)
    assert [c.feeds["input_ids"].shape for c in calls] == [(2, 16), (2, 1)]
    decode = calls[1]
    assert decode.feeds["past_lens"].tolist() == [5, 12]
    assert decode.padded == 0


def test_padding_rows_are_empty_and_table_width_is_the_calls_longest_past():
    calls = plan_calls(make_batch([1, 1, 1], [3, 9, 0]), GRID, BS)
    (call,) = calls
    assert call.feeds["input_ids"].shape == (4, 1)                    # 3 rows padded to the bucket of 4
    assert call.feeds["block_tables"].shape == (4, 3)                 # ceil(9 / 4) blocks
    assert call.feeds["past_lens"].tolist() == [3, 9, 0, 0]
    assert call.feeds["block_tables"][3].tolist() == [0, 0, 0]        # the padding row reads nothing
    assert call.feeds["block_tables"][0].tolist()[:1] == [0]          # seq 0: its one past block (id 0)
    assert call.padded == 1


def test_chunks_of_very_different_lengths_are_not_padded_to_the_longest():
    lens = [30] + [2] * 6
    groups = group_by_length(np.asarray(lens))
    assert groups[0] == [0] and sorted(groups[1]) == [1, 2, 3, 4, 5, 6]


def test_several_logits_per_row_come_back_in_the_batchs_order():
    batch = make_batch([5, 3], [0, 4], logits_at=[[0, 2, 4], [2]])
    (call,) = plan_calls(batch, GRID, BS)
    assert call.feeds["logits_index"].tolist() == [[0, 2, 4], [2, 0, 0]]
    assert call.logit_rows.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]
    assert call.logit_order.tolist() == [0, 1, 2, 3]


def test_slots_follow_the_block_table():
    batch = make_batch([6], [2])
    (call,) = plan_calls(batch, GRID, BS)
    table = batch.block_tables[0]
    assert call.slots.tolist() == [table[p // BS] * BS + p % BS for p in range(2, 8)]
    assert call.rows.tolist() == [0] * 6 and call.cols.tolist() == list(range(6))
