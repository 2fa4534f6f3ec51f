"""Text <-> token ids, and the chat template, for a Hugging Face-format model directory.

A tokenizer is optional: engines take token ids, and a model directory without
`tokenizer.json` still serves `/generate` and token-id completions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2.ext
import jinja2.meta
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

# Qwen's ChatML template, reduced to roles and text: the tools go in the system message as text.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Private-use characters that stand for message contents while a template renders them.
_PLACEHOLDERS, _MAX_PLACEHOLDERS = 0xF0000, 0xFFFD
BYTE_LEVEL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Whole tokens in Qwen2.5/Qwen3 vocabularies too (added, not special: they survive decoding with
# skip_special_tokens, so the environment still sees the tags the model wrote).
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# GPT-4's pre-tokenizing regex with one digit a match instead of up to three, as Qwen2/Qwen3 use
# it: English contractions, a word with at most one non-letter before it, a digit, punctuation
# with an optional space before it and line breaks after it, then runs of whitespace.
QWEN_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template renders a `tools` list itself (a tools section in the prompt, tool
    calls, `role: "tool"` messages), as Qwen3's and Llama 3.1's do."""
    if chat_template is None:
        return False
    parsed = _template_environment().parse(chat_template)
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


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
        jinja = _template_environment()
        self._template = jinja.from_string(chat_template) if chat_template else None
        self.renders_tools = renders_tools(chat_template)

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

    @cached_property  # a copy of a large vocabulary: made when first needed
    def _as_text(self) -> HFTokenizer:
        """The same tokenizer reading special-token strings as plain text, for what users and
        tools wrote: a tool's output of "<|im_end|><|im_start|>assistant" must not close a turn
        and open one the model never wrote."""
        copy = HFTokenizer.from_str(self._tok.to_str())
        copy.encode_special_tokens = True
        return copy

    def encode_text(self, text: str) -> list[int]:
        """`text` as written: special-token strings in it are spelled out, not control tokens."""
        return self._as_text.encode(text, add_special_tokens=False).ids

    @cached_property
    def _special_strings(self) -> tuple[str, ...]:
        added = self._tok.get_added_tokens_decoder().values()
        return tuple(t.content for t in added if t.special)

    def spells_markup(self, text: str) -> bool:
        """Whether `text` holds a special token's string ("<|im_start|>"...)."""
        return any(s in text for s in self._special_strings)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template's rendering of `messages` in ids, with the template's own markup as
        control tokens and the messages' text as text: where a content spells a special token,
        the contents are rendered as private-use placeholders and encoded apart
        (`encode_text`). Otherwise the rendering is encoded whole, as it always was: a
        tokenizer may merge across the seams (Qwen's pre-tokenizer where whitespace meets
        whitespace, one without a pre-tokenizing regex anywhere), and the warm start's records
        were encoded that way. A template that rewrites content (so that a placeholder
        does not come through exactly once) is encoded as rendered. `tools`: as in
        `apply_chat_template`."""
        contents = [m.get("content") for m in messages]
        if any(isinstance(c, str) and self.spells_markup(c) for c in contents):
            apart = self._encode_contents_apart(messages, contents, add_generation_prompt, tools)
            if apart is not None:
                return apart
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools))

    def _encode_contents_apart(
        self,
        messages: Sequence[Mapping[str, Any]],
        contents: Sequence[object],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int] | None:
        """None where the template does not render each placeholder exactly once."""
        if len(messages) > _MAX_PLACEHOLDERS:
            return None
        marks = [chr(_PLACEHOLDERS + i) for i in range(len(messages))]
        marked = [
            {**m, "content": mark} if isinstance(c, str) else m
            for m, c, mark in zip(messages, contents, marks, strict=True)
        ]
        text = self.apply_chat_template(marked, add_generation_prompt, tools)
        used = [(mark, c) for mark, c in zip(marks, contents, strict=True) if isinstance(c, str)]
        if any(text.count(mark) != 1 for mark, _ in used):
            return None
        ids: list[int] = []
        for mark, content in used:
            before, text = text.split(mark)
            ids += self.encode(before) + self.encode_text(content)
        return ids + self.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # A model's vocabulary is often larger than its tokenizer's; ids beyond it decode to "".
        known = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The template's text for `messages`; `tools` (JSON schemas, OpenAI's
        {"type": "function", "function": {...}} shape) go to the template as Hugging Face
        passes them, for a template that renders them (`renders_tools`)."""
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self._template.render(
            messages=list(messages),
            tools=None if tools is None else list(tools),
            documents=None,
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


def _template_environment() -> ImmutableSandboxedEnvironment:
    """Jinja as Hugging Face sets it up for chat templates, so a model's template renders here
    as it does there: `tojson` is `json.dumps` (Jinja's own escapes HTML and sorts keys), loop
    controls (`break`) and `strftime_now` for templates that date their prompt."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def build_byte_level_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int | None = None
) -> HFTokenizer:
    """A byte-level tokenizer with ChatML special tokens and the tool tags: any text round-trips.

    Without a corpus it has no merges (one token per byte). With one, byte-pair merges are learnt
    from it up to `vocab_size` tokens in all, the way a language model's tokenizer is trained on
    its pretraining text: a from-scratch model trained on one task family then reads and writes
    that family's words as a token or a few instead of one per byte, and numbers digit by digit.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if corpus is None:
        tok = HFTokenizer(
            models.BPE(vocab={s: i for i, s in enumerate(sorted(alphabet))}, merges=[])
        )
    else:
        tok = HFTokenizer(models.BPE())
    # Qwen2/Qwen3's pre-tokenizer (their tokenizer.json): merges stay inside a word, a run of
    # punctuation or of whitespace, so a word reads the same whatever follows it, and every
    # digit is a token, so a number is its digits. Merges across words made a key `slate` into
    # `slat|e.` here and `slate:` there, and 2131 into `2|13|1`: a task unlike the demonstrations
    # could not be learnt.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    if corpus is not None:
        added = len(BYTE_LEVEL_SPECIAL_TOKENS) + len(TOOL_TOKENS)
        if vocab_size is None or vocab_size < len(alphabet) + added:
            raise ValueError(
                f"a trained byte-level tokenizer needs vocab_size >= {len(alphabet) + added}"
                f" (256 bytes and {added} added tokens), got {vocab_size}"
            )
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - added,
            initial_alphabet=alphabet,
            show_progress=False,
        )
        tok.train_from_iterator(_without_added_tokens(corpus), trainer)
    tok.add_special_tokens(list(BYTE_LEVEL_SPECIAL_TOKENS))
    tok.add_tokens(list(TOOL_TOKENS))
    return tok


def _without_added_tokens(corpus: Iterable[str]) -> Iterable[str]:
    """The corpus with the added tokens cut out: merges are for the text between them."""
    pattern = "|".join(re.escape(t) for t in (*BYTE_LEVEL_SPECIAL_TOKENS, *TOOL_TOKENS))
    for text in corpus:
        yield from (piece for piece in re.split(pattern, text) if piece)


def write_byte_level_tokenizer(
    model_dir: str | Path, model_max_length: int, tokenizer: HFTokenizer | None = None
) -> HFTokenizer:
    """Write `tokenizer.json` and `tokenizer_config.json` that `transformers` can load too;
    `tokenizer` is one from `build_byte_level_tokenizer` (default: the one without merges)."""
    path = Path(model_dir)
    tok = tokenizer or build_byte_level_tokenizer()
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
