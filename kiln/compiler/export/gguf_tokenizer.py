"""A GGUF's tokenizer -> tokenizer.json + tokenizer_config.json + chat_template.jinja.

transformers builds the fast tokenizer from the GGUF's `tokenizer.ggml.*` metadata (vocabulary,
merges, token types: control tokens become special added tokens, user-defined ones plain added
tokens) and carries `tokenizer.chat_template`, the bos/eos/pad/unk tokens and add_bos_token into
its config; kiln saves what it built.

NOTE: AutoTokenizer would first rebuild the whole model config from the file with the `gguf`
package's reader (10 s for SmolLM2's 49k-token vocabulary, and the loop that never ends on a hostile
file) only to learn the model_type. kiln knows the model_type already, so it picks the class
AutoTokenizer would pick for it (its registered class, else TokenizersBackend) and builds that.
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
    tok = cls.from_pretrained(str(f.path.parent), gguf_file=f.path.name)
    tok.save_pretrained(str(out))
    _portable_class(out)
    _check_specials(f, out)


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
