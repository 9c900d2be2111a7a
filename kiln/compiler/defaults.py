"""`--backend auto` and `--quant auto`: the fastest correct engine for this machine and this model.

The rules follow the side-by-side measurements (docs/benchmarks.md, `python -m bench.bench_runtime`):
- int8 weights unless the model is too small to gain: below SMALL_MODEL_PARAMS the weights are a few
  MB, a step is dispatch-bound, and quantizing only costs accuracy (and build time);
- OpenVINO on x86 CPUs where openvino is installed (a kiln dependency) and the model is covered (its
  native paged attention, or kiln's paged gather where that cannot compute the model's attention),
  for the modes where it measured fastest (int8: TTFT and batched decodes, well ahead of the ort
  backend at 32 streams; Gemma 2 through the gather too, in TTFT and at 32 streams:
  docs/results/2026-12-02-gemma-2-on-the-openvino-backend.md); ONNX Runtime
  otherwise (int4 one stream: ort's MatMulNBits beat OpenVINO reading the same 4-bit blocks; fp32
  and w8a8: ort's graph).
- except int8 on an AVX2 CPU with neither AVX-512 nor VNNI, where kiln's op library is built: there
  OpenVINO's int8 weights run as f32 FMAs, and ort's kiln.MatMulQ8 with int16 activations (pmaddwd,
  twice an FMA's products) measured faster at one stream and at 32, TTFT level (SmolLM2 on an AVX2
  EPYC: docs/results/2026-12-02-default-builds-side-by-side-with-peers.md).
- f16 weights on OpenVINO wherever it can run the model: the ort backend does not build them.
- on ort, the attention core: kiln's PagedAttention op (reads the KV pool in place) where kiln's op
  library is built and the KV cache is fp32; the standard core (a paged gather in the graph) otherwise.
Each choice carries its reason; the build prints it and the manifest records it. The rules are pure:
the machine comes in as a BuildHost (kiln.compiler.plan), so a test can ask them about any CPU.
"""

from __future__ import annotations

from kiln.compiler.plan import BuildHost, Choice
from kiln.contract.model_spec import ModelSpec
from kiln.contract.quant import QuantMode
from kiln.engines.ort import native as ort_native

AUTO = "auto"
SMALL_MODEL_PARAMS = 20_000_000
OPENVINO_FASTEST_FOR = (QuantMode.INT8,)
# Modes the openvino backend alone builds on a CPU (kiln.contract.backends says why ort does not).
OPENVINO_ONLY = (QuantMode.F16,)

__all__ = ["AUTO", "Choice", "choose_quant", "choose_backend", "choose_attention", "openvino_blocker",
           "kiln_int8_is_faster_here", "openvino_int8_runs_kiln_linears", "parameter_count"]


def choose_quant(requested: QuantMode | None, spec: ModelSpec, backend_modes: tuple[str, ...] = ()) -> Choice:
    """backend_modes: the quant modes of a backend the user named (() for --backend auto)."""
    if requested is not None:
        return Choice(requested.value, "user", "--quant " + requested.value)
    params = parameter_count(spec)
    if backend_modes and QuantMode.INT8.value not in backend_modes:
        return Choice(QuantMode.NONE.value, AUTO, "the backend has no int8 weight mode, so unquantized weights "
                      f"(it builds --quant {' | '.join(backend_modes)})")
    if params < SMALL_MODEL_PARAMS:
        return Choice(QuantMode.NONE.value, AUTO, f"{params / 1e6:.1f} M parameters: too small to gain from "
                      "quantized weights, so fp32")
    return Choice(QuantMode.INT8.value, AUTO, f"{params / 1e6:.0f} M parameters: int8 weights (accuracy within "
                  "the build's check, a quarter of fp32's bytes per token)")


