"""The files of a rendered model: config.pbtxt and the model.py shim, as string templates."""

from __future__ import annotations

from string import Template

CONFIG_PBTXT = Template('''\
# Rendered by `kiln triton-repo` from $manifest: regenerate it rather than editing it.
# Model: $family, $num_layers layers, hidden $hidden_size, vocab $vocab_size, weights $quant.
# Context $max_model_len tokens; KV cache in blocks of $block_size tokens; engine batches up to $max_batch.
name: "$name"
backend: "python"
# Batching happens inside kiln (in-flight, per step), not in Triton's batcher.
max_batch_size: 0
# One request, many responses: streamed text, or one response with the whole text.
model_transaction_policy { decoupled: true }
input [
$inputs
]
output [
$outputs
]
# Each instance is its own process with its own engine and KV cache.
instance_group [ { count: $instances, kind: KIND_CPU } ]
$parameters
''')

MODEL_PY = '''\
"""Rendered by `kiln triton-repo`. Triton's python backend loads this file; the model is kiln's
(kiln/serving/triton/backend.py), imported from the environment named by EXECUTION_ENV_PATH
in config.pbtxt."""

from kiln.serving.triton.backend import TritonPythonModel  # noqa: F401
'''


def pbtxt_parameters(params: dict[str, str]) -> str:
    return "\n".join(f'parameters {{ key: "{key}", value: {{ string_value: "{_escape(value)}" }} }}'
                     for key, value in params.items())


def _escape(text: str) -> str:
    """protobuf text-format string escaping for what paths and knobs can hold."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
