"""What a request's output must match: the user's constraint, as hashable data.

A `StructuredOutput` is part of SamplingParams (so the response cache keys on it). It says what,
never how: grammar.py turns it into an llguidance grammar, and the compiled form a sampler
needs travels beside it (`compiled`, left out of equality and hashing), attached once per
request by GrammarCompiler.bind().
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Constraint(str, Enum):
    JSON_OBJECT = "json_object"       # any JSON object (OpenAI's JSON mode)
    JSON_SCHEMA = "json_schema"       # a JSON Schema
    REGEX = "regex"                   # a regular expression the whole output matches
    GRAMMAR = "grammar"               # a Lark grammar (llguidance's dialect, %json{} included)
    CHOICE = "choice"                 # exactly one of a list of strings


@dataclass(frozen=True)
class StructuredOutput:
    kind: Constraint
    source: str                        # the schema as canonical JSON, the regex, the grammar text
    compiled: Any = field(default=None, compare=False, hash=False, repr=False)

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(Constraint.JSON_OBJECT, "")

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON Schema must be an object")
        return cls(Constraint.JSON_SCHEMA, json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(Constraint.REGEX, pattern)

    @classmethod
    def grammar(cls, lark: str) -> StructuredOutput:
        return cls(Constraint.GRAMMAR, lark)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice needs a non-empty list of non-empty strings")
        return cls(Constraint.CHOICE, json.dumps(list(options)))

    def with_compiled(self, compiled) -> StructuredOutput:
        return StructuredOutput(self.kind, self.source, compiled)

    def __reduce__(self):
        # NOTE: pickled without its compiled form: that is this process's (llguidance objects
        # bound to its tokenizer); the engine process binds its own (kiln/runtime/engine_worker.py).
        return StructuredOutput, (self.kind, self.source)