def choose_backend(requested: str, quant: QuantMode, spec: ModelSpec, host: BuildHost,
                   ort_options: tuple[str, ...] = ()) -> Choice:
    """ort_options: the ort-only build options the user set (they narrow auto to the ort backend)."""
    if requested != AUTO:
        return Choice(requested, "user", "--backend " + requested)
    if ort_options:
        return Choice("ort", AUTO, "ONNX Runtime: " + ", ".join(f"--{o.replace('_', '-')}" for o in ort_options)
                      + " is an ort backend option")
    blocker = openvino_blocker(quant, spec, host)
    if blocker:
        return Choice("ort", AUTO, f"ONNX Runtime: {blocker}")
    if quant is QuantMode.INT8 and openvino_int8_runs_kiln_linears(host):
        from kiln.engines.openvino import native

        return Choice("openvino", AUTO, "OpenVINO with kiln's int8 linears (activations smoothed and quantized "
                      f"per row, {native.kernel_instructions(host.cpu.flags or frozenset())}): the fastest int8 "
                      f"engine on this {host.cpu.machine} CPU")
    if quant in OPENVINO_ONLY:
        return Choice("openvino", AUTO, f"OpenVINO: the CPU backend that builds {quant.value} weights")
    return Choice("openvino", AUTO, f"OpenVINO: the fastest {quant.value} engine on this {host.cpu.machine} CPU"
                  + _library_missing_note(quant, host))


def _library_missing_note(quant: QuantMode, host: BuildHost) -> str:
    """Said after an auto backend reason when one of kiln's op libraries, had it been built here, would
    have changed the choice: "" otherwise. A default that moved for a missing library says so."""
    from dataclasses import replace

    from kiln.engines.openvino import native as ov_native

    if quant is not QuantMode.INT8:
        return ""
    if not host.ort_ops and kiln_int8_is_faster_here(replace(host, ort_ops=True)):
        return (f" while kiln's op library is not built here (`{ort_native.BUILD_COMMAND}` builds it; with it, "
                "ort's kiln.MatMulQ8 is faster on this AVX2 CPU without AVX-512 or VNNI)")
    if not host.openvino_ops and openvino_int8_runs_kiln_linears(replace(host, openvino_ops=True)):
        return (f", on the plugin's own linears: kiln's OpenVINO op library is not built here "
                f"(`{ov_native.BUILD_COMMAND}` builds it, and this CPU then runs kiln's faster "
                "int8 linears)")
    return ""


def openvino_blocker(quant: QuantMode, spec: ModelSpec, host: BuildHost) -> str:
    """Why the openvino backend is not the auto choice here; "" when it is."""
    if not host.cpu.x86:
        return f"OpenVINO's CPU paged attention is chosen only on x86 (this is {host.cpu.machine})"
    if not host.openvino:
        return "openvino is not installed (it comes with `pip install kiln`)"
    if quant not in OPENVINO_FASTEST_FOR + OPENVINO_ONLY:
        return (f"kiln picks openvino at {', '.join(m.value for m in OPENVINO_FASTEST_FOR)}, where it measured "
                f"fastest; {'fp32' if quant is QuantMode.NONE else quant.value} engines run on ort")
    from kiln.compiler.backends.openvino.coverage import uncovered

    missing = uncovered(spec)
    if missing:
        return f"the openvino backend does not cover {missing} yet"
    if quant is QuantMode.INT8 and kiln_int8_is_faster_here(host):
        return ("kiln's MatMulQ8 kernel (int16 activations) is the fastest int8 engine on a CPU with AVX2 but "
                "neither AVX-512 nor VNNI (OpenVINO runs int8 weights as f32 there)")
    return ""


def kiln_int8_is_faster_here(host: BuildHost) -> bool:
    """Whether this CPU is one where ort's int8 on kiln's op library beats OpenVINO's: AVX2 and FMA,
    no AVX-512 (OpenVINO's f32 FMAs would be twice as wide) and no VNNI (its int8 dot products)."""
    cpu = host.cpu
    return host.ort_ops and cpu.has("avx2", "fma") and not cpu.has("avx512f") and cpu.vnni is False


