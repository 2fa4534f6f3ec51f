"""Logprobs in OpenAI's shapes: the legacy completions' (`tokens`, `token_logprobs`,
`top_logprobs` by text) and chat's (`content[i]` with `top_logprobs`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from venusrl.model.tokenizer import Tokenizer
from venusrl.types import SamplingParams, TopLogprobs


def _token_text(tok: Tokenizer | None, token: int) -> str:
    return tok.decode([token]) if tok is not None else str(token)


def completion_logprobs(
    tok: Tokenizer | None,
    sp: SamplingParams,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
) -> dict[str, Any]:
    """OpenAI's legacy shape: with `logprobs: k > 0`, each position's k most likely tokens by
    text, and the sampled one too (up to k + 1 entries, as OpenAI documents). Tokens that decode
    to the same text keep the most likely's logprob."""
    top_logprobs = None
    if sp.top_logprobs > 0:
        top_logprobs = []
        for token, logprob, top in zip(tokens, logprobs, tops, strict=True):
            by_text: dict[str, float] = {}
            for t, lp in [*top, (token, logprob)]:
                by_text.setdefault(_token_text(tok, t), lp)
            top_logprobs.append(by_text)
    return {
        "tokens": [_token_text(tok, t) for t in tokens],
        "token_logprobs": list(logprobs),
        "top_logprobs": top_logprobs,
        "text_offset": None,
    }


def chat_logprobs(
    tok: Tokenizer | None,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
) -> dict[str, Any]:
    """`tops` is empty when no alternatives were asked: each token's `top_logprobs` is then []."""
    content = []
    for t, lp, top in zip(tokens, logprobs, tops or [[] for _ in tokens], strict=True):
        alternatives = [_chat_token(tok, a, alp) for a, alp in top]
        content.append({**_chat_token(tok, t, lp), "top_logprobs": alternatives})
    return {"content": content}


def _chat_token(tok: Tokenizer | None, token: int, logprob: float) -> dict[str, Any]:
    text = _token_text(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
