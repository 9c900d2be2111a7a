"""The structured-output and tool fields of a request -> one StructuredOutput bound to the
tokenizer (or None), and the tools the chat template gets. Every unusable schema, regex, grammar
or tool choice is a 400 naming the field, before anything is queued."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.structured import GrammarError, StructuredOutput, compiler_for
from kiln.serving.http.errors import bad_request
from kiln.serving.http.http_io import MAX_JSON_DEPTH, decode_json
from kiln.serving.openai.tool_formats import forced_grammar, format_for_template
from kiln.serving.openai.tools import template_takes_tools

MAX_TOOL_CALLS = 64
# A constraint is compiled on the request's way in, on one of the server's few preparation
# threads: its size bounds the time it holds one (compile time grows with the schema's size:
# docs/results/2026-12-06-figures-from-code-comments.md).
MAX_CONSTRAINT_CHARS = 64 << 10
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None = None        # what the chat template renders (None: no tools)
    max_calls: int = 0                     # tool calls parsed out of the reply (0: not parsed)
    forced: StructuredOutput | None = None  # the grammar of a required or named call
    format: str = "hermes"                 # the template's tool-call syntax (tool_formats.py)


def plan_tools(body, tok, tool_format: str | None = None) -> ToolPlan:
    """tool_format: the tool-call syntax (tool_formats.FORMATS); None: the template's."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    if not template_takes_tools(tok.chat_template):
        raise bad_request("this model's chat template does not support tools", "tools", "tools_not_supported")
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    if len({f["name"] for f in functions}) != len(functions):
        raise bad_request("tool function names must be distinct", "tools")
    if choice == "none":
        return ToolPlan()      # as vLLM does by default: the model is not told about tools it may not call
    templated = [{"type": "function", "function": f} for f in functions]
    max_calls = 1 if body.parallel_tool_calls is False else MAX_TOOL_CALLS
    fmt = tool_format or format_for_template(tok.chat_template)
    if choice in (None, "auto"):
        return ToolPlan(templated, max_calls, format=fmt)
    name = None if choice == "required" else choice.function.name
    if name is not None and name not in {f["name"] for f in functions}:
        raise bad_request(f"tool_choice names '{name}', which is not among the tools", "tool_choice")
    return ToolPlan(templated, max_calls, forced=forced_grammar(fmt, functions, name), format=fmt)


def structured_output(body, tools: ToolPlan | None = None) -> tuple[StructuredOutput | None, str | None]:
    """(the constraint, the field it came from); at most one field may ask for one."""
    asked = [(f, getattr(body, f)) for f in GUIDED_FIELDS if getattr(body, f, None) is not None]
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        asked.append(("response_format", fmt))
    if tools is not None and tools.forced is not None:
        asked.append(("tool_choice", tools.forced))
    if len(asked) > 1:
        raise bad_request(f"only one of {', '.join(f for f, _ in asked)} may constrain the output", asked[1][0])
    if not asked:
        return None, None
    field, value = asked[0]
    if field == "guided_json" and isinstance(value, str):
        # A schema sent as a string escaped the body's checks: its size and nesting are checked
        # here, before anything decodes it recursively (a 5,000-deep array was a 500).
        if len(value) > MAX_CONSTRAINT_CHARS:
            raise bad_request(f"the {field} constraint is {len(value)} characters; at most "
                              f"{MAX_CONSTRAINT_CHARS}", field, "constraint_too_large")
        value = decode_json(value, f"the {field} schema", field)
        if not isinstance(value, dict):
            raise bad_request(f"invalid {field}: a JSON Schema must be an object", field, "invalid_value")
    try:
        spec = _spec(field, value)
    except RecursionError:
        raise bad_request(f"the {field} constraint nests deeper than {MAX_JSON_DEPTH} levels", field,
                          "invalid_value") from None
    except (ValueError, TypeError) as e:
        raise bad_request(f"invalid {field}: {e}", field, "invalid_value") from None
    if len(spec.source) > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"the {field} constraint is {len(spec.source)} characters; at most "
                          f"{MAX_CONSTRAINT_CHARS}", field, "constraint_too_large")
    return spec, field


def _spec(field: str, value) -> StructuredOutput:
    if field == "response_format":
        if value.type == "json_object":
            return StructuredOutput.json_object()
        schema = (value.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        return StructuredOutput.json_schema(schema)
    return {"guided_json": StructuredOutput.json_schema, "guided_regex": StructuredOutput.regex,
            "guided_grammar": StructuredOutput.grammar, "guided_choice": StructuredOutput.choice,
            "tool_choice": lambda spec: spec}[field](value)


def bind(spec: StructuredOutput, field: str, tok, limits) -> StructuredOutput:
    try:
        return compiler_for(tok, limits.vocab_size, limits.eos_token_ids).bind(spec)
    except GrammarError as e:
        raise bad_request(f"invalid {field}: {e}", field, "invalid_schema") from None
    except RecursionError:
        raise bad_request(f"invalid {field}: it nests too deeply to compile", field, "invalid_schema") from None
