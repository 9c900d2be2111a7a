"""The long-short figure in the README: running streams' inter-token gaps that overlap a long
prompt's prefill (its arrival to its first token) against all their other gaps, per level.

    kiln bench --url URL --tokenizer ART --workload long-short --concurrency 4,8 --duration 30 --json ls.json
    python bench/long_short_itl.py ls.json

NOTE: the bench's levels share their first requests, so a later level's long prompts may hit the
prefix cache (a long prompt TTFT far below the earlier level's says so); one server per level
avoids that.
"""

from __future__ import annotations

import json
import sys

import numpy as np

LONG_PROMPT_TOKENS = 900        # long-short's long prompts are 920-1,230 tokens at --max-model-len 1536


def split_gaps(requests: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """(gaps during a long prefill, other gaps, long prompts' TTFTs), seconds."""
    done = [r for r in requests if r["outcome"] == "ok" and r["ttft"] is not None]
    longs = [(r["start"], r["start"] + r["ttft"]) for r in done if r["prompt_tokens"] >= LONG_PROMPT_TOKENS]
    during, other = [], []
    for r in done:
        if r["prompt_tokens"] >= LONG_PROMPT_TOKENS:
            continue
        t = r["start"] + r["ttft"]
        for gap in r["itls"]:
            begin, t = t, t + gap
            (during if any(begin < end and t > start for start, end in longs) else other).append(gap)
    return during, other, [end - start for start, end in longs]


def main(path: str) -> None:
    for level in json.load(open(path))["runs"][0]["levels"]:
        during, other, ttfts = split_gaps(level["requests"])
        if not (during and other):
            print(f"{level['label']}: no gaps overlap a long prefill")
            continue
        ms = lambda xs, q: 1000 * float(np.percentile(xs, q))
        print(f"{level['label']}: {len(ttfts)} long prompts (TTFT p50 {np.median(ttfts):.2f} s); ITL during / "
              f"otherwise p50 {ms(during, 50):.0f} / {ms(other, 50):.0f} ms, p99 {ms(during, 99):.0f} / "
              f"{ms(other, 99):.0f} ms ({ms(during, 99) / ms(other, 99):.2f}x); {len(during)} / {len(other)} gaps")


if __name__ == "__main__":
    main(sys.argv[1])
