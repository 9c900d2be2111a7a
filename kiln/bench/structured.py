"""The JSON Schema the `json` and `json-mixed` workloads ask for, as each kind of target sends it.

An open list of records, at least 50 of them: no reply closes it within a workload's reply
lengths, so a constrained request decodes exactly its max_tokens, as an unconstrained one does
(ignore_eos), and the two cost the same number of steps.
"""

from __future__ import annotations

RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "quantity": {"type": "integer", "minimum": 0, "maximum": 1000},
                                           "note": {"type": "string", "maxLength": 60}},
          "required": ["name", "quantity", "note"], "additionalProperties": False}
BENCH_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 50}},
                "required": ["records"], "additionalProperties": False}


def http_fields(endpoint: str) -> dict:
    """The request-body fields that constrain a reply: OpenAI's for chat, vLLM's for completions."""
    if endpoint == "chat":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": BENCH_SCHEMA}}}
    return {"guided_json": BENCH_SCHEMA}


def structured_output():
    from kiln.runtime.structured import StructuredOutput

    return StructuredOutput.json_schema(BENCH_SCHEMA)
