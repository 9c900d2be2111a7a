"""What a backend's builder hands back to the build pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ContextManager

from kiln.contract.engine import KvLayout

StageFn = Callable[[str], ContextManager]     # wraps each stage (progress display, timing)


@dataclass
class BuiltEngines:
    engines: list[dict]                # manifest engine records (backend, file, sha256, io, ...)
    kv_layout: KvLayout                # the KV storage the engines read, as the runtime must plan it
    pass_reports: list[dict] = field(default_factory=list)
