"""Client helpers for the Triton tests: kiln's inputs, one gRPC stream, metrics scraping."""

from __future__ import annotations

import queue
import re
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

MODEL = "kiln"
QUEUE_OF_ONE = "kiln_queue_of_one"


def infer_inputs(prompt: str, **knobs) -> list:
    """tritonclient inputs for the kiln model: the prompt plus any of its optional inputs."""
    import tritonclient.grpc as grpcclient

    types = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32),
             "top_p": ("FP32", np.float32), "top_k": ("INT32", np.int32), "seed": ("INT64", np.int64),
             "ignore_eos": ("BOOL", bool), "stream": ("BOOL", bool)}
    arrays = {"text_input": ("BYTES", np.array([prompt.encode()], dtype=np.object_))}
    arrays.update({k: (types[k][0], np.array([v], dtype=types[k][1])) for k, v in knobs.items()})
    inputs = []
    for name, (dtype, array) in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class Stream:
    """One gRPC bidirectional stream; responses and errors arrive in order on one queue."""
    url: str

    def __post_init__(self):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(self.url)
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        self.client.start_stream(callback=lambda result, error: self._inbox.put((result, error)))

    def send(self, request_id: str, prompt: str, model: str = MODEL, **knobs) -> None:
        self.client.async_stream_infer(model, infer_inputs(prompt, **knobs), request_id=request_id)

    def next(self, timeout: float = 30.0):
        """(request_id, response-or-None, error-or-None) of the next message."""
        result, error = self._inbox.get(timeout=timeout)
        if error is not None:
            return None, None, error
        return result.get_response().id, result, None

    def collect(self, n: int, timeout: float = 60.0) -> dict[str, list]:
        """Responses per request id until n requests have sent their final response."""
        out: dict[str, list] = {}
        done, deadline = 0, time.monotonic() + timeout
        while done < n:
            request_id, result, error = self.next(max(0.1, deadline - time.monotonic()))
            assert error is None, error
            out.setdefault(request_id, []).append(result)
            done += is_final(result)
        return out

    def close(self, cancel: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()


def is_final(result) -> bool:
    return result.as_numpy("finish_reason")[0] != b""


def text_of(results: list) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in results)


def token_ids_of(results: list) -> list[int]:
    return [int(t) for r in results for t in r.as_numpy("token_ids")]


def scrape(server, model: str = MODEL) -> dict[str, float]:
    """One model's kiln metrics from Triton's metrics port: 'name' -> value, and for the
    finished-requests counter also 'name:reason'."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(kiln_\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if labels.get("model") != model:
            continue
        values[name] = values.get(name, 0.0) + float(value)
        if "finish_reason" in labels:
            values[f"{name}:{labels['finish_reason']}"] = float(value)
    return values


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
