// The artifact card: /console/api/card as two tables (the artifact, the build's passes).
"use strict";

function table(rows, header) {
  const t = document.createElement("table");
  if (header) t.append(row(header, "th"));
  for (const r of rows) t.append(row(r, "td"));
  return t;
}

function row(cells, tag) {
  const tr = document.createElement("tr");
  for (const cell of cells) tr.append(Object.assign(document.createElement(tag), { textContent: cell }));
  return tr;
}

function renderCard(card) {
  $("model-name").textContent = card.model;
  document.title = `kiln · ${card.model}`;
  const a = card.architecture, q = card.quantization, kv = card.kv;
  const settings = Object.entries(q.settings).map(([k, v]) => `${k}=${v}`).join(", ");
  const check = q.check ? `${q.check.perplexity.toFixed(3)} (fp32 ${q.check.perplexity_fp32.toFixed(3)}, ` +
    `top-1 agreement ${q.check.top1_agreement.toFixed(3)})` : "not measured";
  const summary = table([
    ["model", card.model],
    ["architecture", `${a.family}: ${a.layers} layers, hidden ${a.hidden}, ${a.heads} heads (${a.kv_heads} KV), vocab ${a.vocab}`],
    ["source", card.source],
    ["quantization", settings ? `${q.mode} (${settings})` : q.mode],
    ["perplexity", check],
    ["buckets", `batch [${card.buckets.batch_sizes.join(", ")}] × seq [${card.buckets.seq_lens.join(", ")}]`],
    ["KV layout", `${kv.layers} layers × ${kv.kv_heads} KV heads × head_dim ${kv.head_dim}, blocks of ${kv.block_size} tokens, ${kv.dtype}`],
    ["KV capacity", `${kv.blocks.toLocaleString()} blocks = ${kv.tokens.toLocaleString()} tokens = ` +
                    `${kv.sequences.toLocaleString()} sequences at context ${kv.context_len} (${formatBytes(kv.bytes)})`],
    ["max context", String(card.max_model_len)],
    ["engines", card.engines.map(e => `${e.backend}: ${e.file} (${formatBytes(e.bytes)})`).join("; ")],
    ["toolchain", Object.entries(card.versions).map(([k, v]) => `${k} ${v}`).join(", ")],
  ]);
  const passes = table(card.passes.map(p => [p.name, p.nodes_before, p.nodes_after, p.seconds.toFixed(2),
                                             scientific(p.max_abs_error), scientific(p.max_rel_error)]),
                       ["pass", "nodes before", "nodes after", "seconds", "max abs err", "max rel err"]);
  passes.id = "passes";
  $("card").replaceChildren(summary, Object.assign(document.createElement("h3"), { textContent: "Build passes" }), passes);
}

function scientific(x) { return x === null || x === undefined ? "-" : x.toExponential(2); }
