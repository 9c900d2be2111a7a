"""`kiln inspect`: the manifest as readable rich tables."""

from __future__ import annotations

from rich.console import Group
from rich.markup import escape
from rich.table import Table

from kiln.config import AUTO_BATCH_FLOOR
from kiln.contract.artifact import EngineArtifact
from kiln.units import format_bytes


def render_manifest(art: EngineArtifact, context_len: int, memory_bytes: int) -> Group:
    plan = [_plan(art.manifest.plan)] if art.manifest.plan else []
    return Group(_summary(art, context_len, memory_bytes), *plan, _passes(art), _files(art))


def _summary(art: EngineArtifact, context_len: int, memory_bytes: int) -> Table:
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
        ("capacity", _capacity_line(kv, context_len, memory_bytes)),
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


_CHECK_KEYS = ("check_text", "check_tokens", "top1_agreement", "min_top1_agreement", "perplexity", "perplexity_fp32")


def _quant_line(q: dict) -> str:
    extras = ", ".join(f"{k}={v}" for k, v in q.items()
                       if k != "mode" and k not in _CHECK_KEYS and not isinstance(v, (dict, list)))
    return f"{q.get('mode')}" + (f" ({extras})" if extras else "")


def _perplexity_line(q: dict) -> str:
    """The build's quantize check: perplexity of this quant mode and of fp32 on the same text."""
    if "perplexity" not in q:
        return "not measured (built without checks, or by an older kiln)"
    delta = q["perplexity"] / q["perplexity_fp32"] - 1
    return (f"{q['perplexity']:.3f} (fp32 {q['perplexity_fp32']:.3f}, {delta:+.2%}) over {q['check_tokens']} tokens "
            f"of {q['check_text']}; top-1 agreement with fp32 {q['top1_agreement']:.3f} "
            f"(build minimum {q['min_top1_agreement']:.2f})")


def _capacity_line(kv, context_len: int, memory_bytes: int) -> str:
    blocks = memory_bytes // kv.bytes_per_block
    per_seq = -(-context_len // kv.block_size)
    return (f"{format_bytes(memory_bytes)} of KV = {blocks:,} blocks = {blocks * kv.block_size:,} tokens "
            f"= {blocks // per_seq:,} sequences at context {context_len}")


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


def _files(art: EngineArtifact) -> Table:
    t = Table(title="engine files")
    for col in ("backend", "file", "size", "sha256"):
        t.add_column(col)
    for e in art.manifest.engines:
        t.add_row(e["backend"], e["file"], format_bytes(e["bytes"]), e["sha256"][:16] + "…")
    return t


def _num(x) -> str:
    return "-" if x is None else f"{x:.2e}"
