"""What crosses the pipe between the API process and the engine process (engine_process.py,
engine_worker.py): plain, picklable data, one message per engine loop iteration the other way.

API process -> engine process: commands, as tuples whose first item names them (the `Command`
constants). Engine process -> API process: one `EngineOutputs` after every loop iteration that
changed something: every request's new deltas of that step, the step's report, the snapshot if it
changed, the fault if there is one. A request's first and final deltas carry how many of its
prompt tokens the prefix cache served and its timings (what usage and the latency histograms read;
a request abandoned mid-stream is counted before its final delta comes).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from kiln.runtime.engine_stats import EngineSnapshot, StepReport
from kiln.runtime.outputs import CompletionOutput, StreamDelta
from kiln.runtime.request import RequestTimings


class Command:
    ADD = "add"                      # [(Request, wants_output)]: join the same step
    FINISH = "finish"                # request_id, RequestStatus
    STEP_TIMEOUT = "step_timeout"    # seconds or None: the engine watchdog
    PREFIX_CACHE = "prefix_cache"    # snapshots carry the prefix cache's hashes from now on
    SHUTDOWN = "shutdown"


STARTED = "started"                  # (STARTED, EngineSnapshot): the engine loaded
FAILED = "failed"                    # (FAILED, Exception): loading it raised this


@dataclass
class Delivery:
    request_id: str
    delta: StreamDelta | None = None
    error: Exception | None = None           # the request ended without a final delta
    num_cached_tokens: int | None = None     # with the first delta and the final one
    timings: RequestTimings | None = None    # with the first delta and the final one
    output: CompletionOutput | None = None   # with the final delta, for a request that wants it whole


@dataclass
class EngineOutputs:
    deliveries: list[Delivery] = field(default_factory=list)
    reports: list[StepReport] = field(default_factory=list)
    snapshot: EngineSnapshot | None = None   # None: unchanged since the last message
    fault: str | None = None
    taken: int = 0                           # requests the engine process has taken in, in all


def portable_error(error: BaseException) -> Exception:
    """The error itself when it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
