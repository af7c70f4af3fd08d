"""TokenizerManager: the text side of one served model (never touches a device).

Owns: loading the model's (fast) tokenizer from a Hugging Face-format directory,
tokenizing prompts and chat messages (with the model's chat template), validating a
request's length against the context window, assigning request ids, building
per-sample incremental detokenizers, token display strings/bytes for logprobs, and
the score softmax (plain NumPy).

Invariants: nothing here imports jax; every validation failure is an `ApiError` (400)
that names the offending parameter.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from multiserve.server.detokenizer import IncrementalDetokenizer
from multiserve.server.errors import bad_request
from multiserve.server.protocol import CHAT_ROLES
from multiserve.server.tool_prompt import tools_as_text

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Margin on the characters one token can stand for (`chars_per_token_bound`): normalizers
# that merge characters (NFC/NFKC composition) make the text longer than the tokens' own.
PROMPT_CHARS_MARGIN = 2


def chars_per_token_bound(tokenizer: Any) -> int:
    """The most characters of prompt text one token can stand for: the longest vocabulary
    entry's spelling (a byte-level or sentencepiece spelling is at least as long as the
    text it encodes: one symbol per byte, or per character), times PROMPT_CHARS_MARGIN."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max(1, longest) * PROMPT_CHARS_MARGIN


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (printable stand-ins for raw bytes)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=False)}


class TokenizerManager:
    """Tokenizer, chat template and request-length rules for one served model."""

    def __init__(self, tokenizer_dir: str | Path, context_len: int, model_name: str, *,
                 default_max_tokens: int | None = None, tokenizer: Any = None,
                 chat_template: str | None = None) -> None:
        """`tokenizer`: an already loaded instance to share (the engine's own: one
        tokenizer per engine; the fast tokenizer's encode/decode are safe from several
        threads as long as nobody changes its truncation/padding settings, which nothing
        here does); else it is loaded from `tokenizer_dir`. `chat_template`: a Jinja
        template (text) that replaces the model's own (the shared tokenizer is not
        changed: the template is passed to every render)."""
        path = Path(tokenizer_dir)
        if tokenizer is None:
            from transformers import PreTrainedTokenizerFast  # tokenizers-backed: no torch

            if not path.is_dir():
                raise FileNotFoundError(f"tokenizer directory not found: {path}")
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        self.tokenizer: Any = tokenizer
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"{path}: need a fast (tokenizer.json) tokenizer")
        assert context_len > 0
        self.context_len = int(context_len)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        own = getattr(self.tokenizer, "chat_template", None)
        self.chat_template: str | None = chat_template or (own if isinstance(own, str) else None)
        self.has_chat_template = bool(self.chat_template)
        # A template that never reads `tools` gets the generic tool prompt (tool_prompt.py).
        self.template_reads_tools = bool(self.chat_template) and "tools" in self.chat_template
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)
        self.special_ids: frozenset[int] = frozenset(self.tokenizer.all_special_ids)
        self._byte_level = "ByteLevel" in type(self.tokenizer.backend_tokenizer.decoder).__name__
        self._token_cache: dict[int, tuple[str, bytes]] = {}
        # A prompt longer than this cannot fit the context whatever its text: refused
        # before it is tokenized (`check_prompt_chars`), so an oversized one costs no
        # tokenizing. Never refuses a prompt that fits (the engine checks the tokens).
        self.chars_per_token = chars_per_token_bound(self.tokenizer)
        self.max_prompt_chars = self.context_len * self.chars_per_token

    # ---- tokenize ---------------------------------------------------------------------
    def check_prompt_chars(self, chars: int, param: str) -> None:
        """400 naming `param` if a prompt of `chars` characters cannot fit the context
        (`max_prompt_chars`); call it before tokenizing or rendering the prompt."""
        if chars > self.max_prompt_chars:
            raise bad_request(
                f"{param}: {chars} characters is over this server's limit of "
                f"{self.max_prompt_chars} characters per prompt (a {self.context_len}-token "
                f"context x at most {self.chars_per_token} characters per token), so it "
                f"cannot fit the context; it was not tokenized", param=param,
                code="context_length_exceeded")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> str:
        """Validate OpenAI-style messages and render them with the chat template. `tools`
        (OpenAI tool objects) go to the template's `tools`; a template that does not read
        them gets them as the generic tool prompt, and history calls and tool results as
        text (tool_prompt.py)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise bad_request("messages: must be a non-empty list", param="messages")
        plain = [_plain_message(m, i) for i, m in enumerate(messages)]
        self.check_prompt_chars(sum(_message_chars(m) for m in plain)
                                + len(json.dumps(list(tools or ()))), "messages")
        if not self.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions",
                              param="messages")
        if self.template_reads_tools:
            if tools:
                template_kwargs["tools"] = list(tools)
        else:
            plain = tools_as_text(plain, list(tools or ()))
        try:
            return self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=self.chat_template, **template_kwargs)
        except Exception as exc:  # template errors (e.g. role order rules) are client errors
            raise bad_request(f"messages: chat template failed: {exc}",
                              param="messages") from None

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> list[int]:
        # The template already writes any BOS it wants: add no special tokens again.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools,
                                            **template_kwargs), add_special_tokens=False)

    # ---- budgets ----------------------------------------------------------------------
    def resolve_max_tokens(self, prompt_len: int, max_new_tokens: int | None,
                           param: str = "max_tokens") -> int:
        """The new-token budget of an OpenAI request: as given, or (None) the room the
        context leaves (capped by default_max_tokens). Checking it against the model
        (prompt + budget within the context) is the engine's (types.InvalidRequest)."""
        if max_new_tokens is None:
            room = max(self.context_len - prompt_len, 1)  # no room: the engine refuses
            return room if self.default_max_tokens is None else min(room,
                                                                    self.default_max_tokens)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise bad_request(f"{param}: must be an integer >= 0, got {max_new_tokens!r}",
                              param=param)
        return max_new_tokens

    @staticmethod
    def new_rid() -> str:
        return uuid.uuid4().hex

    # ---- detokenize -------------------------------------------------------------------
    def detokenizer(self, *, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] = (),
                    no_stop_trim: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, stop=stop,
                                      skip_special_tokens=skip_special_tokens,
                                      prompt_ids=prompt_ids, no_stop_trim=no_stop_trim)

    def token_info(self, token_id: int) -> tuple[str, bytes]:
        """(display string, raw bytes) of one token, for logprobs."""
        hit = self._token_cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        raw: bytes | None = None
        if piece is None:
            raw = b""
        elif token_id in self.special_ids or piece in self.tokenizer.get_added_vocab():
            raw = piece.encode("utf-8")
        elif self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                raw = bytes(table[c] for c in piece)
        else:
            m = _BYTE_FALLBACK.match(piece)
            if m:
                raw = bytes([int(m.group(1), 16)])
        if raw is None:
            raw = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        info = (raw.decode("utf-8", errors="replace"), raw)
        if len(self._token_cache) < 200_000:
            self._token_cache[token_id] = info
        return info

    def token_str(self, token_id: int) -> str:
        return self.token_info(token_id)[0]


