"""The config.json of models people deploy (abridged to the fields kiln reads) -> ModelSpec."""

from __future__ import annotations

import pytest

from kiln.compiler.export.families import spec_from_hf_config
from kiln.compiler.export.rope import rotary_for
from kiln.contract.model_spec import UnsupportedModelError

LLAMA_3_2_1B = dict(
    model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"})
PHI_3_5_MINI = dict(
    model_type="phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    intermediate_size=8192, vocab_size=32064, max_position_embeddings=131072, original_max_position_embeddings=4096,
    rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=False, hidden_act="silu",
    rope_scaling={"type": "longrope", "long_factor": [1.5] * 48, "short_factor": [1.0] * 48})
PHI_4_MINI = dict(
    model_type="phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
    intermediate_size=8192, vocab_size=200064, max_position_embeddings=131072, original_max_position_embeddings=4096,
    partial_rotary_factor=0.75, rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=True,
    hidden_act="silu", rope_scaling={"type": "longrope", "long_factor": [1.5] * 48, "short_factor": [1.0] * 48})
QWEN3_0_6B = dict(
    model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    tie_word_embeddings=True, attention_bias=False, use_sliding_window=False, sliding_window=None,
    max_window_layers=28, hidden_act="silu")
QWEN2_5_0_5B = dict(
    model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=21, hidden_act="silu")
MISTRAL_7B_V01 = dict(
    model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0,
    sliding_window=4096, tie_word_embeddings=False, hidden_act="silu")


def test_llama_3_2():
    spec = spec_from_hf_config(LLAMA_3_2_1B)
    assert (spec.rope_type, spec.rope_theta, spec.tie_word_embeddings, spec.sliding_window) == ("llama3", 5e5, True, 0)
    inv = rotary_for(spec).inv_freq
    assert inv.shape == (32,) and inv[0] == 1.0 and inv[-1] < 500000.0 ** (-62 / 64) / 31   # low frequencies / 32


def test_phi_3_5_longrope_takes_original_context_from_beside_rope_scaling():
    spec = spec_from_hf_config(PHI_3_5_MINI)
    rot = rotary_for(spec)
    assert spec.rope_type == "longrope" and rot.original_max == 4096 and rot.long_inv_freq.shape == (48,)
    assert rot.attention_scaling == pytest.approx((1 + __import__("math").log(32) / __import__("math").log(4096)) ** 0.5)
    assert spec.sliding_window == 0       # 262144 over 131072 positions hides nothing


def test_phi_4_mini_partial_rotary():
    spec = spec_from_hf_config(PHI_4_MINI)
    assert spec.head_dim == 128 and spec.rotary_dim == 96 and spec.tie_word_embeddings
    assert rotary_for(spec).inv_freq.shape == (48,)


def test_phi_4_mini_factor_count_checked():
    bad = PHI_4_MINI | {"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 64, "short_factor": [1.0] * 64}}
    with pytest.raises(UnsupportedModelError, match="_factor has 64 entries, rotary needs 48"):
        spec_from_hf_config(bad)


def test_qwen3_and_qwen2_5():
    q3, q25 = spec_from_hf_config(QWEN3_0_6B), spec_from_hf_config(QWEN2_5_0_5B)
    assert q3.qk_norm and not q3.attention_bias and q3.head_dim == 128 and q3.sliding_window == 0
    assert q25.attention_bias and not q25.qk_norm and q25.sliding_window == 0


def test_mistral_7b_window():
    assert spec_from_hf_config(MISTRAL_7B_V01).sliding_window == 4096


GEMMA_2_2B = dict(
    model_type="gemma2", hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
    head_dim=256, intermediate_size=9216, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
    query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
GEMMA_3_1B = dict(
    model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
    head_dim=256, intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rope_scaling=None, query_pre_attn_scalar=256, sliding_window=512,
    sliding_window_pattern=6, final_logit_softcapping=None, attn_logit_softcapping=None,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def test_gemma_2_interleaves_sliding_and_full_layers_with_softcaps():
    spec = spec_from_hf_config(GEMMA_2_2B)
    assert [spec.layer_window(i) for i in range(4)] == [4096, 0, 4096, 0]
    assert (spec.attn_softcap, spec.final_softcap, spec.norm_offset, spec.activation) == (50.0, 30.0, 1.0, "gelu_tanh")
    assert spec.embed_scale == pytest.approx(48.0) and spec.query_scale == 256 ** -0.5 and spec.sandwich_norms


def test_gemma_3_local_rope_and_one_full_layer_in_six():
    spec = spec_from_hf_config(GEMMA_3_1B)
    assert [spec.layer_window(i) for i in range(6)] == [512] * 5 + [0]
    assert (spec.rope_theta, spec.local_rope_theta, spec.qk_norm, spec.attn_softcap) == (1e6, 1e4, True, 0.0)


def test_gemma_3_4b_linear_rope_on_global_layers():
    spec = spec_from_hf_config(GEMMA_3_1B | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert spec.rope_type == "linear" and spec.rope_theta == 1e6 and spec.local_rope_theta == 1e4
