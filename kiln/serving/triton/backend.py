"""Triton python-backend model: kiln's engine core in-process, decoupled (streaming) responses.

The rendered model.py re-exports TritonPythonModel from here. Triton may call execute() with
requests at any time; each is parsed, tokenized and submitted to the LLM's engine client (the
one loop every front end uses), and execute() returns at once. The client's thread answers
through the request's response sender, so all concurrent requests of an instance share one
in-flight batch.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

import triton_python_backend_utils as pb_utils

from kiln.contract.manifest import MANIFEST, ArtifactError, sha256_file
from kiln.runtime.llm import LLM
from kiln.runtime.outputs import StreamDelta
from kiln.serving.triton.metrics import TritonMetrics
from kiln.serving.triton.requests import Reply, ReplyBuilder, parse_request
from kiln.serving.triton.settings import BackendSettings, model_config_parameters

log = logging.getLogger("kiln.triton")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the kiln model must be decoupled; re-render it with kiln triton-repo")
        self.settings = BackendSettings.from_parameters(model_config_parameters(config))
        _check_rendered_from(self.settings)
        self.llm = LLM(self.settings.artifact_path, self.settings.runtime_config())
        self.client = self.llm.client
        plan = self.client.snapshot.kv_plan
        pb_utils.Logger.log_info(f"kiln: {args['model_instance_name']}: {plan.describe()}")
        labels = {"model": args["model_name"], "version": args["model_version"],
                  "instance": args["model_instance_name"]}
        self.metrics = TritonMetrics(pb_utils, labels)
        self.client.step_listeners.append(self.metrics.observe_step)
        self.client.snapshot_listeners.append(self.metrics.publish)

    def execute(self, requests) -> None:
        for request in requests:
            self._accept(request)
        return None

    def _accept(self, request) -> None:
        sender = request.get_response_sender()
        try:
            generate = parse_request(lambda name: _input_array(request, name))
            if self.client.backlog() >= self.settings.max_queue:
                _send_error(sender, f"kiln's queue is full ({self.settings.max_queue} waiting); retry later",
                            "UNAVAILABLE")
                return
            kiln_request = self.llm.make_request(generate.prompt, generate.params)
        except ValueError as e:
            _send_error(sender, str(e), "INVALID_ARG")
            return
        sink = TritonSink(request, sender, ReplyBuilder(generate.stream), self._batch_size)
        self.client.submit(kiln_request, sink)

    def _batch_size(self) -> int:
        """The last step's batch size (read on the engine thread, right after that step)."""
        return self.client.last_step.batch_size

    def finalize(self) -> None:
        self.llm.shutdown()
        self.metrics.close()


class TritonSink:
    """One request's response sender, as the engine client sees it (kiln.runtime.sinks.Sink)."""

    def __init__(self, request, sender, builder: ReplyBuilder, batch_size: Callable[[], int]):
        self._request, self._sender, self._builder = request, sender, builder
        self._batch_size = batch_size

    def deliver(self, delta: StreamDelta) -> None:
        if self.cancelled():
            if delta.finished:
                self._close_cancelled()
            return
        reply = self._builder.on_delta(delta, self._batch_size())
        if reply is not None:
            self._sender.send(_response(reply), flags=FINAL if reply.final else 0)

    def fail(self, error: Exception) -> None:
        code = "INVALID_ARG" if isinstance(error, ValueError) else "INTERNAL"
        _send_error(self._sender, str(error), code)

    def cancelled(self) -> bool:
        return self._request.is_cancelled()

    def _close_cancelled(self) -> None:
        try:                            # Triton expects the final flag even for a cancelled request
            self._sender.send(flags=FINAL)
        except Exception as e:
            log.debug("final flag after cancellation not sent: %s", e)


def _input_array(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _response(reply: Reply):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array)
                                                      for name, array in reply.arrays().items()])


def _send_error(sender, message: str, code: str) -> None:
    error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)


def _check_rendered_from(settings: BackendSettings) -> None:
    """The repository was filled from one manifest; refuse to serve an artifact rebuilt since."""
    manifest = settings.artifact_path / MANIFEST
    if not manifest.is_file():
        raise ArtifactError(f"{settings.artifact_path} has no {MANIFEST}; "
                            "point kiln triton-repo at a built artifact and re-render the repository")
    if sha256_file(manifest) != settings.manifest_sha256:
        raise ArtifactError(f"{settings.artifact_path} changed since this repository was rendered; "
                            "re-run kiln triton-repo")
