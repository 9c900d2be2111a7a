"""An OpenAI request body -> prompt token ids + SamplingParams, checked against the engine's limits
before anything is queued, so a bad request is a 400 and never disturbs the ones in flight."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from jinja2 import TemplateError

from kiln.runtime.request import longest_fitting
from kiln.runtime.sampling_params import SamplingParams
from kiln.serving.http.errors import ApiError, bad_request
from kiln.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from kiln.serving.openai.reasoning import prompt_opens_block, template_reasons
from kiln.serving.openai.structured_requests import ToolPlan, bind, plan_tools, structured_output
from kiln.tokenizer import ChatTemplateError, Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
# Chat's default max_tokens is the whole context for one choice, this for n > 1: n choices each
# reserving the context would let one request fill the waiting queue (each choice is admitted).
DEFAULT_MULTI_CHOICE_MAX_TOKENS = 512
# The `priority` a key may send unless --api-key-file grants it a range: 0 or later (under
# --scheduling-policy priority lower runs first), so no caller jumps the queue unless the operator
# says so; values outside the range are clamped to it.
DEFAULT_PRIORITY_RANGE = (0, 1_000_000)
MAX_CHOICES = 64                       # n x prompts of one request: each is an engine request
# echo with logprobs k scores every prompt token: a log-softmax over the vocabulary per token on
# the engine thread and k + 1 entries per token in the body. A request's prompt tokens x (k + 1),
# over all its choices, is bounded (vLLM bounds prompt_logprobs too): a log-likelihood
# evaluation of a few full-context prompts fits, 64 of them at logprobs 20 does not.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 15


@dataclass(frozen=True)
class EngineLimits:
    """Plain numbers read once at start-up from the engine client's snapshot and the manifest,
    so the HTTP thread never touches the engine core."""
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    priority_scheduling: bool = False      # the engine orders its waiting queue by `priority`

    @classmethod
    def of(cls, snapshot, manifest) -> EngineLimits:
        eos = tuple(manifest.generation.get("eos_token_ids") or ())
        return cls(snapshot.max_model_len, snapshot.kv_blocks_total, snapshot.kv_block_size,
                   manifest.spec.vocab_size, eos, snapshot.priority_scheduling)

    @property
    def kv_tokens(self) -> int:
        """The longest request (prompt and output tokens) the KV pool can hold."""
        return longest_fitting(self.num_kv_blocks * self.block_size)


@dataclass(frozen=True)
class RequestOptions:
    """What the server's configuration and the caller's identity add to every request."""
    control_tokens_in_messages: bool = False   # parse special-token text in messages (the old way)
    cache_salt: str | None = None              # the API key's prefix-cache salt (a body's nests in it)
    strict_api: bool = False                   # unknown body fields: 400 (True) or dropped and named
    tool_format: str | None = None             # --tool-call-parser; None: the template's syntax
    priority_range: tuple[int, int] = DEFAULT_PRIORITY_RANGE    # the caller's key's grant (--api-key-file)


# A prompt of n characters is at least n / (the longest token's characters) tokens; halved again
# for normalizers that drop characters. Prompts that are too long by that bound are refused before
# the template renders or the tokenizer runs.
CHARS_BOUND_SLACK = 2


@dataclass(frozen=True)
class PreparedRequest:
    kind: str                       # "completion" or "chat": how the answer is rendered
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False         # every streamed chunk carries the usage so far
    # Chat with tools: at most this many tool calls are parsed out of the reply (0: none; more
    # stay text). One when the client sets parallel_tool_calls to false.
    parse_tool_calls: int = 0
    ignored_fields: tuple[str, ...] = ()   # unknown body fields dropped (X-Kiln-Ignored-Fields)
    tool_format: str = "hermes"            # the tool-call syntax parsed (tool_formats.py)
    # A chat template with <think> blocks: "reply" (the reply may open one) or "opened" (the
    # prompt left one open); "": no reasoning parsed (reasoning.py).
    reasoning: str = ""
    n: int = 1                             # choices per prompt
    more_prompts: tuple[tuple[int, ...], ...] = ()   # completions' list prompts after the first
    # Completions' echo: each prompt's text (None: decode its ids) comes back before its output;
    # echo_only (max_tokens 0): only the prompt does.
    echo: bool = False
    echo_only: bool = False
    prompt_texts: tuple[str | None, ...] = ()

    @property
    def prompts(self) -> tuple[tuple[int, ...], ...]:
        return (self.prompt_ids, *self.more_prompts)

    @property
    def deterministic(self) -> bool:
        return self.params.greedy or self.params.seed is not None

    @property
    def reserved_tokens(self) -> int:
        """What the request may hold of the KV pool: each choice its prompt and max_tokens (the
        charge against its key's budget)."""
        return self.n * sum(len(p) + self.params.max_tokens for p in self.prompts)

    @property
    def heavy_body(self) -> bool:
        """Whether building the response body is CPU work for a worker thread, not the event
        loop: tool calls to parse, or logprobs (an entry per top token per position)."""
        return bool(self.parse_tool_calls) or self.params.logprobs is not None or \
            self.params.prompt_logprobs is not None

    @property
    def cache_key(self) -> tuple:
        # The engine's output depends on these alone; how it is rendered (chat or completion,
        # streamed or not) is applied afterwards, so both kinds share one entry.
        return self.prompt_ids, self.params


def prepare_completion(body: CompletionRequest, tok: Tokenizer, limits: EngineLimits,
                       options: RequestOptions = RequestOptions()) -> PreparedRequest:
    prompts = _prompt_list(body.prompt)
    if len(prompts) * _num_choices(body) > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n = {_num_choices(body)} choices; at most {MAX_CHOICES} "
                          "per request", "prompt")
    for prompt in prompts:
        if isinstance(prompt, str):
            check_chars_fit(len(prompt), tok, limits, "prompt")
    all_ids = [tuple(_prompt_ids(p, tok, limits)) for p in prompts]
    # echo with max_tokens 0 (log-likelihood evaluation): one token is sampled, none returned.
    echo_only = body.echo and body.max_tokens == 0
    longest = max(all_ids, key=len)       # the context checks hold for every prompt
    prepared = _prepare("completion", body, list(longest), 1 if echo_only else body.max_tokens, body.logprobs,
                        limits, "prompt", tok, options=options)
    params = prepared.params
    if body.echo and body.logprobs is not None:
        _check_prompt_logprobs(sum(map(len, all_ids)) * _num_choices(body), body.logprobs)
        params = replace(params, prompt_logprobs=body.logprobs)
    texts = tuple(p if isinstance(p, str) else None for p in prompts)
    return replace(prepared, prompt_ids=all_ids[0], more_prompts=tuple(all_ids[1:]), params=params,
                   echo=body.echo, echo_only=echo_only, prompt_texts=texts)


