"""Model sources, the family registry and checkpoint reading: what builds, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import MISSING, fields

import numpy as np
import pytest

from kiln.compiler.export.checkpoint import CheckpointError
from kiln.compiler.export.families import spec_from_hf_config
from kiln.compiler.export.sources import load_source
from kiln.contract.model_spec import ModelSpec, UnsupportedModelError

TINY = dict(model_type="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128)


def test_unknown_architecture_refused_with_supported_list():
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama.*mistral.*qwen2.*qwen3.*phi3.*gemma2.*gemma3_text"):
        spec_from_hf_config({"model_type": "gpt2"})


@pytest.mark.parametrize("model_type", ["gemma3", "falcon", "gpt_neox"])
def test_unknown_architecture_in_hf_folder_refused(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UnsupportedModelError, match=f"unsupported architecture '{model_type}'"):
        load_source(str(tmp_path))


def test_unknown_rope_type_refused_with_the_supported_ones():
    cfg = TINY | {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="'proportional'.*linear.*dynamic.*llama3.*yarn.*longrope"):
        spec_from_hf_config(cfg)


def test_rope_type_missing_its_parameters_refused():
    with pytest.raises(UnsupportedModelError, match="'llama3' needs .*low_freq_factor"):
        spec_from_hf_config(TINY | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_old_and_new_rope_config_forms_read_alike():
    params = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}
    old = spec_from_hf_config(TINY | {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 5e5})
    new = spec_from_hf_config(TINY | {"rope_parameters": params})
    assert old == new and old.rope_type == "linear" and old.rope_theta == 5e5


def test_llama_with_o_proj_bias_refused():
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        spec_from_hf_config(TINY | {"attention_bias": True})


def test_qwen_sliding_window_from_max_window_layers_on():
    qwen = TINY | {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}
    some = spec_from_hf_config(qwen | {"max_window_layers": 1})
    assert [some.layer_window(i) for i in range(2)] == [0, 16]
    every = spec_from_hf_config(qwen | {"max_window_layers": 0})
    assert every.sliding_window == 16 and every.layer_types == ()
    assert spec_from_hf_config(qwen | {"max_window_layers": 2}).sliding_window == 0


def test_mistral_window_recorded_in_spec():
    spec = spec_from_hf_config(TINY | {"model_type": "mistral", "sliding_window": 512})
    assert spec.family == "mistral" and spec.sliding_window == 512


def test_old_manifest_spec_loads_and_keeps_its_hash():
    spec = spec_from_hf_config(TINY)
    old = {f.name: getattr(spec, f.name) for f in fields(ModelSpec) if f.default is MISSING}   # the first schema
    assert ModelSpec.from_dict(old) == spec
    assert spec.config_hash() != spec_from_hf_config(TINY | {"model_type": "mistral", "sliding_window": 8}).config_hash()


def test_missing_source_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_source("no-such-model")


@pytest.mark.parametrize("name,family,bias,tied", [("tiny-llama", "llama", False, False),
                                                   ("tiny-qwen2", "qwen2", True, True)])
def test_tiny_presets_are_seeded_and_deterministic(name, family, bias, tied):
    a, b = load_source(name), load_source(name)
    assert a.spec.family == family and a.spec.attention_bias is bias and a.spec.tie_word_embeddings is tied
    assert a.weights.keys() == b.weights.keys()
    assert all((a.weights[k] == b.weights[k]).all() for k in a.weights)


# --- checkpoint formats ------------------------------------------------------------------------

@pytest.fixture
def tiny_folder(tmp_path):
    from kiln.compiler.export.presets import write_tiny_checkpoint

    return write_tiny_checkpoint("tiny-llama", tmp_path / "ckpt")


def _resave(folder, dtype: str, shards: int = 1):
    """Rewrite the folder's weights in another dtype, split over `shards` files with an index."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(str(folder / "model.safetensors")).items()}
    (folder / "model.safetensors").unlink()
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / file))
        weight_map |= {k: file for k in part}
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {k: v.float().numpy() for k, v in tensors.items()}


