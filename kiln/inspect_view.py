"""`kiln inspect`: the manifest as readable rich tables."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Group
from rich.markup import escape
from rich.table import Table

from kiln.config import AUTO_BATCH_FLOOR
from kiln.config_options import runtime_config
from kiln.contract.artifact import EngineArtifact
from kiln.runtime.memory import KvPlan, plan_kv_blocks
from kiln.units import format_bytes


def render_manifest(art: EngineArtifact, context_len: int | None = None, memory_bytes: int | None = None) -> Group:
    """context_len, memory_bytes: the capacity line's (None: what `kiln serve` sizes by default)."""
    plan = art.manifest.plan
    tables = [_plan(plan)] + ([_ladder(plan["ladder"])] if plan.get("ladder") else []) if plan else []
    return Group(_summary(art, context_len, memory_bytes), *tables, _passes(art), _files(art))


def serve_kv_plan(art: EngineArtifact, context_len: int | None = None, memory_bytes: int | None = None) -> KvPlan:
    """The KV pool `kiln serve` sizes for this artifact, by the runtime's own function and defaults:
    a share of this machine's available memory, sequences of the artifact's longest context."""
    config = runtime_config()
    if memory_bytes is not None:
        config = replace(config, kv_cache_memory=memory_bytes)
    longest = min(config.scheduler.max_model_len, art.manifest.generation["max_model_len"])
    return plan_kv_blocks(art.manifest.kv_layout, config, context_len or longest)


def _summary(art: EngineArtifact, context_len: int | None, memory_bytes: int | None) -> Table:
    m, kv = art.manifest, art.manifest.kv_layout
    s = m.spec
    t = Table(title=f"kiln artifact {art.path}", show_header=False)
    rows = [
        ("schema", f"v{m.schema_version}"),
        ("model", f"{s.family}: {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads "
                  f"({s.num_kv_heads} KV), vocab {s.vocab_size}"),
        ("config hash", m.spec.config_hash()),
        ("source", m.source),
        ("quantization", _quant_line(m.quant)),
        *(("chosen " + what, _choice_line(m.choices[what])) for what in ("backend", "quant", "attention") if what in m.choices),
        ("perplexity", _perplexity_line(m.quant)),
        ("buckets", f"batch {list(m.buckets.batch_sizes)} × seq {list(m.buckets.seq_lens)}"),
        ("KV layout", f"[layers {kv.num_layers}, k/v, kv_heads {kv.num_kv_heads}, blocks, "
                      f"{kv.block_size}, head_dim {kv.head_dim}] {kv.dtype}"),
        ("KV bytes / token", f"{kv.bytes_per_token:,} ({format_bytes(kv.bytes_per_token)})"),
        ("capacity", _capacity_line(art, context_len, memory_bytes)),
        ("batch", _batch_line(m.buckets.max_batch)),
        ("max context", str(m.generation.get("max_model_len"))),
        ("eos token ids", str(m.generation.get("eos_token_ids"))),
        ("toolchain", _toolchain_line(m)),
    ]
    for k, v in rows:
        t.add_row(k, escape(v))
    return t


def _choice_line(choice: dict) -> str:
    return f"{choice['value']} ({choice['chosen_by']}: {choice['reason']})"


# Engine records name the toolchain their engine was compiled with (the loader refuses another release).
ENGINE_TOOLCHAINS = ("openvino", "tensorrt")


def _toolchain_line(m) -> str:
    versions = dict(m.versions)
    for record in m.engines:
        versions.update({k: record[k] for k in ENGINE_TOOLCHAINS if k in record})
    return ", ".join(f"{k} {v}" for k, v in versions.items())


_CHECK_KEYS = ("check_text", "check_tokens", "top1_agreement", "min_top1_agreement", "perplexity", "perplexity_fp32",
               "perplexity_increase", "max_perplexity_increase", "max_rel_logit_error")


def _quant_line(q: dict) -> str:
    extras = ", ".join(f"{k}={v}" for k, v in q.items()
                       if k != "mode" and k not in _CHECK_KEYS and not isinstance(v, (dict, list)))
    return f"{q.get('mode')}" + (f" ({extras})" if extras else "")


def _perplexity_line(q: dict) -> str:
    """The build's quantize check: perplexity of this quant mode and of fp32 on the same text, and
    top-1 agreement, per text (the plain check text, and chat in the model's template)."""
    if "perplexity" not in q:
        return "not measured (built without checks, or by an older kiln)"
    bound = f", at most {q['max_perplexity_increase']:+.0%}" if "max_perplexity_increase" in q else ""
    line = (f"{_text_figures(q)} over {q['check_tokens']} tokens of {q['check_text']}; "
            f"top-1 agreement with fp32 {q['top1_agreement']:.3f} (build minimum {q['min_top1_agreement']:.2f}{bound})")
    if "chat" in q:
        c = q["chat"]
        line += f"; chat: {_text_figures(c)} over {c['tokens']} tokens, top-1 {c['top1_agreement']:.3f}"
    if "max_rel_logit_error" in q:
        line += f"; max relative logit error {q['max_rel_logit_error']:.3g} (reported, not a gate)"
    return line


def _text_figures(f: dict) -> str:
    delta = f["perplexity"] / f["perplexity_fp32"] - 1
    return f"{f['perplexity']:.3f} (fp32 {f['perplexity_fp32']:.3f}, {delta:+.2%})"


def _capacity_line(art: EngineArtifact, context_len: int | None, memory_bytes: int | None) -> str:
    plan = serve_kv_plan(art, context_len, memory_bytes)
    default = memory_bytes is None and context_len is None
    return plan.describe() + (" — what `kiln serve` sizes here by default" if default else "")


