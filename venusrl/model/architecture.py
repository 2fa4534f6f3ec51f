"""Decoder-only transformer for Hugging Face `qwen3`, `qwen2` and `llama` checkpoints.

The three differ only in small switches read from `config.json`: Qwen3 normalises each head's
queries and keys (QK norm) and has no q/k/v bias; Qwen2 has q/k/v bias and no QK norm; Llama has
neither. Weights keep Hugging Face names on the way in (`load_weights`), but q/k/v and gate/up
are stored fused, which halves the number of matmuls per layer.

`hidden_states` runs packed tokens of many sequences (no padding in the matmuls) with the
attention its caller gives: the engine's over its paged KV cache (`engine/paged_forward.py`), the
trainer's causal within each packed row (`forward_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from venusrl.model.packed_rows import PackedRows, packed_attention
from venusrl.model.weight_stream import Spec, WeightStream, spec

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
SUPPORTED_ROPE_TYPES = ("default",)


# Layer `layer`'s attention over its q [tokens, heads, dim], k and v [tokens, kv_heads, dim]:
# [tokens, heads * dim]. Called (q, k, v, layer).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class ModelConfigError(ValueError):
    pass


class TornWeights(RuntimeError):
    """The model's weights are half copied (a weight update broke midway): it runs nothing."""


