import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.stop_strings import StopMatcher

CORPUS = [
    "héllo wörld 你好 🙂",
    "hello world, hello there",
    "the quick brown fox jumps over the lazy dog",
    "Grüße aus Köln 🙂🙃",
    "你好，世界！你好吗？",
    "STOP here. stop there.\n\nUser: hi",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


@functools.cache
def tokenizer() -> Tokenizer:
    """A deterministic byte-level BPE tokenizer (GPT-2 style) trained on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@functools.cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's byte → printable character map, which byte-level BPE tokens are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_ids(text: str) -> list[int]:
    """One token per UTF-8 byte: forces multi-byte characters to split across tokens."""
    return [tokenizer().token_to_id(byte_to_char()[b]) for b in text.encode()]


def encode(text: str) -> list[int]:
    return tokenizer().encode(text).ids


def stream(ids, chunks=None, prompt=(), **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids in chunks of the given sizes (one at a time by default); the last delta is finish()'s."""
    detok = IncrementalDetokenizer(tokenizer(), list(prompt), **kwargs)
    deltas, position = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.step(ids[position:position + size]))
        position += size
    deltas.append(detok.finish())
    return deltas, detok


def decode(ids, skip_special_tokens=True) -> str:
    return tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


# ---- streaming equals full decoding ----

def chunked_ids():
    vocab = tokenizer().get_vocab_size()
    return st.lists(st.integers(0, vocab - 1), max_size=40).flatmap(
        lambda ids: st.tuples(st.just(ids), st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids))))


@settings(max_examples=300, deadline=None)
@given(case=chunked_ids(), skip=st.booleans(), prompt=st.sampled_from(["", "héllo", "你好 🙂 "]))
def test_streamed_deltas_concatenate_to_the_full_decode(case, skip, prompt):
    ids, sizes = case
    chunks = _trim(sizes, len(ids))
    deltas, detok = stream(ids, chunks, prompt=encode(prompt), skip_special_tokens=skip)
    full = decode(ids, skip)
    assert "".join(deltas) == full == detok.output_text
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def _trim(sizes: list[int], total: int) -> list[int]:
    chunks, used = [], 0
    for size in sizes:
        if used >= total:
            break
        chunks.append(min(size, total - used))
        used += chunks[-1]
    return chunks


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="aé你🙂 \n", max_size=30))
def test_byte_split_text_streams_whole_characters(text):
    deltas, _ = stream(byte_ids(text))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_across_tokens_is_emitted_whole():
    deltas, _ = stream(byte_ids("a🙂b"))
    assert deltas == ["a", "", "", "", "🙂", "b", ""]


def test_incomplete_character_is_flushed_by_finish():
    deltas, _ = stream(byte_ids("你")[:2])
    assert deltas == ["", "", "\ufffd"] and decode(byte_ids("你")[:2]) == "\ufffd"


def test_skip_special_tokens_is_honoured():
    ids = encode("hi") + [tokenizer().token_to_id("<|endoftext|>")] + encode(" there")
    assert "".join(stream(ids)[0]) == "hi there"
    assert "".join(stream(ids, skip_special_tokens=False)[0]) == "hi<|endoftext|> there"


def test_prompt_context_does_not_leak_into_the_output():
    deltas, _ = stream(encode(" world"), prompt=encode("<|im_start|>hello"))
    assert "".join(deltas) == " world"


# ---- stop strings ----

def test_stop_string_and_everything_after_are_removed():
    deltas, detok = stream(encode("hello world. STOP more text"), stop=("STOP",))
    assert "".join(deltas) == detok.output_text == "hello world. "
    assert detok.stopped and detok.stop_reason == "STOP"


def test_stop_string_split_across_tokens_is_caught():
    deltas, detok = stream(byte_ids("ab\n\ncd"), stop=("\n\n",))
    assert deltas == ["a", "b", "", "", "", "", ""]
    assert detok.stop_reason == "\n\n" and detok.output_text == "ab"


def test_possible_stop_start_is_held_then_released():
    detok = IncrementalDetokenizer(tokenizer(), [], stop=("\n\n",))
    assert detok.step(byte_ids("a\n")) == "a"
    assert detok.step(byte_ids("b")) == "\nb"
    assert detok.finish() == "" and not detok.stopped


def test_held_stop_prefix_is_flushed_by_finish():
    deltas, detok = stream(byte_ids("ab\n"), stop=("\n\n",))
    assert deltas == ["a", "b", "", "\n"] and not detok.stopped


def test_stop_inside_an_unfinished_character_window_is_caught_early():
    # "STOP" arrives together with half of an emoji: the stop is found without waiting.
    ids = byte_ids("xSTOP") + byte_ids("🙂")[:2]
    deltas, detok = stream(ids, [len(ids)], stop=("STOP",))
    assert detok.stopped and deltas == ["x", ""]


def test_first_completed_stop_wins():
    deltas, detok = stream(encode("xabc"), [len(encode("xabc"))], stop=("bc", "xab"))
    assert detok.stop_reason == "xab" and "".join(deltas) == ""


def test_steps_after_a_stop_emit_nothing():
    detok = IncrementalDetokenizer(tokenizer(), [], stop=("STOP",))
    detok.step(encode("hello STOP"))
    assert detok.step(encode(" more")) == "" and detok.finish() == ""
    assert detok.output_text == "hello "


def first_stop_cut(text: str, stops: tuple[str, ...]) -> int:
    """Where a character-by-character scan would cut: at the stop that completes first."""
    for end in range(len(text) + 1):
        starts = [end - len(stop) for stop in stops if text[:end].endswith(stop)]
        if starts:
            return min(starts)
    return len(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab你🙂 \n.", max_size=25), data=st.data())
def test_stop_cut_is_independent_of_tokenization(text, data):
    stops = tuple(data.draw(st.lists(st.text(alphabet="ab你🙂 \n.", min_size=1, max_size=4), min_size=1, max_size=3)))
    ids = data.draw(st.sampled_from([encode(text), byte_ids(text)]))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    deltas, detok = stream(ids, _trim(sizes, len(ids)), stop=stops)
    cut = first_stop_cut(text, stops)
    assert "".join(deltas) == detok.output_text == text[:cut]
    assert detok.stopped == (cut < len(text))


# ---- the matcher on its own ----

@pytest.mark.parametrize("text, held", [("abc", 0), ("ab\n", 1), ("User", 4), ("Us", 2), ("xUse", 3), ("", 0)])
def test_partial_stop_length(text, held):
    assert StopMatcher(("\n\n", "User:")).partial_len(text) == held
