"""Reading and writing Hugging Face-format model directories.

A model directory holds `config.json` and one or more `*.safetensors` files (sharded ones are
listed in `model.safetensors.index.json`), optionally `tokenizer.json`, `tokenizer_config.json`
and `generation_config.json`. `init_model_dir` writes a random-weight directory from a named
preset or a given config, for tests, demos and benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from venusrl.model.architecture import CausalLM, ModelConfig, ModelConfigError
from venusrl.model.presets import PRESETS
from venusrl.model.tokenizer import build_byte_level_tokenizer, write_byte_level_tokenizer
from venusrl.model.weight_stream import Spec, WeightStream

# safetensors' header names of dtypes; any other is announced as bytes (not floating-point).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

QWEN3_DEFAULTS: dict[str, Any] = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    attention_bias=False,
    torch_dtype="float32",
)


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model directory {path} does not exist")
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelConfigError(f"{path} has no config.json; is it a Hugging Face model directory?")
    hf: dict[str, Any] = json.loads(config_path.read_text())
    gen_path = path / "generation_config.json"
    if gen_path.exists():  # generation_config's eos list wins, as in transformers
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            hf["eos_token_id"] = eos
    return hf


def read_model_config(model_dir: str | Path) -> ModelConfig:
    hf = read_hf_config(model_dir)
    try:
        return ModelConfig.from_hf(hf)
    except ModelConfigError as e:  # name the file: a run may load several model directories
        raise ModelConfigError(f"{Path(model_dir) / 'config.json'}: {e}") from None


def check_same_model(model_dir: Path, served: ModelConfig) -> None:
    """Weights from a directory whose config.json describes another model (another RoPE,
    another norm epsilon) would load without an error and compute something else."""
    if not (model_dir / "config.json").exists():
        return
    given = read_model_config(model_dir)
    differ = [
        f"{f.name} {getattr(given, f.name)!r} (served: {getattr(served, f.name)!r})"
        for f in dataclasses.fields(served)
        if f.name != "eos_token_ids" and getattr(given, f.name) != getattr(served, f.name)
    ]
    if differ:
        raise ModelConfigError(
            f"{model_dir / 'config.json'} describes another model than the one served: "
            + ", ".join(differ)
        )


def iter_safetensors(model_dir: str | Path) -> WeightStream:
    """The directory's weights, announced from the files' headers, read one at a time."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{path} holds no *.safetensors weights")
    manifest = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                announced = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(announced.get_dtype(), torch.uint8)
                manifest[name] = Spec(tuple(announced.get_shape()), dtype)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)

    return WeightStream(manifest, tensors())


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    cfg = read_model_config(model_dir)
    model = build_model(cfg, device, dtype)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()


def build_model(
    cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """An uninitialised model (weights are filled by `load_weights` or `init_random`)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.reset_cache(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def save_model(model: CausalLM, model_dir: str | Path, hf_config: Mapping[str, Any]) -> None:
    """Write weights and config.json in Hugging Face format (a single safetensors file)."""
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.hf_state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(dict(hf_config), indent=2) + "\n")


def init_model_dir(
    out_dir: str | Path,
    preset: str | None = "tiny",
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    tokenizer: bool | HFTokenizer = True,
    overwrite: bool = False,
) -> Path:
    """Write a random-weight Qwen3 model directory with a byte-level tokenizer: the one without
    merges, or `tokenizer` (from `build_byte_level_tokenizer`), or none when it is False. A
    directory that is not empty (a trained checkpoint, say) is refused unless `overwrite`."""
    if preset is not None and preset not in PRESETS:
        raise ModelConfigError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    path = Path(out_dir)
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ModelConfigError(f"{path} is not empty; choose a new directory (or --force)")
    hf = {**QWEN3_DEFAULTS, **(PRESETS[preset] if preset else {}), **(overrides or {})}
    tok = build_byte_level_tokenizer() if tokenizer is True else tokenizer or None
    if tok is not None:
        hf.setdefault("eos_token_id", tok.token_to_id("<|im_end|>"))
        hf.setdefault("bos_token_id", None)
    cfg = ModelConfig.from_hf(hf)
    if tok is not None:
        needed = tok.get_vocab_size(with_added_tokens=True)
        if cfg.vocab_size < needed:
            raise ModelConfigError(
                f"vocab_size {cfg.vocab_size} is too small for the tokenizer (needs >= {needed})"
            )
    if overwrite:  # weights of another shape left beside the new ones would be read with them
        for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
    model = build_model(cfg)
    model.init_random(seed)
    save_model(model, path, hf)
    if tok is not None:
        write_byte_level_tokenizer(path, cfg.max_position_embeddings, tok)
    return path
