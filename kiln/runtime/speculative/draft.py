"""Draft-model proposals (--speculative draft:PATH): not built yet."""

from __future__ import annotations


class DraftProposer:
    @classmethod
    def load(cls, path, target_artifact, runtime):
        raise ValueError("--speculative draft:PATH is not available yet; use --speculative ngram")