def _listed(names: set[str]) -> str:
    shown = sorted(names)
    return ", ".join(shown[:5]) + (" ..." if len(shown) > 5 else "")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict; unsupported features are clear errors."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )

        def need(key: str) -> Any:
            if key not in hf:
                raise ModelConfigError(f"{key!r} is missing (model_type {model_type})")
            return hf[key]

        def count(key: str, default: int | None = None, least: int = 1) -> int:
            value = need(key) if default is None else hf.get(key) or default
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ModelConfigError(f"{key} must be an integer >= {least}, got {value!r}")
            return value

        num_heads = count("num_attention_heads")
        hidden = count("hidden_size")
        num_kv_heads = count("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        vocab = count("vocab_size")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(t, int) and 0 <= t < vocab for t in eos_ids):
            raise ModelConfigError(f"eos_token_id {eos!r} must be token ids below {vocab}")
        # Qwen2 always has q/k/v bias; the others say so in `attention_bias`.
        attention_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=count("head_dim", max(hidden // num_heads, 1)),
            rms_norm_eps=_positive("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf),
            # A context of one token could never generate: the prompt needs one.
            max_position_embeddings=count("max_position_embeddings", 4096, least=2),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
        )

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed


def _positive(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ModelConfigError(f"{key} must be a number > 0, got {value!r}")
    return float(value)


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """The RoPE base, from either form `transformers` writes: 5.x nests it in `rope_parameters:
    {rope_type, rope_theta}`; 4.x has a top-level `rope_theta` beside an optional `rope_scaling:
    {rope_type or type, ...}`. Read as transformers reads them: the nested value wins, then the
    top-level one, then 10,000. Only plain RoPE is implemented; any other type (yarn, llama3,
    linear, dynamic, longrope, ...) is refused, since run as plain RoPE it would generate
    silently wrong tokens."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    # A dict of dicts is RoPE per layer type (`full_attention`, `sliding_attention`, ...).
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ModelConfigError(f"{key} must be one object of RoPE parameters, got {params!r}")
    type_key = "type" if "type" in params and "rope_type" not in params else "rope_type"
    rope_type = params.get(type_key, "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{key}.{type_key} {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (plain RoPE with rope_theta)"
        )
    if "rope_theta" in params:
        return _positive(f"{key}.rope_theta", params["rope_theta"])
    return _positive("rope_theta", hf.get("rope_theta", 10000.0))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 and scale after casting back, as Hugging Face does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding in the Hugging Face (rotate-half) convention."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_cache()

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables in float64 then store fp32, on `device`."""
        device = torch.device(device) if device is not None else self.cos.device
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
        inv_freq = 1.0 / (self.theta ** (steps / self.head_dim))
        positions = torch.arange(self.max_positions, dtype=torch.float64, device=device)
        emb = torch.outer(positions, inv_freq).repeat(1, 2)
        self.cos, self.sin = emb.cos().float(), emb.sin().float()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin at `positions`, shaped [tokens, 1, head_dim]; shared by every layer."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] rotated in the rotate-half convention."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Linear(nn.Linear):
    """`nn.Linear` that, for CPU inference, can run on a oneDNN-prepacked copy of its weight.

    MKL's fp32 GEMM is slow for the few-row activations of decode steps (measured here: 3 rows
    cost 3x one row); oneDNN with a prepacked weight was 1.5-3x faster for 3-64 rows. The packed
    copy is used only without autograd, and only while the weight is the one it was packed from:
    an in-place change (an optimizer step, a weight load) bumps the tensor's version counter, and
    a stale copy is ignored until `pack()` runs again. (A trainer's no-grad forward once read the
    weights as they were at load time.)
    """

    _packed: torch.Tensor | None = None
    _packed_version: int = -1

    def pack(self) -> bool:
        self._packed = None
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            probe = torch.ones(2, self.in_features)
            _ = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except (AttributeError, RuntimeError):  # a torch built without oneDNN
            return False
        self._packed, self._packed_version = packed, self.weight._version
        return True

    def merged_weight(self) -> torch.Tensor:
        """The weight this layer computes with: its own, or with a trainer's low-rank update
        merged in (`trainer/lora.py`); what is published and saved."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self._packed is not None
            and not torch.is_grad_enabled()
            and self._packed_version == self.weight._version
            and x.dtype == torch.float32
            and not torch.is_autocast_enabled(x.device.type)  # a bf16 trainer's reference
        ):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> q [tokens, heads, dim], k and v [tokens, kv_heads, dim]."""
        tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.input_layernorm(x))
        # q and k side by side as one [tokens, heads + kv_heads, dim] tensor: one RoPE for both.
        qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = apply_rotary(qk, *rope)
        return qk[:, :heads], qk[:, heads:], v

    def _residual_and_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o_proj(attn)
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], attend: Attend
    ) -> torch.Tensor:
        q, k, v = self._qkv(x, rope)
        return self._residual_and_mlp(x, attend(q, k, v, self.layer_index))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.torn: str | None = None  # what broke a weight update midway (`load_weights`)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states onto the vocabulary, in fp32 (what the sampler reads)."""
        return self.lm_head(hidden).float()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        wanted: torch.Tensor,
        attend: Attend,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states [len(wanted), hidden] at the packed tokens `wanted`: not
        the whole logits, which the caller projects (`logits`) as it needs. `after_layer(i)` runs
        once layer i is queued (the engine starts copying the next layer's host pages there)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, attend)
            if after_layer is not None:
                after_layer(i)
        return self.norm(x.index_select(0, wanted))

    def forward_rows(self, rows: PackedRows, wanted: torch.Tensor) -> torch.Tensor:
        """`hidden_states` with causal attention within each packed row, with autograd: what the
        trainer runs, with the engine's weights and arithmetic but no KV cache. The trainer
        projects them chunk by chunk (`trainer/chunked_logprobs.py`) so that the whole logits
        never exist."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _layer: int) -> torch.Tensor:
            return packed_attention(q, k, v, rows)

        return self.hidden_states(rows.input_ids, rows.positions, wanted, attend)

    # -- weights in Hugging Face naming --------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this model, in place, each as it arrives.

        A `WeightStream`'s manifest is checked first: every parameter covered exactly, with its
        shape and a floating-point dtype, or an error that names the weight is raised before
        anything is copied, so a bad set leaves the model as it was. (Any other iterable is read
        whole first: a set already in memory is its own manifest.) Then each tensor is copied
        and let go: the model never holds more than the one in hand.

        If the stream breaks after the first copy (its source fails, it ends short, a tensor is
        not what the manifest said), the model is neither the old weights nor the new: it stays
        torn, its forward refusing to run (`TornWeights`), until a whole set loads; the stream's
        error is raised.
        """
        stream = weights if isinstance(weights, WeightStream) else WeightStream.whole(weights)
        targets = self._hf_targets()
        left = set(targets)
        try:
            self._check_manifest(stream.manifest, targets)
            for name, tensor in stream:
                self._copy_in(name, tensor, stream.manifest.get(name), targets.get(name), left)
                del tensor  # none held while the sender makes the next
            if left:
                raise ModelConfigError(f"the weights ended without {_listed(left)}")
        except BaseException as e:
            if len(left) < len(targets):
                self.torn = f"a weight update broke after {len(targets) - len(left)} of"
                self.torn += f" {len(targets)} tensors ({type(e).__name__}: {e})"
            raise
        finally:
            stream.close()  # read to its end, or given up: either way the sender stops
        self.torn = None
        self.pack_for_inference()

    @torch.no_grad()
    def _copy_in(
        self, name: str, tensor: torch.Tensor, announced: Spec | None,
        target: torch.Tensor | None, left: set[str],
    ) -> None:  # fmt: skip
        if spec(tensor) != announced:
            raise ModelConfigError(
                f"weight {name!r} {tuple(spec(tensor))} is not as the manifest announced:"
                f" {announced}"
            )
        if target is None:  # announced, and skipped (`_check_manifest`)
            return
        if name not in left:
            raise ModelConfigError(f"weight {name!r} came twice")
        target.copy_(tensor)
        left.discard(name)

    def _check_manifest(self, manifest: dict[str, Spec], targets: dict[str, torch.Tensor]) -> None:
        for name, (shape, dtype) in manifest.items():
            if name not in targets:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ModelConfigError(f"unexpected weight {name!r}")
            if shape != tuple(targets[name].shape):
                raise ModelConfigError(
                    f"weight {name!r} has shape {shape}, expected {tuple(targets[name].shape)}"
                )
            if not dtype.is_floating_point:
                raise ModelConfigError(f"weight {name!r} is {dtype}, not a floating-point type")
        missing = set(targets) - set(manifest)
        if missing:
            raise ModelConfigError(f"{len(missing)} weights missing: {_listed(missing)}")

    def check_whole(self) -> None:
        """`TornWeights` while a broken update has left the weights half copied."""
        if self.torn is not None:
            raise TornWeights(f"{self.torn}: the model runs again once a whole set loads")

    def pack_for_inference(self) -> None:
        """Rebuild the prepacked inference copies of the linear weights (CPU fp32 only)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def hf_manifest(self) -> dict[str, Spec]:
        """`hf_named`'s names, shapes and dtypes, without reading a weight (a sharded
        parameter's are those of the whole)."""

        def meta(name: str) -> torch.Tensor:
            p = self.get_parameter(name)
            return torch.empty(p.shape, dtype=p.dtype, device="meta")

        return {name: spec(t) for name, t in self.hf_named(meta)}

    def hf_weights(self) -> WeightStream:
        """`hf_state_dict` as a stream: each adapter's merged weight made when it is read."""
        named = ((name, t.detach()) for name, t in self.hf_named(self._merged_parameter))
        return WeightStream(self.hf_manifest(), named)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under Hugging Face names (views into the fused tensors), with
        any adapter's update merged in: what the engines and checkpoints get."""
        return {name: t.detach() for name, t in self.hf_named(self._merged_parameter)}

    def _merged_parameter(self, name: str) -> torch.Tensor:
        """Parameter `name`, or for a linear layer's weight the weight it computes with
        (`Linear.merged_weight`: a new, read-only tensor where an adapter is attached)."""
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name)
        if leaf == "weight" and isinstance(module, Linear):
            return module.merged_weight()
        return self.get_parameter(name)

    def _hf_targets(self) -> dict[str, torch.Tensor]:
        return dict(self.hf_named(self.get_parameter))

    def hf_named(
        self, parameter: Callable[[str], torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named weights, each a view of `parameter(name)`, the tensor of this
        model's (fused) parameter `name`. Lazy, and each parameter is read once: a sharded
        model's ranks gather one parameter at a time (`trainer.sharded`)."""
        cfg = self.config
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        yield "model.embed_tokens.weight", parameter("embed_tokens.weight")
        yield "model.norm.weight", parameter("norm.weight")
        if not cfg.tie_word_embeddings:
            yield "lm_head.weight", parameter("lm_head.weight")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p, m = f"model.layers.{i}.", f"layers.{i}."
            qkv = parameter(m + "qkv_proj.weight")
            yield p + "self_attn.q_proj.weight", qkv[:q_dim]
            yield p + "self_attn.k_proj.weight", qkv[q_dim : q_dim + kv_dim]
            yield p + "self_attn.v_proj.weight", qkv[q_dim + kv_dim :]
            if layer.qkv_proj.bias is not None:
                bias = parameter(m + "qkv_proj.bias")
                yield p + "self_attn.q_proj.bias", bias[:q_dim]
                yield p + "self_attn.k_proj.bias", bias[q_dim : q_dim + kv_dim]
                yield p + "self_attn.v_proj.bias", bias[q_dim + kv_dim :]
            yield p + "self_attn.o_proj.weight", parameter(m + "o_proj.weight")
            if layer.q_norm is not None and layer.k_norm is not None:
                yield p + "self_attn.q_norm.weight", parameter(m + "q_norm.weight")
                yield p + "self_attn.k_norm.weight", parameter(m + "k_norm.weight")
            gate_up = parameter(m + "gate_up_proj.weight")
            yield p + "mlp.gate_proj.weight", gate_up[: cfg.intermediate_size]
            yield p + "mlp.up_proj.weight", gate_up[cfg.intermediate_size :]
            yield p + "mlp.down_proj.weight", parameter(m + "down_proj.weight")
            yield p + "input_layernorm.weight", parameter(m + "input_layernorm.weight")
            yield (
                p + "post_attention_layernorm.weight",
                parameter(m + "post_attention_layernorm.weight"),
            )

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """Random weights as Hugging Face initialises them (normal(0, std), norms at 1)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, t in self._hf_targets().items():
                if name.endswith("norm.weight"):
                    t.fill_(1.0)
                elif name.endswith(".bias"):
                    t.zero_()
                else:
                    t.copy_(torch.randn(t.shape, generator=g) * std)
