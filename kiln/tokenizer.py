"""The runtime's tokenizer: a `tokenizers` fast tokenizer plus the model's chat template (jinja2).

Needs no transformers: the artifact ships tokenizer.json and the template.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from functools import cached_property
from pathlib import Path

from jinja2.ext import loopcontrols
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
        self._template = _compile(self.chat_template) if self.chat_template else None
        self._folder = folder
        self.special_tokens = tuple(t.content for t in self.fast.get_added_tokens_decoder().values()
                                    if t.special)

    # NOTE: what only some requests need is made on first use, not at load: each costs a pass over
    # tokenizer.json (a tenth of a second or more), and a server start waits for all of them.
    # Made twice by two threads at once, the results are equal: no lock.
    @cached_property
    def _text_only(self) -> FastTokenizer:
        """Message text is tokenized with special-token matching off (a second instance: the flag
        is the tokenizer's own state, and requests are tokenized on several threads)."""
        text_only = FastTokenizer.from_file(str(self._folder / "tokenizer.json"))
        text_only.encode_special_tokens = True
        return text_only

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: a prompt of n characters is at least
        n / max_token_chars tokens, a bound the server checks before it tokenizes anything."""
        return max((len(t) for t in self.fast.get_vocab()), default=1) or 1

    @cached_property
    def _byte_level(self) -> bool:
        return _decodes_byte_level(self._folder / "tokenizer.json")

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja text) instead of the artifact's (kiln serve --chat-template)."""
        self._template = _compile(template)
        self.chat_template = template

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for, from its vocabulary piece: a token holding part of a
        UTF-8 character gives that part (decoded alone it would be U+FFFD). Byte-level BPE maps
        bytes to printable characters (GPT-2's table); SentencePiece writes a byte as <0xNN> and a
        space as U+2581."""
        piece = self.fast.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            except KeyError:            # an added token written as plain text
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """template_kwargs: extra template variables (vLLM's chat_template_kwargs, e.g. Qwen3's
        enable_thinking); they cannot replace the variables set here."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        fixed = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools)
        clash = sorted(set(template_kwargs or ()) & set(fixed))
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(clash)}")
        return self._template.render(**(template_kwargs or {}), **fixed)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    control_tokens_in_messages: bool = False, template_kwargs: dict | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """The rendered chat as token ids. The template writes its own special tokens; every
        string the client supplied (message text, tool call ids, tool definitions, template
        kwargs) is tokenized as text, so a user typing `<|im_end|>` anywhere cannot end their turn
        and open a system one (control_tokens_in_messages=True: the messages' special-token text is
        parsed, the old way; tools and template kwargs stay text)."""
        inputs = _ClientInputs(messages, tools, template_kwargs, messages_are_text=not control_tokens_in_messages)
        rendered = self._render(inputs, add_generation_prompt)
        if not any(self._holds_special_text(t) for t in inputs.texts()):
            return self.encode(rendered, add_special_tokens=False)
        return self._encode_with_text_spans(inputs, rendered, add_generation_prompt)

    def _render(self, inputs: _ClientInputs, add_generation_prompt: bool) -> str:
        return self.apply_chat_template(inputs.messages, add_generation_prompt, tools=inputs.tools,
                                        template_kwargs=inputs.template_kwargs)

    def _holds_special_text(self, text: str) -> bool:
        """A special token inside the text, or a piece of one at either end (two texts rendered
        side by side could complete it: "...<|im_" + "end|>...")."""
        pattern, heads, tails, longest = self._special_pieces
        if pattern is None:
            return False
        if pattern.search(text):
            return True
        ends = range(2, min(longest, len(text) + 1))
        return any(text[-n:] in heads or text[:n] in tails for n in ends)

    @cached_property
    def _special_pieces(self):
        """(a pattern finding any special token, their proper heads and tails of 2 characters or
        more, the longest token's length): one scan and a few set lookups per client string,
        however many special tokens the vocabulary has (Llama 3 has hundreds), since a request
        with many tools has many strings."""
        tokens = [t for t in self.special_tokens if t]
        if not tokens:
            return None, frozenset(), frozenset(), 0
        pattern = re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))
        heads = frozenset(t[:n] for t in tokens for n in range(2, len(t)))
        tails = frozenset(t[-n:] for t in tokens for n in range(2, len(t)))
        return pattern, heads, tails, max(map(len, tokens))

    def _encode_with_text_spans(self, inputs: _ClientInputs, rendered: str, add_generation_prompt: bool) -> list[int]:
        # Render again with each client string that holds special-token text replaced by a random
        # placeholder (the others stay, so the template sees them as they are), then tokenize the
        # template's pieces as before and the hidden strings with special tokens off. A hidden
        # string is found in the real render as it is or JSON-escaped (a template writes tool
        # definitions with tojson); a template that renders it any other way (and so looks
        # inside it) is refused, since its markers cannot be told from the client's text.
        nonce = secrets.token_hex(16)
        texts: list[str] = []

        def hide(text: str) -> str:
            if not self._holds_special_text(text):
                return text               # nothing to keep apart: rendered and tokenized as before
            texts.append(text)
            return f"kiln{nonce}x{len(texts) - 1}x"

        masked = self._render(inputs.mapped(hide), add_generation_prompt)
        pieces = masked.split(f"kiln{nonce}x")
        if not rendered.startswith(pieces[0]):
            raise _cannot_keep_apart()
        ids, pos = self.encode(pieces[0], add_special_tokens=False), len(pieces[0])
        for piece in pieces[1:]:
            index, sep, rest = piece.partition("x")
            if not (sep and index.isdigit() and int(index) < len(texts)):
                raise _cannot_keep_apart()
            text = texts[int(index)]
            form = next((f for f in (text, _json_escaped(text)) if rendered.startswith(f + rest, pos)), None)
            if form is None:
                raise _cannot_keep_apart()
            ids += self._text_only.encode(form, add_special_tokens=False).ids
            ids += self.encode(rest, add_special_tokens=False)
            pos += len(form) + len(rest)
        if pos != len(rendered):
            raise _cannot_keep_apart()
        return ids


