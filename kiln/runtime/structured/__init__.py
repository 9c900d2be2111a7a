"""Constrained decoding: a request's output held to a JSON Schema, a regular expression or a Lark
grammar by a token mask from llguidance. See grammar.py for why llguidance."""

from kiln.runtime.structured.grammar import GrammarCompiler, GrammarError, Guide, bind_params, compiler_for
from kiln.runtime.structured.spec import StructuredOutput

__all__ = ["StructuredOutput", "GrammarCompiler", "GrammarError", "Guide", "bind_params", "compiler_for"]
