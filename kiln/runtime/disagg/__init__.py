"""Prefill/decode disaggregation (a first slice): a prefill worker process computes a prompt's KV
blocks and its first token, hands the blocks to a decode worker process through POSIX shared
memory, and the decode worker continues the sequence (docs/architecture.md has the design)."""
