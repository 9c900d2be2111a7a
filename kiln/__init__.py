"""kiln: a compiler-based optimizing runtime for LLM inference."""

__version__ = "0.1.0"
