"""Model quality metrics over built graphs (perplexity on a fixed text)."""

from kiln.compiler.eval.perplexity import PERPLEXITY_TEXT, perplexity, text_token_ids

__all__ = ["PERPLEXITY_TEXT", "perplexity", "text_token_ids"]
