"""Speculative decoding: proposers guess a decoding request's next tokens, one engine call
verifies them (kiln/runtime/speculative/verify.py), and the scheduler keeps what was accepted."""

from kiln.runtime.speculative.ngram import NgramProposer
from kiln.runtime.speculative.speculator import Proposer, SpeculationStats, Speculator

__all__ = ["NgramProposer", "Proposer", "SpeculationStats", "Speculator"]
