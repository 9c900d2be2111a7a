"""A GGUF's own tokenizer comes along: its chat template, its bos/eos/pad tokens and its control
tokens, for a byte-level BPE (gpt2-type, as Llama 3 / Qwen files have) and a sentencepiece vocabulary
(llama-type, as Gemma files have)."""

from __future__ import annotations

import pytest

from gguf_writing import write_gguf
from kiln.compiler.export.gguf_reader import GGUFError
from kiln.compiler.export.sources import load_source
from kiln.tokenizer import Tokenizer

CASES = {"byte-level": ("qwen2", "<|im_start|>", "<|im_end|>", "<|endoftext|>"),
         "sentencepiece": ("gemma3", "<bos>", "<eos>", "<pad>")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            written = write_gguf(CASES[case][0], tmp_path_factory.mktemp(case))
            made[case] = written, load_source(str(written.path))
        return made[case]
    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_chat_template_and_special_tokens_come_from_the_gguf(sources, case):
    written, src = sources(case)
    meta, (_, bos, eos, pad) = written.tokenizer, CASES[case]
    tok = Tokenizer(src.tokenizer_dir)
    assert tok.chat_template == meta["template"]
    assert (tok.bos_token, tok.eos_token, tok.config.get("pad_token")) == (bos, eos, pad)
    assert tok.eos_token_id == meta["eos"] and tok.fast.token_to_id(bos) == meta["bos"]
    assert tok.vocab_size == len(meta["tokens"]) == src.spec.vocab_size


@pytest.mark.parametrize("case", sorted(CASES))
def test_control_tokens_stay_whole_and_bos_follows_the_file(sources, case):
    written, src = sources(case)
    meta, tok = written.tokenizer, Tokenizer(src.tokenizer_dir)
    control = [t for t, kind in zip(meta["tokens"], meta["types"]) if kind == 3]
    for token in control:
        assert tok.encode(token, add_special_tokens=False) == [meta["tokens"].index(token)]
    ids = tok.encode("the cat")
    assert (ids[0] == meta["bos"]) is meta["add_bos"]
    turn = "<start_of_turn>" if case == "sentencepiece" else "<|im_start|>"
    opening = [meta["bos"]] * meta["add_bos"] + [meta["tokens"].index(turn)]   # the template writes <bos> itself
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[:len(opening)] == opening


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_tokens_as_transformers_autotokenizer(sources, case):
    """kiln picks the tokenizer class itself (skipping AutoTokenizer's slow config rebuild): same result."""
    from transformers import AutoTokenizer

    written, src = sources(case)
    reference = AutoTokenizer.from_pretrained(str(written.path.parent), gguf_file=written.path.name)
    text = "the heat in the tin <start_of_turn> <|im_end|> Zq!"
    assert Tokenizer(src.tokenizer_dir).encode(text) == reference(text)["input_ids"]


def test_gguf_without_a_tokenizer_is_refused(tmp_path):
    written = write_gguf("llama", tmp_path, with_tokenizer=False)
    with pytest.raises(GGUFError, match="has no tokenizer"):
        load_source(str(written.path))


def test_the_gguf_end_of_turn_token_ends_generation_too(tmp_path):
    """An instruct GGUF states its end-of-turn id beside eos; the artifact stops on both."""
    import json

    from kiln.compiler.build import build
    from kiln.config import BuildConfig

    written = write_gguf("gemma3", tmp_path / "src", eot_token_id=3)
    out = build(BuildConfig(source=str(written.path), out=tmp_path / "art", backend="ort"))
    eos = json.loads((out / "manifest.json").read_text())["generation"]["eos_token_ids"]
    assert eos == [written.tokenizer["eos"], 3]


def test_the_tokenizer_class_is_one_transformers_4_loads_too(tmp_path):
    """transformers 5's generic class (TokenizersBackend) is unknown to transformers 4, which
    clients such as AIPerf run: the artifact names it PreTrainedTokenizerFast, as both load."""
    import json

    from transformers import AutoTokenizer

    src = load_source(str(write_gguf("llama", tmp_path).path))
    config = json.loads((src.tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    reloaded = AutoTokenizer.from_pretrained(str(src.tokenizer_dir))
    assert reloaded("the cat <|im_end|>")["input_ids"] == Tokenizer(src.tokenizer_dir).encode("the cat <|im_end|>")
