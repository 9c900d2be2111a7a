"""The runtime's tokenizer: a `tokenizers` fast tokenizer plus the model's chat template (jinja2).

Needs no transformers: the artifact ships tokenizer.json and the template.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


class Tokenizer:
    def __init__(self, folder: Path):
        folder = Path(folder)
        self.fast = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        self.config = _read_json(folder / "tokenizer_config.json")
        self.chat_template = _chat_template(folder, self.config)
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token_id = self.fast.token_to_id(self.eos_token) if self.eos_token else None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     tools=tools)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The template already writes any special tokens it wants.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _chat_template(folder: Path, config: dict) -> str | None:
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    return config.get("chat_template")
