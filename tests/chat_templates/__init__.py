"""Real chat templates, as their models publish them, on byte-level tokenizers that know their
special tokens: what tests render with ours and with transformers' `apply_chat_template`.

qwen3.jinja: Qwen3's (Qwen/Qwen3-*, tokenizer_config.json of its first release);
qwen3_coder.jinja: Qwen3-Coder's; llama3_1.jinja: Llama 3.1 Instruct's.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from venusrl.model.tokenizer import Tokenizer, build_byte_level_tokenizer

HERE = Path(__file__).parent
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA_SPECIAL = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
# name -> (bos, eos, special tokens)
MODELS: dict[str, tuple[str | None, str, tuple[str, ...]]] = {
    "qwen3": (None, "<|im_end|>", QWEN_SPECIAL),
    "qwen3_coder": (None, "<|im_end|>", QWEN_SPECIAL),
    "llama3_1": ("<|begin_of_text|>", "<|eot_id|>", LLAMA_SPECIAL),
}
# Text the byte-pair merges are learnt from: words then read as one token or a few, so that a
# sequence of smaller pieces of them is a tokenisation the tokenizer would never produce.
CORPUS = [
    "Guess the secret integer. I am thinking of an integer between 1 and 100. guess guess guess",
    '{"name": "guess", "arguments": {"n": 50}} {"name": "guess", "parameters": {"n": 25}}',
    "<function=guess> <parameter=n> higher: the number is between lower: correct",
] * 20


def chat_template(name: str) -> str:
    return (HERE / f"{name}.jinja").read_text()


def byte_level(name: str) -> HFTokenizer:
    """A byte-level BPE learnt from `CORPUS`, with the model's special tokens."""
    tok = build_byte_level_tokenizer(CORPUS, vocab_size=420)
    tok.add_special_tokens(list(MODELS[name][2]))
    return tok


@cache  # not changed by its users: one per model for the whole session
def tokenizer(name: str) -> Tokenizer:
    bos, eos, _ = MODELS[name]
    return Tokenizer(
        byte_level(name), chat_template=chat_template(name), bos_token=bos, eos_token=eos
    )


@cache
def transformers_tokenizer(name: str) -> Any:
    """The same tokenizer and template in transformers (a dev dependency only)."""
    from transformers import PreTrainedTokenizerFast

    bos, eos, _ = MODELS[name]
    hf = PreTrainedTokenizerFast(tokenizer_object=byte_level(name), bos_token=bos, eos_token=eos)
    hf.chat_template = chat_template(name)
    return hf
