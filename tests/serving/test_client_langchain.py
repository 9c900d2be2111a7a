"""LangChain's OpenAI chat model (`langchain-openai`, a client nobody here wrote) against the real
`kiln serve`, unchanged but for its base URL: plain and streamed replies, tool binding with a named
tool choice, and structured output through a JSON Schema. A tiny Qwen2 whose chat template takes
tools (tests/serving/test_serving_tools.py's); kiln's grammar makes the call and the JSON valid
whatever the random weights say."""

from __future__ import annotations

import json

import jsonschema
import langchain_openai
import pytest

from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.compiler.export.presets import write_tiny_checkpoint
from serving_flags import TINY_FLAGS
from test_serving_tools import TOOL_TEMPLATE, WEATHER

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
        "required": ["city", "population_millions"], "additionalProperties": False}


@pytest.fixture(scope="module")
def chat_model(start_module_server, tmp_path_factory):
    src = write_tiny_checkpoint("tiny-qwen2", tmp_path_factory.mktemp("lc-ckpt"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    artifact = build(BuildConfig(source=str(src), out=tmp_path_factory.mktemp("lc-artifact") / "tiny-qwen2-lc"))
    server = start_module_server(artifact, *TINY_FLAGS, "--served-model-name", "tools")
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="tools",
                                       temperature=0, max_tokens=24, max_retries=0, timeout=60)


def test_invoke_returns_a_message_with_its_usage(chat_model):
    message = chat_model.invoke("Say hello.")
    assert isinstance(message.content, str) and message.content
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    usage = message.usage_metadata
    assert usage["output_tokens"] >= 1 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_stream_yields_the_same_reply_in_chunks(chat_model):
    whole = chat_model.invoke("Count to three.").content
    chunks = [c.content for c in chat_model.stream("Count to three.")]
    assert len(chunks) > 1 and "".join(chunks) == whole           # greedy: the same tokens either way


def test_bound_tool_with_a_named_choice_is_called_with_valid_arguments(chat_model):
    bound = chat_model.model_copy(update={"max_tokens": 250}).bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])


def test_structured_output_follows_the_schema(chat_model):
    structured = chat_model.model_copy(update={"max_tokens": 120}).with_structured_output(
        {"title": "City", "description": "A city", **CITY}, method="json_schema")
    answer = structured.invoke("Name a big city.")
    jsonschema.validate(answer, CITY)
