"""<think> blocks into reasoning_content (kiln/serving/openai/reasoning.py): whole and streamed agree,
the block opens in the reply or in the prompt, and a reply without one is all content."""

from __future__ import annotations

import pytest

from kiln.serving.openai.reasoning import ReasoningStream, prompt_opens_block, split_reasoning, template_reasons


@pytest.mark.parametrize("reply, opened, expected", [
    ("<think>a plan</think>\n\nThe answer.", False, ("a plan", "The answer.")),
    ("a plan</think>The answer.", True, ("a plan", "The answer.")),          # the prompt opened it
    ("still thinking", True, ("still thinking", "")),                        # cut before </think>
    ("The answer.", False, (None, "The answer.")),
    ("  <thinker> is a word", False, (None, "  <thinker> is a word")),
])
def test_whole_and_streamed_agree(reply, opened, expected):
    assert split_reasoning(reply, opened) == expected
    for step in (1, 2, 5):
        stream = ReasoningStream(opened)
        events = [e for i in range(0, len(reply), step) for e in stream.feed(reply[i:i + step])] + stream.finish()
        reasoning = "".join(t for k, t in events if k == "reasoning") or None
        assert (reasoning, "".join(t for k, t in events if k == "content")) == expected, step


def test_templates_and_prompts():
    assert template_reasons("{% if t %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}")
    assert not template_reasons("<|im_start|>assistant\n")
    assert prompt_opens_block("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n")