def _message_chars(m: dict[str, Any]) -> int:
    return len(m["content"]) + sum(len(json.dumps(c)) for c in m.get("tool_calls", ()))


def _plain_message(m: Any, i: int) -> dict[str, Any]:
    """One message as {"role", "content"} with content flattened to a string, plus its
    `tool_calls` (arguments as objects: templates iterate them), `tool_call_id`, `name`
    and `reasoning_content` when given."""
    if hasattr(m, "model_dump"):
        m = m.model_dump(exclude_none=True)
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}]: must be an object", param=f"messages[{i}]")
    role = m.get("role")
    if role not in CHAT_ROLES:  # the template writes it into the prompt (protocol.ChatRole)
        raise bad_request(f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}; got "
                          f"{str(role)[:40]!r}", param=f"messages[{i}].role")
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if hasattr(part, "model_dump"):
                part = part.model_dump(exclude_none=True)
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported",
                                  param=f"messages[{i}].content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content: must be a string or a list of text parts",
                          param=f"messages[{i}].content")
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if m.get("tool_calls"):
        out["tool_calls"] = [_history_call(c, i, j) for j, c in enumerate(m["tool_calls"])]
    return out


def _history_call(call: Any, i: int, j: int) -> dict[str, Any]:
    """A history tool call with its arguments parsed from JSON text to an object."""
    param = f"messages[{i}].tool_calls[{j}].function.arguments"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls[{j}]: needs function.name",
                          param=f"messages[{i}].tool_calls[{j}]")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise bad_request(f"{param}: not valid JSON", param=param) from None
    if not isinstance(args, dict):
        raise bad_request(f"{param}: must be a JSON object", param=param)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def score_softmax(logprobs: Sequence[float], apply_softmax: bool) -> list[float]:
    """Label scores from label logprobs: softmax over the labels, or plain exp()."""
    x = np.asarray(list(logprobs), dtype=np.float64)
    if x.size == 0:
        return []
    if not apply_softmax:
        return [float(v) for v in np.exp(x)]
    finite = np.isfinite(x)
    if not finite.any():
        return [1.0 / x.size] * x.size
    z = np.where(finite, x - x[finite].max(), -np.inf)
    e = np.exp(z)
    return [float(v) for v in e / e.sum()]
