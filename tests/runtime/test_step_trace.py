"""The engine core's debug step trace (`kiln serve --log-level debug`): one line per step, engine
time inside the step's own time."""

import logging
import re

from kiln import LLM, RuntimeConfig, SamplingParams

STEP = re.compile(r"step: (\d+) decodes, (\d+) prefill tokens \(budget \d+\): "
                  r"engine ([\d.]+) ms, own ([\d.]+) ms, cycle ([\d.]+) ms")


def test_every_step_after_the_first_is_traced_with_its_engine_time(tiny_llama_artifact, caplog):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20))
    with caplog.at_level(logging.DEBUG, logger="kiln"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    steps = [STEP.search(r.getMessage()) for r in caplog.records]
    steps = [tuple(float(x) for x in m.groups()) for m in steps if m]
    # A step is traced when the next one starts: the prefill and four of the five decodes.
    assert len(steps) >= 4 and steps[0][1] == 3 and all(d == 1 and p == 0 for d, p, *_ in steps[1:])
    assert all(0 < engine <= own <= cycle for *_, engine, own, cycle in steps)
    llm.shutdown()
