"""The model run over one engine step: its packed batch of tokens from many sequences, attending
through the paged KV cache with the engine's attention backend.

The model (`model/architecture.py`) knows nothing of pages; this gives each layer its attention
over the step's cache, and streams the pages a banded step reads from the host tier one layer
ahead of the layer that reads them (`tier_copies.StreamedLayers`).
"""

from __future__ import annotations

import torch

from venusrl.engine.attention import StepBatch
from venusrl.engine.attention_backend import AttentionBackend
from venusrl.engine.kv_cache import KVCache
from venusrl.engine.tier_copies import StreamedLayers
from venusrl.model.architecture import CausalLM


class PagedForward:
    def __init__(self, model: CausalLM, attention: AttentionBackend) -> None:
        self.model, self.attention = model, attention

    def __call__(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Logits, in fp32, for `batch.logits_rows` only."""
        return self.model.logits(self.hidden_states(batch, kv))

    def hidden_states(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """The final (normed) hidden states of `batch.logits_rows`: what a decode graph records
        (`decode_graphs.py`), whose output buffer is then [rows, hidden] rather than
        [rows, vocab]."""
        self.model.check_whole()
        streamed = StreamedLayers.of_step(batch.host_reads, kv.copies)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            host = None if streamed is None else streamed.layer(layer)
            return self.attention(q, k, v, kv.layer(layer), batch, layer, host)

        after_layer = None if streamed is None else lambda i: streamed.prefetch(after=i)
        return self.model.hidden_states(
            batch.input_ids, batch.positions, batch.logits_rows, attend, after_layer
        )
