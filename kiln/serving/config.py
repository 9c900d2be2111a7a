"""The server's own knobs. The runtime's (KV memory, scheduler) stay in RuntimeConfig."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"                  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None     # default: the artifact folder's name
    # Admission control: a request over any bound is refused at once with 429.
    ttft_slo: float | None = None            # seconds; refuse when the predicted TTFT exceeds it
    max_waiting: int | None = None           # admitted requests still waiting for their first token
    max_waiting_tokens: int | None = None    # their prompt tokens
    request_timeout: float | None = None     # seconds; the request ends with finish_reason "timeout"
    # Response cache for deterministic requests (temperature 0 or a fixed seed).
    response_cache: bool = True
    cache_max_entries: int = 1024
    cache_max_bytes: int = 64 << 20
    cache_ttl: float = 600.0
    max_body_bytes: int = 4 << 20            # larger bodies get 413 before they are parsed

    def __post_init__(self):
        for name in ("ttft_slo", "request_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("max_waiting", "max_waiting_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
