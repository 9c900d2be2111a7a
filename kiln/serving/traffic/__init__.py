"""Where a prepared request gets its tokens, and who may wait for them: admission control against the
TTFT objective (admission), per-key token budgets (key_budget), one engine generation shared by
identical requests (flights), and the cache / in-flight / engine choice (generations)."""