def _check_prompt_logprobs(prompt_tokens: int, logprobs: int) -> None:
    entries = prompt_tokens * (logprobs + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise bad_request(f"echo with logprobs {logprobs} scores {prompt_tokens} prompt tokens (over all prompts "
                          f"and choices) x {logprobs + 1} = {entries} entries; at most {MAX_PROMPT_LOGPROB_ENTRIES} "
                          "per request: send fewer or shorter prompts, or fewer logprobs", "logprobs", "invalid_value")


def prepare_chat(body: ChatCompletionRequest, tok: Tokenizer, limits: EngineLimits,
                 options: RequestOptions = RequestOptions()) -> PreparedRequest:
    tools = plan_tools(body, tok, options.tool_format)
    messages = message_dicts(body.messages)
    check_chars_fit(rendered_chars(messages, tools.tools, body.chat_template_kwargs), tok, limits, "messages")
    try:
        ids = tok.encode_chat(messages, tools=tools.tools,
                              control_tokens_in_messages=options.control_tokens_in_messages,
                              template_kwargs=body.chat_template_kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
        # The template is the model's, the messages the client's: a render that fails on them
        # (a missing field, a None where text was expected) is the request's problem, not ours.
        raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prepared = _prepare("chat", body, ids, max_tokens, logprobs, limits, "messages", tok, tools, options)
    if not template_reasons(tok.chat_template):
        return prepared
    opened = prompt_opens_block(tok.decode(ids[-8:], skip_special_tokens=False))
    return replace(prepared, reasoning="opened" if opened else "reply")


def message_dicts(messages) -> list[dict]:
    """The body's messages as the chat template takes them (400 for those it cannot)."""
    return [_message_dict(i, m) for i, m in enumerate(messages)]


def rendered_chars(*values) -> int:
    """The characters of every string (dict keys too) the chat template may render: messages,
    tool definitions, template kwargs. NOTE: all of them, since a tool description or a template
    variable costs the renderer and the tokenizer as much as message text does."""
    return sum(len(text) for value in values for text in _texts(value))


def _texts(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield k
            yield from _texts(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _texts(v)


def _cache_salt(key_salt: str | None, body_salt: str | None) -> str | None:
    # A body's salt namespaces within its key's: no salt a client sends reaches another key's cache.
    if key_salt is None or body_salt is None:
        return body_salt if key_salt is None else key_salt
    return f"{key_salt}\0{body_salt}"


def check_chars_fit(num_chars: int, tok: Tokenizer, limits: EngineLimits, param: str) -> None:
    """400 when the characters alone prove the prompt longer than the context (before any
    rendering or tokenizing: the chat endpoints and /tokenize)."""
    at_least = num_chars // (CHARS_BOUND_SLACK * getattr(tok, "max_token_chars", num_chars or 1) or 1)
    limit = min(limits.max_model_len, limits.kv_tokens)
    if at_least >= limit:
        raise bad_request(f"the prompt has {num_chars} characters, at least {at_least} tokens, but this "
                          f"model's context is {limit} tokens", param, "context_length_exceeded")


def _prepare(kind, body, ids, max_tokens, logprobs, limits, prompt_param, tok,
             tools: ToolPlan = ToolPlan(), options: RequestOptions = RequestOptions()) -> PreparedRequest:
    n = _num_choices(body)
    _check_prompt_fits(len(ids), limits, prompt_param)
    max_tokens = _max_tokens(kind, max_tokens, len(ids), limits, n)
    spec, field = structured_output(body, tools)
    salt = _cache_salt(options.cache_salt, body.cache_salt)
    params = _sampling_params(body, max_tokens, logprobs, _logit_bias(body.logit_bias, limits),
                              None if spec is None else bind(spec, field, tok, limits), salt, limits,
                              options.priority_range)
    options_ = body.stream_options
    include_usage = bool(body.stream and options_ and options_.include_usage)
    continuous = bool(body.stream and options_ and options_.continuous_usage_stats)
    return PreparedRequest(kind, tuple(ids), params, body.stream, include_usage, continuous, tools.max_calls, n=n,
                           tool_format=tools.format)


def _prompt_list(prompt) -> list:
    """A completion's prompts: a list of strings or of token-id lists is several prompts."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def _prompt_ids(prompt, tok: Tokenizer, limits: EngineLimits) -> list[int]:
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {limits.vocab_size})", "prompt")
    return ids


def _message_dict(index: int, message) -> dict:
    if message.content is None and not (message.role == "assistant" and getattr(message, "tool_calls", None)):
        raise bad_request(f"a {message.role} message needs content", f"messages.{index}.content",
                          "missing_required_parameter")
    d = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if part.type != "text":
                raise bad_request(f"content parts of type '{part.type}' are not supported; only 'text'",
                                  f"messages.{index}.content.{j}.type", "unsupported_content_type")
        d["content"] = "".join(p.text or "" for p in message.content)
    if isinstance(d.get("tool_calls"), list):
        d["tool_calls"] = [_call_for_template(c) for c in d["tool_calls"]]
    return d


def _call_for_template(call):
    # OpenAI sends arguments as a JSON string; templates (Qwen2's among them) expect a mapping.
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return call


def _num_choices(body) -> int:
    """n, checked: choices are sampled independently and all returned, so best_of may only be n."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {n}", "n", "invalid_value")
    if body.best_of is not None and body.best_of != n:
        raise bad_request(f"best_of must equal n ({n}): every sampled sequence is returned, none ranked away",
                          "best_of", "invalid_value")
    return n


def _check_prompt_fits(num_prompt: int, limits: EngineLimits, param: str) -> None:
    limit = min(limits.max_model_len, limits.kv_tokens)
    if num_prompt >= limit:
        raise bad_request(f"the prompt has {num_prompt} tokens but this model's context is {limit} "
                          f"tokens, one of which must be left for the answer", param, "context_length_exceeded")


def _max_tokens(kind: str, requested: int | None, num_prompt: int, limits: EngineLimits, n: int = 1) -> int:
    room = min(limits.max_model_len, limits.kv_tokens) - num_prompt
    if requested is None:
        # Chat answers may use the whole context (as OpenAI's do), several choices a finite
        # default; completions default to 16.
        default = DEFAULT_COMPLETION_MAX_TOKENS if kind != "chat" else \
            DEFAULT_MULTI_CHOICE_MAX_TOKENS if n > 1 else room
        return min(default, room)
    if requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", "max_tokens")
    if requested > room:
        raise bad_request(f"max_tokens is {requested} but the prompt ({num_prompt} tokens) leaves room "
                          f"for {room} in the context", "max_tokens", "context_length_exceeded")
    return requested


def _logit_bias(bias: dict[str, float] | None, limits: EngineLimits) -> dict[int, float]:
    """OpenAI's {"token id": bias} with every id checked against this model's vocabulary."""
    out = {}
    for key, value in (bias or {}).items():
        # NOTE: the length check first: int() of a huge digit string is slow, then refused.
        valid = len(key) <= 12 and key.isascii() and key.isdigit() and int(key) < limits.vocab_size
        if not valid or int(key) in out:
            raise bad_request(f"logit_bias keys must be distinct token ids in [0, {limits.vocab_size}), "
                              f"got '{key[:32]}'", "logit_bias", "invalid_value")
        out[int(key)] = value
    return out


def _vllm_knobs(body, limits: EngineLimits, priority_range: tuple[int, int] = DEFAULT_PRIORITY_RANGE) -> dict:
    """vLLM's sampling extensions the body sets, checked against this engine."""
    given = dict(min_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens,
                 include_stop_str_in_output=body.include_stop_str_in_output)
    knobs = {k: v for k, v in given.items() if v is not None}
    if body.stop_token_ids:
        if any(not 0 <= t < limits.vocab_size for t in body.stop_token_ids):
            raise bad_request(f"stop_token_ids must be token ids in [0, {limits.vocab_size})", "stop_token_ids",
                              "invalid_value")
        knobs["stop_token_ids"] = tuple(body.stop_token_ids)
    if body.priority:
        if not limits.priority_scheduling:
            # vLLM's answer too: a priority the scheduler would not honour is refused, not ignored.
            raise bad_request("priority needs a server started with --scheduling-policy priority",
                              "priority", "invalid_value")
        low, high = priority_range
        knobs["priority"] = min(max(body.priority, low), high)
    return knobs


def _sampling_params(body, max_tokens: int, logprobs: int | None, logit_bias: dict[int, float],
                     structured, cache_salt: str | None, limits: EngineLimits,
                     priority_range: tuple[int, int] = DEFAULT_PRIORITY_RANGE) -> SamplingParams:
    given = dict(temperature=body.temperature, top_p=body.top_p, min_p=body.min_p,
                 presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                 repetition_penalty=body.repetition_penalty, seed=body.seed)
    knobs = {k: v for k, v in given.items() if v is not None}
    if body.top_k is not None:
        knobs["top_k"] = 0 if body.top_k == -1 else body.top_k       # vLLM's -1 also means "off"
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    knobs.update(_vllm_knobs(body, limits, priority_range))
    try:
        return SamplingParams(max_tokens=max_tokens, stop=stop, ignore_eos=body.ignore_eos,
                              logprobs=logprobs, logit_bias=logit_bias, structured=structured,
                              cache_salt=cache_salt, **knobs)
    except ValueError as e:
        raise _sampling_error(str(e)) from None


def _sampling_error(message: str) -> ApiError:
    # SamplingParams' messages open with the field they are about ("top_p must be ...").
    first = message.split()[0]
    param = first if first in SamplingParams.__dataclass_fields__ else "stop" if "stop" in message else None
    return bad_request(message, param, "invalid_value")