def _cannot_keep_apart() -> ChatTemplateError:
    return ChatTemplateError("the request holds special-token text that this model's chat template "
                             "cannot keep apart from its own markers")


def _json_escaped(text: str) -> str:
    """The text as it appears inside a JSON string written by the template's tojson."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _ClientInputs:
    """Everything a chat request gives the template: messages, tools and template kwargs. Every
    string in them is the client's, except a message's role (a closed set the request model
    checks), which the template branches on."""

    def __init__(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None,
                 messages_are_text: bool = True):
        self.messages, self.tools, self.template_kwargs = messages, tools, template_kwargs
        self.messages_are_text = messages_are_text     # False: --allow-control-tokens-in-messages

    def texts(self):
        yield from _client_strings([self.messages if self.messages_are_text else None, self.tools,
                                    self.template_kwargs])

    def mapped(self, fn) -> _ClientInputs:
        messages = _map_client_strings(self.messages, fn) if self.messages_are_text else self.messages
        return _ClientInputs(messages, _map_client_strings(self.tools, fn),
                             _map_client_strings(self.template_kwargs, fn), self.messages_are_text)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {b: chr(c) for b, c in chars.items()}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _decodes_byte_level(path: Path) -> bool:
    decoder = (_read_json(path).get("decoder") or {})
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or [] if isinstance(d, dict)]
    return "ByteLevel" in kinds


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: key order kept, no HTML escaping (Jinja's own tojson does both, so
    # a prompt with tools would differ from the one the model was trained on).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(template: str):
    """The template in the environment transformers' apply_chat_template renders it in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


# A message's role is the one client string the template branches on, from a closed set the
# request model checks; it is left as it is. Every other string, dict keys included (a tool's
# parameter names reach the prompt through tojson), is the client's text.
_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def _structural(key, value: str) -> bool:
    return key == "role" and value in _ROLES


def _client_strings(value, key: str | None = None):
    if isinstance(value, str):
        if not _structural(key, value):
            yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield k
            yield from _client_strings(v, k)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _client_strings(v, key)


def _map_client_strings(value, fn, key: str | None = None):
    if isinstance(value, str):
        return value if _structural(key, value) else fn(value)
    if isinstance(value, dict):
        return {(fn(k) if isinstance(k, str) else k): _map_client_strings(v, fn, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_client_strings(v, fn, key) for v in value]
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _chat_template(folder: Path, config: dict) -> str | None:
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    return config.get("chat_template")
