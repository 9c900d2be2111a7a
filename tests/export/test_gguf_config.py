"""llama.cpp's metadata keys -> kiln's spec, per architecture, from metadata-only GGUF files: what
llama.cpp states, what it hard-codes (Gemma's window pattern, local rope base, 27B attention scale)
and what kiln refuses up front."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gguf
from kiln.compiler.export.families import FAMILIES, spec_from_hf_config
from kiln.compiler.export.gguf_config import ARCHITECTURES, hf_config
from kiln.compiler.export.gguf_reader import GGUFError, GGUFFile
from kiln.compiler.export.gguf_weights import lazy_weights
from kiln.contract.model_spec import UnsupportedModelError


def metadata_file(tmp_path, arch: str, layers: int = 2, tensors=("token_embd.weight",), **kv):
    """A GGUF with `arch`'s shape keys (hidden 64, 4 heads of 32, 2 kv heads), `kv` on top
    (`{arch}.` prefixed; floats as f32, lists as arrays) and tiny F32 tensors."""
    w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    base = {"embedding_length": 64, "block_count": layers, "feed_forward_length": 128, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 32, "context_length": 1024,
            "attention.layer_norm_rms_epsilon": 1e-5}
    for key, value in (base | kv).items():
        name = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, (bool, list)):
            kind = gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.ARRAY
            w.add_key_value(name, value, kind)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_uint32(name, value)
    for name in tensors:
        w.add_tensor(name, np.zeros((300, 64) if name == "token_embd.weight" else (8,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(tmp_path / f"{arch}.gguf")


def spec_of(f: GGUFFile):
    return spec_from_hf_config(hf_config(f)[1])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_string_maps_to_a_family(tmp_path, arch):
    model_type = ARCHITECTURES[arch].model_type
    assert model_type in FAMILIES
    assert spec_of(metadata_file(tmp_path, arch)).family == FAMILIES[model_type].name


def test_f32_metadata_reads_as_its_shortest_decimal(tmp_path):
    spec = spec_of(metadata_file(tmp_path, "llama", **{"rope.freq_base": 500000.0}))
    assert spec.rms_norm_eps == 1e-5 and spec.rope_theta == 500000.0 and spec.head_dim == 32


@pytest.mark.parametrize("arch,layers,scalar", [("gemma3", 26, 32), ("gemma3", 62, 16), ("gemma2", 42, 32),
                                                ("gemma2", 46, 16)])
def test_gemma_query_scale_follows_llama_cpp(tmp_path, arch, layers, scalar):
    """head_dim, except for the 27B models (62 / 46 layers): hidden / heads."""
    assert spec_of(metadata_file(tmp_path, arch, layers)).query_pre_attn_scalar == scalar


def test_gemma_attention_scale_key_wins(tmp_path):
    spec = spec_of(metadata_file(tmp_path, "gemma3", 62, **{"attention.scale": 0.125}))
    assert spec.query_pre_attn_scalar == 64


def test_gemma3_window_pattern_rope_and_scaling(tmp_path):
    spec = spec_of(metadata_file(tmp_path, "gemma3", 7, **{"attention.sliding_window": 512, "rope.freq_base": 1e6,
                                                         "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert spec.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert spec.sliding_window == 512 and spec.local_rope_theta == 10000.0 and spec.rope_theta == 1e6
    assert spec.rope_type == "linear" and json.loads(spec.rope_scaling) == {"factor": 8.0}
    assert (spec.attn_softcap, spec.final_softcap) == (0.0, 0.0)


def test_gemma3_without_a_window_is_full_attention_everywhere(tmp_path):
    spec = spec_of(metadata_file(tmp_path, "gemma3", 6))
    assert spec.sliding_window == 0 and spec.layer_types == ()


def test_window_pattern_as_per_layer_flags(tmp_path):
    flags = {"attention.sliding_window": 64, "attention.sliding_window_pattern": [True, False, True, False]}
    spec = spec_of(metadata_file(tmp_path, "gemma3", 4, **flags))
    assert spec.layer_types == ("sliding_attention", "full_attention") * 2


def test_gemma2_softcaps_default_to_llama_cpp_and_read_when_stated(tmp_path):
    default = spec_of(metadata_file(tmp_path, "gemma2", **{"attention.sliding_window": 16}))
    assert (default.attn_softcap, default.final_softcap) == (50.0, 30.0)
    assert default.layer_types == ("sliding_attention", "full_attention") and default.sliding_window == 16
    stated = spec_of(metadata_file(tmp_path, "gemma2", attn_logit_softcapping=20.0, final_logit_softcapping=10.0))
    assert (stated.attn_softcap, stated.final_softcap) == (20.0, 10.0)


def test_gemma_family_flags(tmp_path):
    spec = spec_of(metadata_file(tmp_path, "gemma"))
    assert (spec.norm_offset, spec.activation, spec.sandwich_norms) == (1.0, "gelu_tanh", False)
    assert spec.embed_scale == pytest.approx(8.0)


def test_mistral3_yarn_keeps_llama_cpp_magnitude(tmp_path):
    spec = spec_of(metadata_file(tmp_path, "mistral3", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 16.0,
                                                         "rope.scaling.original_context_length": 256}))
    assert spec.rope_type == "yarn" and json.loads(spec.rope_scaling)["attention_factor"] == 1.0


def test_phi3_partial_rotary_from_dimension_count(tmp_path):
    spec = spec_of(metadata_file(tmp_path, "phi3", **{"rope.dimension_count": 24}))
    assert spec.partial_rotary_factor == 0.75 and spec.rotary_dim == 24


@pytest.mark.parametrize("kv,reason", [({"expert_count": 8}, "expert_count = 8"),
                                       ({"attention.temperature_scale": 0.1}, "temperature_scale"),
                                       ({"logit_scale": 0.5}, "logit_scale"),
                                       ({"rope.scaling.type": "weird"}, "rope scaling 'weird'"),
                                       ({"attention.head_count": [4, 8]}, "differs between layers"),
                                       ({"attention.value_length": 64}, "value heads of 64"),
                                       ({"rope.dimension_count": 16}, "rotary over 16 of 32")])
def test_what_the_graph_cannot_run_is_refused_from_the_metadata(tmp_path, kv, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        spec_of(metadata_file(tmp_path, "llama", **kv))


def test_uniform_per_layer_arrays_are_read(tmp_path):
    assert spec_of(metadata_file(tmp_path, "llama", **{"attention.head_count_kv": [2, 2]})).num_kv_heads == 2


def test_llama_with_attention_bias_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        spec_of(metadata_file(tmp_path, "llama", tensors=("token_embd.weight", "blk.0.attn_q.bias")))


def test_tensor_the_graph_has_no_place_for_is_refused(tmp_path):
    f = metadata_file(tmp_path, "llama", tensors=("token_embd.weight", "blk.0.attn_sinks.weight"))
    arch, cfg = hf_config(f)
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_sinks\.weight has no place"):
        lazy_weights(f, arch, spec_from_hf_config(cfg))


def test_missing_tensor_is_refused_by_name(tmp_path):
    f = metadata_file(tmp_path, "llama")
    arch, cfg = hf_config(f)
    with pytest.raises(GGUFError, match="no tensor for model.norm.weight"):
        lazy_weights(f, arch, spec_from_hf_config(cfg))