@pytest.mark.parametrize("dtype,shards", [("float32", 1), ("float16", 1), ("bfloat16", 1), ("bfloat16", 3)])
def test_hf_folder_dtypes_and_shards_read_exactly(tiny_folder, dtype, shards):
    expected = _resave(tiny_folder, dtype, shards)
    src = load_source(str(tiny_folder))
    assert src.weights.keys() == expected.keys()
    assert all(src.weights[k].dtype == np.float32 and (src.weights[k] == expected[k]).all() for k in expected)


def test_missing_shard_refused_with_tensor_name(tiny_folder):
    _resave(tiny_folder, "bfloat16", 3)
    (tiny_folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"tensor model\.\S+: its shard model-00002-of-00003"):
        load_source(str(tiny_folder))


def test_missing_tensor_refused_with_its_name(tiny_folder):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tiny_folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tiny_folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="incomplete checkpoint: tensor model.layers.1.mlp.up_proj.weight"):
        load_source(str(tiny_folder))


def test_mismatched_shape_refused_with_tensor_name(tiny_folder):
    cfg = json.loads((tiny_folder / "config.json").read_text())
    (tiny_folder / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.mlp.down_proj.weight has shape \[64, 128\], "
                                              r"the config implies \[64, 96\]"):
        load_source(str(tiny_folder))


def test_unknown_dtype_refused_with_tensor_name(tiny_folder):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tiny_folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    save_file(tensors, str(tiny_folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor model.norm.weight has dtype I8; kiln reads F32, F16, BF16"):
        load_source(str(tiny_folder))


def test_truncated_file_refused(tiny_folder):
    f = tiny_folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_source(str(tiny_folder))


def _raw_safetensors(path, header: bytes, length: int | None = None, data: bytes = b"") -> None:
    import struct

    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def test_header_length_past_the_cap_refused_without_reading(tiny_folder):
    """A length field of 2**63 (in a file a few bytes long) is refused on the number alone."""
    _raw_safetensors(tiny_folder / "model.safetensors", b"{}", length=2**63)
    with pytest.raises(CheckpointError, match="header claims .* not a safetensors file"):
        load_source(str(tiny_folder))


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]},          # end before start
    {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]},         # before the data
    {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]},         # negative dimension
    {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]},            # shape not a list
    {"dtype": "F32", "shape": [4]},                                   # no offsets
    [1, 2, 3],                                                        # not an object
])
def test_damaged_header_entry_refused_with_tensor_name(tiny_folder, entry):
    header = json.dumps({"model.norm.weight": entry}).encode()
    _raw_safetensors(tiny_folder / "model.safetensors", header, data=bytes(16))
    with pytest.raises(CheckpointError, match="tensor model.norm.weight: model.safetensors has a damaged header entry"):
        load_source(str(tiny_folder))


def test_header_that_is_not_an_object_refused(tiny_folder):
    _raw_safetensors(tiny_folder / "model.safetensors", b"[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        load_source(str(tiny_folder))


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/model.safetensors", ".."])
def test_index_shard_outside_the_folder_refused(tiny_folder, shard):
    _resave(tiny_folder, "bfloat16", 3)
    index = tiny_folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": weight_map | {"model.norm.weight": shard}}))
    with pytest.raises(CheckpointError, match="tensor model.norm.weight: .* a shard must be a file name"):
        load_source(str(tiny_folder))


def test_a_link_out_of_the_source_folder_is_refused(tiny_folder, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text((tiny_folder / "tokenizer.json").read_text())
    (tiny_folder / "tokenizer.json").unlink()
    (tiny_folder / "tokenizer.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="tokenizer.json in .* is a link to .*outside the checkpoint folder"):
        load_source(str(tiny_folder))


def test_a_hugging_face_cache_snapshot_s_links_into_its_blobs_are_followed(tiny_folder, tmp_path):
    """models--org--name/snapshots/REV/FILE -> ../../blobs/HASH, as huggingface_hub lays a cache out."""
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(tiny_folder.iterdir())):
        blob = blobs / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    src = load_source(str(snapshot))
    assert src.spec.num_layers > 0 and len(src.weights) > 0
