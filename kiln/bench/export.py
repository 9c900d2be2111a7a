"""A workload's requests written as a file another load generator replays, so that a third-party
tool and `kiln bench` send the same prompts with the same reply lengths: one JSON object per line,
{"text": ..., "output_length": N}, the single-turn format of NVIDIA's AIPerf
(`aiperf profile --input-file FILE --custom-dataset-type single_turn`).

The prompt text is cut to its token length with the model's own tokenizer (kiln bench's exact
counter), as `kiln bench --tokenizer` cuts it, so request i of the file is request i of the run.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from kiln.bench.target_http import DEFAULT_CONTEXT
from kiln.bench.text import TextSource, exact_counter, render
from kiln.bench.workloads import RequestSpec, request_specs

# Workload features a single-turn line has no field for: such requests would replay as something else.
_UNEXPORTABLE = {"prefix_tokens": "a shared system prompt", "cancel_after": "a client that hangs up",
                 "json_schema": "a JSON Schema response format", "give_up_after": "a client that gives up"}


def export_requests(path: Path, workload: str, seed: int, count: int, tokenizer: str,
                    max_tokens: int | None = None, context_len: int = DEFAULT_CONTEXT) -> int:
    """Writes the workload's first `count` requests to `path`; returns how many lines it wrote."""
    if count < 1:
        raise ValueError("--export-requests needs --max-requests N (N >= 1): how many requests to write")
    source = TextSource(exact_counter(tokenizer))
    lines = []
    for spec in itertools.islice(request_specs(workload, seed, context_len, max_tokens), count):
        _check_exportable(workload, spec)
        prompt = render(spec, source)
        lines.append(json.dumps({"text": prompt.user, "output_length": spec.max_tokens}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def _check_exportable(workload: str, spec: RequestSpec) -> None:
    for field, what in _UNEXPORTABLE.items():
        if getattr(spec, field):
            raise ValueError(f"workload {workload!r} has requests with {what}, which a single-turn line "
                             f"cannot carry; export chat, short, long-short or max-context")
