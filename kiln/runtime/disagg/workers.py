"""The two worker processes: each loads the artifact into its own engine core and serves one role
over a pipe. Messages are tuples; every request ends with exactly one reply about it.

prefill worker   ("prefill", request_id, prompt_ids, params)
                   -> ("handover", Handover)                 the prompt's KV and first token
                   -> ("done", request_id, tokens, reason, times)   the first token ended it (EOS, max_tokens 1)
decode worker    ("decode", Handover, params)  -> ("done", request_id, tokens, reason, times)
both             ("abort", request_id) -> ("done", request_id, tokens, "abort", times) if it was there
                 ("stats",) -> ("stats", free_blocks, total_blocks, unfinished)
                 ("stop",)
A request that cannot run ends with ("done", request_id, [], "error: ...", []). `times`: the
monotonic clock (one per machine) when the worker's step produced each token. A handover the
decode worker cannot take (handover.check_handover: a segment outside its session, a shape that is
not its pool's layout, a short segment) is such a request: the worker goes on serving.
"""

from __future__ import annotations

from kiln.runtime.disagg.handover import (SEGMENT_PREFIX, Handover, check_handover, discard, export_blocks,
                                          import_blocks, owned_segment, pool_of)
from kiln.runtime.request import RequestStatus


def worker_main(role: str, artifact, config, conn, prefix: str = SEGMENT_PREFIX) -> None:
    """prefix: the session's segment-name prefix (handover.session_prefix)."""
    from kiln.runtime.llm import LLM

    llm = LLM(artifact, config)
    worker = (PrefillWorker if role == "prefill" else DecodeWorker)(llm, prefix)
    conn.send(("ready",))
    while True:
        if not llm.core.has_unfinished() or conn.poll():
            message = conn.recv()
            if message[0] == "stop":
                return
            for reply in worker.handle(message):
                conn.send(reply)
        if llm.core.has_unfinished():
            for reply in worker.step():
                conn.send(reply)


class Worker:
    def __init__(self, llm, prefix: str = SEGMENT_PREFIX):
        self.llm, self.core, self.prefix = llm, llm.core, prefix

    def handle(self, message):
        kind = message[0]
        if kind == "abort":
            request = self.core.scheduler.get_request(message[1])
            if request is None:
                return []
            self.core.abort(message[1])
            return [("done", message[1], list(request.output_token_ids), "abort", list(request.timings.token_times))]
        if kind == "stats":
            kv = self.core.kv
            return [("stats", kv.num_free_blocks, kv.num_blocks, self.core.has_unfinished())]
        return self.start(message)

    def step(self):
        replies = []
        for delta in self.core.step():
            replies += self.progressed(delta.request)
        return replies

    def _add(self, request) -> list:
        try:
            self.core.add_request(request)
        except ValueError as e:
            return [("done", request.request_id, [], f"error: {e}", [])]
        return []

    @staticmethod
    def _done(request) -> tuple:
        return ("done", request.request_id, list(request.output_token_ids), request.finish_reason,
                list(request.timings.token_times))


class PrefillWorker(Worker):
    def start(self, message):
        _, request_id, prompt_ids, params = message
        return self._add(self.llm.make_request(list(prompt_ids), params, request_id))

    def progressed(self, request):
        """The first token is in: the request is done here, or its blocks go to the decode side."""
        if request.is_finished:
            return [self._done(request)]
        n = request.num_prompt_tokens
        blocks = self.core.kv.block_table(request.request_id)[:-(-n // self.core.kv.block_size)]
        handover = export_blocks(self.core.engine, blocks, request.request_id, request.prompt_token_ids,
                                 request.output_token_ids[0], self.prefix)
        self.core.abort(request.request_id)              # its blocks are free at once
        return [("handover", handover)]


class DecodeWorker(Worker):
    def start(self, message):
        _, handover, params = message
        problem = check_handover(handover, pool_of(self.core.engine), self.core.kv.block_size,
                                 self.llm.artifact.manifest.spec.vocab_size, self.prefix)
        if problem is not None:
            if isinstance(handover, Handover) and owned_segment(handover.segment, self.prefix):
                discard(handover)
            return [("done", getattr(handover, "request_id", None), [], f"error: bad handover: {problem}", [])]
        request = self.llm.make_request(list(handover.prompt_ids), params, handover.request_id)
        refused = self._add(request)
        if refused:
            discard(handover)
            return refused
        try:
            admitted = self._admit_prefilled(request, handover)
        except (ValueError, TypeError) as e:          # the segment does not hold what the handover says
            admitted, reason = False, f"error: bad handover: {e}"
        else:
            reason = "error: no free KV blocks for the handed-over prompt"
        if not admitted:
            discard(handover)
            self.core.finish(request.request_id, RequestStatus.FINISHED_ABORTED)
            return [("done", request.request_id, [], reason, [])]
        return []

    def _admit_prefilled(self, request, handover: Handover) -> bool:
        """Take the request out of the waiting queue as running, its prompt computed from the
        handed-over blocks and its first token appended: its next step is a decode."""
        sched, kv, n = self.core.scheduler, self.core.kv, request.num_prompt_tokens
        if not kv.allocate_slots(request, n):
            return False
        try:
            import_blocks(self.core.engine, kv.block_table(request.request_id)[:handover.num_blocks], handover)
        except FileNotFoundError:            # the coordinator gave up on it (a worker failed)
            return False
        sched.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = n
        request.append_output_token(handover.first_token)
        sched.running.append(request)
        return True

    def progressed(self, request):
        return [self._done(request)] if request.is_finished else []
