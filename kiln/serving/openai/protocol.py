"""The OpenAI request bodies kiln accepts, as pydantic models. Types only: what the values must
satisfy (ranges, context limits) is checked in requests.py against the engine."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.serving.http.errors import ApiError, bad_request


class _Body(BaseModel):
    # Strict: a boolean is not an integer, 4.0 is not an integer, "4" is not a number. Unknown
    # fields are found by pydantic (extra="forbid"); parse_body then refuses them (--strict-api)
    # or drops and reports them (the default, as vLLM does).
    model_config = ConfigDict(extra="forbid", strict=True)


# OpenAI fields that change what the answer means, which kiln does not implement: refused by name
# in every mode, since ignoring them would answer a different question than the one asked.
REFUSED_FIELDS = ("functions", "function_call", "audio", "modalities", "prediction", "suffix")
MAX_IGNORED_PASSES = 8      # re-validations after dropping unknown fields (each drops at least one)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM's: every chunk carries the usage so far


class _SamplingFields(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = None
    best_of: int | None = None         # only = n: every sampled sequence is returned (no ranking)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's structured-output extension fields (send them with the openai client's extra_body).
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_grammar: str | None = None          # a Lark grammar (llguidance's dialect)
    guided_choice: list[str] | None = None
    # vLLM's: a prefix-cache namespace; requests see cached prefixes only of the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's sampling extensions (extra_body with the openai client).
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow", strict=True)   # an image part's fields: refused by its type
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)   # tool calls, names ... reach the template as they are
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[ContentPart], None] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    # {"name", "schema", "strict", "description"}: a dict, because `schema` is a pydantic name.
    json_schema: dict[str, Any] | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template (Qwen3's enable_thinking ...).
    chat_template_kwargs: dict[str, Any] | None = None


def parse_body(model: type[_Body], data, strict: bool = True) -> tuple[_Body, tuple[str, ...]]:
    """(the body as `model`, the unknown fields dropped from it), or a 400 naming the first
    offending field. strict: an unknown field is a 400 too; otherwise it is dropped and named
    in the second item (dotted paths: "stream_options.foo")."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    # A null is "not given", for fields kiln does not know as well as for those it does.
    data = {k: v for k, v in data.items() if v is not None or k in model.model_fields}
    for name in REFUSED_FIELDS:
        if name in data and name not in model.model_fields:
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    ignored: list[str] = []
    for _ in range(MAX_IGNORED_PASSES):
        try:
            return model.model_validate(data), tuple(ignored)
        except ValidationError as e:
            errors = e.errors()
            extra = [err for err in errors if err["type"] == "extra_forbidden"]
            if strict or len(extra) < len(errors):
                raise _as_api_error(e, skip_extra=not strict) from None
            for err in extra:
                _drop(data, err["loc"])
                ignored.append(_param(err["loc"]))
    raise bad_request("the request body has too many unknown fields", code="unsupported_parameter")


def _drop(data: dict, loc: tuple) -> None:
    """Delete the value at a pydantic error location (union tags in it are skipped)."""
    node = data
    for part in loc[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
    if isinstance(node, dict):
        node.pop(loc[-1], None)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param(loc: tuple) -> str | None:
    # Union members add their type name to the location; the field is the leading plain parts.
    parts = [str(p) for p in loc if isinstance(p, int) or p not in _UNION_TAGS and "[" not in p]
    return ".".join(parts) or None


def _as_api_error(e: ValidationError, skip_extra: bool = False) -> ApiError:
    errors = e.errors()
    first = next((err for err in errors if err["type"] != "extra_forbidden"), errors[0]) if skip_extra else errors[0]
    param = _param(first["loc"])
    if first["type"] == "missing":
        return bad_request(f"'{param}' is a required property", param, "missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return bad_request(f"'{param}' is not supported by this server", param, "unsupported_parameter")
    return bad_request(f"invalid value for '{param}': {first['msg']}", param, "invalid_value")


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a prompt, or chat messages rendered through the template first."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
