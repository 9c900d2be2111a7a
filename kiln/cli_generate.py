"""`kiln generate`: prompts from flags or a JSONL file, run as one in-flight batch."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import click


def read_prompt_file(path: Path) -> list[dict]:
    """Each line: a JSON string (a prompt), or an object with "prompt" or "messages"."""
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        item = {"prompt": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or not ({"prompt", "messages"} & item.keys()):
            raise click.BadParameter(f"{path}:{n}: expected a string or an object with prompt/messages")
        items.append(item)
    return items


def collect_prompts(llm, prompts, chats, prompt_file) -> list:
    items = [{"prompt": p} for p in prompts] + [{"messages": [{"role": "user", "content": c}]} for c in chats]
    if prompt_file:
        items += read_prompt_file(prompt_file)
    if not items:
        raise click.UsageError("give --prompt, --chat or --prompt-file")
    return [llm.chat_prompt(i["messages"]) if "messages" in i else i["prompt"] for i in items]


def print_results(outputs, as_json: bool, seconds: float, llm) -> None:
    for o in outputs:
        if as_json:
            click.echo(json.dumps({
                "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                "prompt_tokens": len(o.prompt_token_ids), "cached_tokens": o.num_cached_tokens,
                "metrics": {k: v for k, v in asdict(o.metrics).items() if k != "inter_token_latencies"}}))
        else:
            click.echo(o.text)
            click.echo("-" * 40)
    generated = sum(len(o.token_ids) for o in outputs)
    click.echo(f"{len(outputs)} requests, {generated} tokens in {seconds:.2f} s "
               f"({generated / seconds:.1f} tok/s); padding {llm.core.runner.stats.padding_fraction:.1%}", err=True)


def run_generate(llm, prompt_list, params, as_json: bool) -> None:
    t0 = time.perf_counter()
    outputs = llm.generate(prompt_list, params)
    print_results(outputs, as_json, time.perf_counter() - t0, llm)
