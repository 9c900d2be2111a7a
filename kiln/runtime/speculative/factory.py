"""The Speculator a SpeculativeConfig asks for (None: no speculation)."""

from __future__ import annotations

from kiln.config import RuntimeConfig, SpeculativeConfig, SpeculativeMethod
from kiln.runtime.speculative.ngram import NgramProposer
from kiln.runtime.speculative.speculator import Speculator


def make_speculator(config: SpeculativeConfig | None, artifact, runtime: RuntimeConfig,
                    kv_tokens: int) -> Speculator | None:
    """kv_tokens: the target's KV capacity in tokens (a draft's pool holds as many)."""
    if config is None:
        return None
    if config.method is SpeculativeMethod.NGRAM:
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        from kiln.runtime.speculative.draft import DraftProposer

        proposer = DraftProposer.load(config.draft_path, artifact, runtime, kv_tokens)
    return Speculator(proposer, config.num_speculative_tokens, config.max_step_tokens, config.max_decodes)
