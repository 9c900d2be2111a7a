"""A GGUF's tokenizer -> tokenizer.json + tokenizer_config.json + chat_template.jinja.

transformers builds the fast tokenizer from the GGUF's `tokenizer.ggml.*` metadata (vocabulary,
merges, token types: control tokens become special added tokens, user-defined ones plain added
tokens) and carries `tokenizer.chat_template`, the bos/eos/pad/unk tokens and add_bos_token into
its config; kiln saves what it built.

NOTE: transformers' own GGUF path (`from_pretrained(gguf_file=...)`) reads the file with a reader
that imports torch, and rebuilds the whole model config only to learn the model_type. kiln reads
the metadata with its own reader, groups it as transformers does, and hands it to transformers'
torch-free converter (`convert_gguf_tokenizer`), so `kiln build` from a GGUF needs no torch. The
class is the one AutoTokenizer would pick for the model_type (its registered class, else
TokenizersBackend). tests/export/test_gguf_tokenizer_without_torch.py holds the result equal to
transformers' own path.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.compiler.export.gguf_reader import GGUFError, GGUFFile


def save_tokenizer(f: GGUFFile, model_type: str, out: Path) -> None:
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    if not f.get("tokenizer.ggml.tokens") or not f.get("tokenizer.ggml.model"):
        raise GGUFError(f"{f.path.name} has no tokenizer (tokenizer.ggml.model / .tokens): kiln needs one")
    cls = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    tok = _from_metadata(cls, f)
    tok.save_pretrained(str(out))
    _portable_class(out)
    _check_specials(f, out)


def _from_metadata(cls, f: GGUFFile):
    """`cls` built as transformers' `from_pretrained(gguf_file=...)` builds it, from kiln's reader."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    tokenizer_dict, tokenizer_config = _grouped_metadata(f, mapping.GGUF_TOKENIZER_MAPPING)
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # As transformers: llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_dict.get("tokenizer_type") == "gemma4":
        # As transformers: Gemma 4's chat template writes <bos> itself.
        tokenizer_config["add_bos_token"] = False
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = f.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    fast, extra = mapping.convert_gguf_tokenizer(str(f.get("general.architecture")), tokenizer_dict)
    return cls(tokenizer_object=fast, **tokenizer_config, **extra)


def _grouped_metadata(f: GGUFFile, groups: dict) -> tuple[dict, dict]:
    """transformers' grouping of `tokenizer.*` keys, with numeric arrays as lists, as its reader gives them."""
    grouped = {group: {name: _plain(f.get(f"tokenizer.{key}")) for key, name in renames.items()
                       if f.get(f"tokenizer.{key}") is not None}
               for group, renames in groups.items()}
    return grouped["tokenizer"], grouped["tokenizer_config"]


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


def _portable_class(out: Path) -> None:
    """transformers 5 names its generic fast tokenizer TokenizersBackend, a class transformers 4
    does not have; PreTrainedTokenizerFast is the same tokenizer under a name both versions load
    (5 maps it to TokenizersBackend), so the artifact's tokenizer opens in clients on either."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_specials(f: GGUFFile, out: Path) -> None:
    """The GGUF's own eos must be the artifact's: the server stops on it."""
    from kiln.tokenizer import Tokenizer

    eos = f.get("tokenizer.ggml.eos_token_id")
    if eos is not None and Tokenizer(out).eos_token_id != eos:
        raise GGUFError(f"{f.path.name}: the tokenizer built from it does not keep its eos token (id {eos})")