def openvino_int8_runs_kiln_linears(host: BuildHost) -> bool:
    """Whether an openvino int8 build here takes kiln's linears (kiln/engines/openvino/native): the
    library is built and the CPU runs its kernels (AVX-512 VNNI, and AMX tiles where it has them)."""
    from kiln.engines.openvino import native

    return host.openvino_ops and native.cpu_runs_kernels(host.cpu.flags or frozenset())


KILN_ATTENTION_ON_TILES = ("kiln's paged attention over its u8 cache (kiln.PagedAttentionU8) in place of the plugin's: "
                           "on this CPU's AMX tiles its prefill multiplies in bf16, and its decodes read each block "
                           "once per kv head; faster than the plugin's operation in both (docs/benchmarks.md)")
KILN_ATTENTION_ON_VNNI = ("kiln's paged attention over its u8 cache (kiln.PagedAttentionU8) in place of the plugin's: "
                          "on AVX-512 VNNI its decodes and prefill tokens multiply the cache's u8 codes in int8 and "
                          "read each block once per kv head; faster than the plugin's operation for batched decodes "
                          "over long contexts, as fast for a prefill (docs/benchmarks.md)")


def openvino_kiln_attention(host: BuildHost, spec: ModelSpec) -> str:
    """Why an openvino build here takes kiln's paged attention by default, or "" where it keeps the
    plugin's: kiln's op library is built and the model's heads fit it; on AMX tiles for bf16 its
    prefill runs on the tiles (heads a multiple of 32 values), elsewhere on AVX-512 VNNI its int8
    products over the u8 codes. Below VNNI its prefill would run on f32 vectors, slower than the
    plugin's. Greedy answers stay as close to fp32's as with the plugin's attention
    (bench/bench_greedy_fidelity.py, docs/benchmarks.md)."""
    from kiln.compiler.backends.openvino.coverage import attention_core
    from kiln.engines.openvino import kiln_attention, native

    if not host.openvino_ops or kiln_attention.supports(spec) or attention_core(spec)[0] == "paged-gather":
        return ""
    if host.cpu.has("amx_tile", "amx_bf16"):
        return KILN_ATTENTION_ON_TILES if spec.head_dim % 32 == 0 else ""
    return KILN_ATTENTION_ON_VNNI if native.cpu_runs_kernels(host.cpu.flags or frozenset()) else ""


def parameter_count(spec: ModelSpec) -> int:
    """Weights of the decoder: embeddings (+ an untied LM head) and per layer attention and MLP."""
    attn = spec.hidden_size * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
    mlp = 3 * spec.hidden_size * spec.intermediate_size
    head = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return head + spec.num_layers * (attn + mlp)


def choose_attention(requested: str, backend: str, kv_dtype: str, host: BuildHost, spec: ModelSpec | None = None) -> Choice:
    """The ort backend's attention core; other backends have their own (the choice says which)."""
    if requested != AUTO:
        return Choice(requested, "user", "--attention " + requested)
    if backend == "openvino" and spec is not None:
        from kiln.compiler.backends.openvino.coverage import attention_core

        return Choice(AUTO, AUTO, attention_core(spec)[1])
    if backend != "ort":
        return Choice(AUTO, AUTO, f"the {backend} backend has its own paged attention")
    if not host.ort_ops:
        return Choice("standard", AUTO, "the standard core (paged gather in the graph): kiln's op library is "
                      f"not built here (`{ort_native.BUILD_COMMAND}`)")
    if kv_dtype != "float32":
        return Choice("standard", AUTO, f"the standard core: kiln's PagedAttention reads an fp32 KV cache, not {kv_dtype}")
    return Choice("native", AUTO, "kiln's PagedAttention: reads the KV cache in place (no gather), any batch")
