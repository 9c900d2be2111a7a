"""The openvino build's options per quant mode follow the build CPU; a load on another CPU adapts."""

from dataclasses import replace

import pytest

from kiln.compiler.backends.openvino.recipe import options_for_quant, options_for_recipe
from kiln.contract.quant import QuantMode
from kiln.engines.openvino import options as ov_options


@pytest.mark.parametrize("native_bf16, compute, cache", [(True, "bf16", "u8"), (False, "f32", "f16")])
def test_int8_compute_and_cache_follow_native_bf16(native_bf16, compute, cache):
    options = options_for_quant(QuantMode.INT8, native_bf16=native_bf16, kiln_kernels=False)
    assert (options.inference_precision, options.kv_cache_precision) == (compute, cache)
    assert options.weights == "int8_sym" and options.dynamic_quantization_group_size == 128


@pytest.mark.parametrize("quant, native_bf16, keys", [(QuantMode.INT8, True, "by_channel"), (QuantMode.INT8, False, ""),
                                                      (QuantMode.INT4, True, "by_channel"), (QuantMode.NONE, True, "")])
def test_a_u8_cache_records_how_its_keys_are_quantized(quant, native_bf16, keys):
    """Pinned where the cache is u8 (the plugin's unasked default could change with a release);
    nothing is sent for the float caches, where the property means nothing."""
    options = options_for_quant(quant, native_bf16=native_bf16, kiln_kernels=False)
    assert options.key_cache_quant_mode == keys
    sent = options.compile_properties(threads=2).get("KEY_CACHE_QUANT_MODE")
    assert sent == (keys.upper() or None)


def test_fp32_keeps_f32_whatever_the_cpu():
    for native_bf16 in (True, False):
        options = options_for_quant(QuantMode.NONE, native_bf16=native_bf16)
        assert (options.inference_precision, options.kv_cache_precision) == ("f32", "f32")


def test_the_plans_bf16_reading_of_the_cpu_agrees_with_the_plugin():
    """The plan reads native bf16 from the CPU's flags (openvino_recipes.computes_bf16); the loader asks
    the plugin (OpenVinoOptions.on_this_cpu): on this machine they must agree."""
    from kiln.compiler.openvino_recipes import computes_bf16
    from kiln.contract.cpu import host

    assert computes_bf16(host()) == ov_options.cpu_computes_bf16()


def test_int8_takes_kiln_linears_where_they_run():
    """kiln's linears: f32 compute around them (bf16 would reorder at each), the u8 cache kept."""
    options = options_for_quant(QuantMode.INT8, native_bf16=True, kiln_kernels=True)
    assert options.kernels == "kiln-int8" and options.weights == "int8_sym"
    assert (options.inference_precision, options.kv_cache_precision, options.key_cache_quant_mode) == ("f32", "u8", "by_token")
    assert options_for_quant(QuantMode.INT8, native_bf16=True, kiln_kernels=False).kernels == ""
    assert options_for_quant(QuantMode.INT4, kiln_kernels=True).kernels == ""      # int4 keeps its own recipe


def test_the_build_asks_the_plan_for_kiln_linears_when_not_told(monkeypatch):
    from kiln.compiler.defaults import openvino_int8_runs_kiln_linears
    from kiln.compiler.plan import BuildHost

    usable = openvino_int8_runs_kiln_linears(BuildHost.probe())
    assert (options_for_quant(QuantMode.INT8).kernels == "kiln-int8") is usable


@pytest.mark.parametrize("mode", [QuantMode.NONE, QuantMode.INT8, QuantMode.INT4])
@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("kiln_linears", [True, False])
def test_the_plans_kv_cache_is_the_one_the_options_ask(mode, bf16, kiln_linears):
    from kiln.compiler.openvino_recipes import openvino_recipe

    recipe = openvino_recipe(mode, bf16, kiln_linears)
    assert options_for_recipe(recipe).kv_cache_precision == recipe.kv_cache


def test_bf16_record_loads_as_f32_on_a_cpu_without_native_bf16(monkeypatch):
    bf16 = options_for_quant(QuantMode.INT8, native_bf16=True, kiln_kernels=False)
    monkeypatch.setattr(ov_options, "cpu_computes_bf16", lambda: False)
    assert bf16.on_this_cpu() == replace(bf16, inference_precision="f32")
    monkeypatch.setattr(ov_options, "cpu_computes_bf16", lambda: True)
    assert bf16.on_this_cpu() == bf16
    f32 = options_for_quant(QuantMode.INT8, native_bf16=False, kiln_kernels=False)
    assert f32.on_this_cpu() == f32