def _batch_line(max_batch: int) -> str:
    """The serving default (max_num_seqs auto), as the scheduler applies it."""
    floor = min(AUTO_BATCH_FLOOR, max_batch)
    if max_batch <= floor:
        return f"up to {max_batch} sequences at once (the largest batch bucket), while the KV pool has blocks"
    return (f"up to {max_batch} sequences at once (the largest batch bucket) while the KV pool has blocks; "
            f"past {floor}, only while a decode step of one more is predicted within --target-itl")


def _plan(plan: dict) -> Table:
    """The build plan (kiln/compiler/plan.py), each choice with its reason; read from the manifest's
    dict so that inspecting needs none of the build code."""
    t = Table(title=f"build plan ({plan.get('rung', 'primary')})")
    for col in ("what", "choice", "why"):
        t.add_column(col)
    for what in ("backend", "quant", "attention", "kv_dtype"):
        c = plan[what]
        t.add_row(what.replace("_", " "), f"{c['value']} ({c['chosen_by']})", escape(c["reason"]))
    for f in plan["fusions"]:
        state = ("on" + (f" without {', '.join(f['without'])}" if f["without"] else "")) if f["applies"] else "off"
        t.add_row(f"fusion {f['name']}", state, escape(f["reason"]))
    _recipe_rows(t, "weights", plan["recipe"])
    if plan.get("prefill_recipe"):
        _recipe_rows(t, "prefill engine weights", plan["prefill_recipe"])
    host = plan["host"]
    libraries = [name for name, key in (("ort ops", "ort_ops"), ("openvino ops", "openvino_ops")) if host[key]]
    t.add_row("build host", f"{host['machine']} {host['cpu_class']}", "kiln libraries built: "
              + (", ".join(libraries) or "none"))
    return t


def _recipe_rows(t: Table, title: str, recipe: dict) -> None:
    compute = f", {recipe['compute']} compute" if recipe.get("compute") else ""
    t.add_row(title, f"{recipe['mode']} by {recipe['applied_by']}{compute}", escape(recipe.get("note", "")))
    for r in recipe["roles"]:
        t.add_row(f"  {r['role']}", escape(kernel_label(r["kernel"])), escape(r["reason"]))


def kernel_label(k: dict) -> str:
    """A recipe's kernel (kiln.compiler.plan.Kernel, as a dict) in one line."""
    parts = [f"{k['bits']}-bit" if k["bits"] < 32 else "", f"blocks of {k['block_size']}" if k["block_size"] else "",
             k["rounding"], k["weights"], f"{k['activations']} activations" if k["activations"] else "",
             f"|w| <= {k['weight_range']}" if k["weight_range"] else "", "the LM head's table" if k["shared"] else ""]
    extras = ", ".join(p for p in parts if p)
    return k["op"] + (f" ({extras})" if extras else "")


def _passes(art: EngineArtifact) -> Table:
    t = Table(title="passes")
    for col in ("pass", "nodes before", "nodes after", "seconds", "max abs err", "max rel err"):
        t.add_column(col, justify="right" if col != "pass" else "left")
    for r in art.manifest.passes:
        t.add_row(r["name"], str(r["nodes_before"]), str(r["nodes_after"]), f"{r['seconds']:.2f}",
                  _num(r.get("max_abs_error")), _num(r.get("max_rel_error")))
    return t


def _ladder(rungs: list[dict]) -> Table:
    """The rungs the build tried (kiln.compiler.resolve.fallbacks), each with its check's figures."""
    t = Table(title="rungs tried (the build's fallback ladder)")
    for col in ("rung", "engine", "check", "figures", "why it was left"):
        t.add_column(col)
    for r in rungs:
        t.add_row(escape(r["rung"]), f"{r['backend']} {r['quant']}", "passed: chosen" if r["passed"] else "failed",
                  escape(rung_figures(r["figures"])), escape(r["failure"]))
    return t


def rung_figures(f: dict) -> str:
    """A rung's check figures in one line: top-1 agreement and perplexity shift per text, the logit error."""
    parts = [f"{label}: top-1 {g['top1_agreement']:.3f}, perplexity {g['perplexity_increase']:+.2%}"
             for label, g in (("text", f), ("chat", f.get("chat") or {})) if "top1_agreement" in g]
    if "max_rel_logit_error" in f:
        parts.append(f"max rel logit error {f['max_rel_logit_error']:.3g} (reported)")
    return "; ".join(parts) or "-"


def _files(art: EngineArtifact) -> Table:
    """Every file in the artifact folder with its size; the engines' own records say which backend
    reads it and its checksum."""
    records = {}
    for e in art.manifest.engines:
        for r in [e, *(v for v in e.values() if isinstance(v, dict) and "sha256" in v)]:
            records[r["file"]] = (e["backend"], r["sha256"])
    records |= {name: ("", sha) for name, sha in art.manifest.tokenizer.get("files", {}).items()}
    t = Table(title="files")
    for col in ("file", "size", "engine", "sha256"):
        t.add_column(col)
    files = sorted(p for p in art.path.rglob("*") if p.is_file())
    for path in files:
        name = str(path.relative_to(art.path))
        backend, sha = records.get(name, ("", ""))
        t.add_row(escape(name), format_bytes(path.stat().st_size), backend, sha[:16] + "…" if sha else "")
    t.add_row("total", format_bytes(sum(p.stat().st_size for p in files)), "", "")
    return t


def _num(x) -> str:
    return "-" if x is None else f"{x:.2e}"
