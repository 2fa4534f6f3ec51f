"""Text <-> token ids, and the chat template, for a Hugging Face-format model directory.

A tokenizer is optional: engines take token ids, and a model directory without
`tokenizer.json` still serves `/generate` and token-id completions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

# Qwen's ChatML template, reduced to roles and text (no tools section yet).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BYTE_LEVEL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        self._template = (
            ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
                chat_template
            )
            if chat_template
            else None
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it has no `tokenizer.json`."""
        path = Path(model_dir)
        if not (path / "tokenizer.json").exists():
            return None
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            config = json.loads((path / "tokenizer_config.json").read_text())
        return cls(
            HFTokenizer.from_file(str(path / "tokenizer.json")),
            chat_template=config.get("chat_template"),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # A model's vocabulary is often larger than its tokenizer's; ids beyond it decode to "".
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            raise_exception=_raise_template_error,
        )


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """OpenAI semantics: the text ends before the first stop string. Returns (text, stopped)."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class IncrementalDecoder:
    """Text of a growing token sequence, piece by piece, for streaming.

    Each push decodes only the tokens since the last complete piece plus the tokens before them
    (the prefix/read offsets of Hugging Face's and vLLM's streamers), so streaming costs O(n), not
    O(n^2). Text that could still turn into a stop string is held back, and a stop string is never
    emitted: the streamed pieces add up to what the non-streamed response returns.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tok, self._stop = tokenizer, tuple(stop)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # token offsets: context start, end of decoded text
        self._text = ""  # all text decoded so far
        self._emitted = 0
        self.stopped = False

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self._ids += ids
        before = self._tok.decode(self._ids[self._prefix : self._read])
        now = self._tok.decode(self._ids[self._prefix :])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self._text += now[len(before) :]  # a half multi-byte character waits for the rest
            self._prefix, self._read = self._read, len(self._ids)
        longest = max((len(s) for s in self._stop), default=1)
        start = max(0, self._emitted - longest)
        tail, self.stopped = cut_at_stop(self._text[start:], self._stop)
        self._text = self._text[:start] + tail
        hold = 0 if final or self.stopped else longest - 1
        end = max(self._emitted, len(self._text) - hold)
        piece, self._emitted = self._text[self._emitted : end], end
        return piece


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):  # older files store AddedToken dicts
        token = token.get("content")
    return token if isinstance(token, str) else None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def build_byte_level_tokenizer() -> HFTokenizer:
    """A 256-symbol byte-level tokenizer plus ChatML special tokens: any text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_LEVEL_SPECIAL_TOKENS))
    return tok


def write_byte_level_tokenizer(model_dir: str | Path, model_max_length: int) -> HFTokenizer:
    """Write `tokenizer.json` and `tokenizer_config.json` that `transformers` can load too."""
    path = Path(model_dir)
    tok = build_byte_level_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok
