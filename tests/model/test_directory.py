"""Model directories: Hugging Face format in (sharded or not), `venusrl model init` out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import write_hf_model
from venusrl import cli
from venusrl.engine.config import EngineConfig
from venusrl.engine.engine import Engine
from venusrl.model.architecture import ModelConfigError
from venusrl.model.directory import iter_safetensors, load_model, read_model_config
from venusrl.types import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    import transformers

    single = write_hf_model(tmp_path / "single", "qwen3", seed=2, head_dim=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a = Engine.from_model_dir(single, EngineConfig(page_size=4, device_kv_pages=200))
    b = Engine.from_model_dir(tmp_path / "sharded", EngineConfig(page_size=4, device_kv_pages=200))
    prompt = list(range(10, 30))
    assert a.generate([prompt], GREEDY)[0].token_ids == b.generate([prompt], GREEDY)[0].token_ids


def model_init(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`venusrl model init ARGS` in this process: its exit status and what it wrote to stderr.
    (A process of its own costs seconds of importing torch; the end-to-end run as a user types it
    is `test_model_init_writes_a_directory_transformers_can_load`.) An exception the command does
    not turn into a message propagates and fails the test, as a traceback would."""
    capsys.readouterr()
    try:
        code = cli.main(["model", "init", *args])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code if isinstance(e.code, int) else 2
    return code, capsys.readouterr().err


def test_model_init_writes_a_directory_transformers_can_load(tmp_path: Path) -> None:
    import transformers

    out = tmp_path / "m"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "venusrl.cli",
            "model",
            "init",
            str(out),
            "--preset",
            "tiny",
            "--set",
            "num_hidden_layers=2",
            "--set",
            "vocab_size=1024",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["num_hidden_layers"] == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "hello, wörld"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ours = load_model(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    engine = Engine(ours, EngineConfig(page_size=4, device_kv_pages=1100))
    out_ids = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1, temperature=0))[0]
    assert out_ids.token_ids == [int(ref.argmax())]


def test_model_init_rejects_unknown_presets_with_the_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stderr = model_init(capsys, str(tmp_path / "m"), "--preset", "huge")
    assert code == 2
    assert "unknown preset 'huge'" in stderr and "tiny" in stderr


def test_missing_or_misshaped_weights_are_named_and_leave_the_model_unchanged(
    tmp_path: Path,
) -> None:
    path = write_hf_model(tmp_path / "m", "qwen3", seed=2, head_dim=16)
    model = load_model(path)
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    weights = dict(iter_safetensors(path))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 3
    bad_shape = dict(weights)
    bad_shape["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelConfigError, match=r"down_proj.weight.*shape"):
        model.load_weights(bad_shape.items())
    missing = dict(weights)
    del missing["model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(ModelConfigError, match=r"q_norm\.weight"):
        model.load_weights(missing.items())
    for name, tensor in model.hf_state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed by a failed load"


def test_unsupported_architectures_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ModelConfigError, match="mamba"):
        load_model(tmp_path)
    with pytest.raises(ModelConfigError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def write_config(path: Path, model_type: str, **rope: Any) -> Path:
    """A config.json written by hand, with `rope` the only RoPE fields in it."""
    path.mkdir(parents=True, exist_ok=True)
    fields = dict(
        model_type=model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        **rope,
    )
    (path / "config.json").write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize(
    "rope",
    [
        pytest.param(
            dict(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
            id="transformers-5",
        ),
        pytest.param(dict(rope_theta=500000.0, rope_scaling=None), id="transformers-4"),
        pytest.param(
            dict(rope_theta=500000.0, rope_scaling={"type": "default"}),
            id="transformers-4-default-scaling",
        ),
        # A stale top-level value beside the nested one is ignored, as transformers ignores it.
        pytest.param(
            dict(rope_theta=10000.0, rope_parameters={"rope_theta": 500000.0}),
            id="nested-wins-over-top-level",
        ),
    ],
)
def test_rope_theta_is_read_from_both_config_forms_transformers_writes(
    tmp_path: Path, model_type: str, rope: dict[str, Any]
) -> None:
    assert read_model_config(write_config(tmp_path, model_type, **rope)).rope_theta == 500000.0


@pytest.mark.parametrize(
    ("rope", "words"),
    [
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
            "rope_parameters.rope_type 'yarn'",
        ),
        (
            dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "rope_scaling.rope_type 'llama3'",
        ),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.type 'linear'"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.type 'dynamic'"),
        (dict(rope_parameters={"rope_type": "longrope"}), "rope_parameters.rope_type 'longrope'"),
    ],
)
def test_unsupported_rope_types_are_refused_naming_file_key_value_and_what_is_supported(
    tmp_path: Path, rope: dict[str, Any], words: str
) -> None:
    path = write_config(tmp_path, "llama", **rope)
    with pytest.raises(ModelConfigError) as refused:
        load_model(path)
    message = str(refused.value)
    assert str(path / "config.json") in message and words in message
    assert "supported: default" in message


def test_rope_per_layer_type_is_refused(tmp_path: Path) -> None:
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(ModelConfigError, match="rope_parameters must be one object"):
        read_model_config(write_config(tmp_path, "qwen3", rope_parameters=rope))


def test_scaled_rope_saved_by_transformers_is_refused(tmp_path: Path) -> None:
    import transformers

    llama31 = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    # `rope_scaling` is what transformers 4.x takes; 5.x takes it too and writes `rope_parameters`.
    transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=llama31,
    ).save_pretrained(tmp_path)
    with pytest.raises(ModelConfigError, match="'llama3' is not supported"):
        read_model_config(tmp_path)


def test_model_init_never_overwrites_a_directory_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pointed at a trained checkpoint by mistake, it must not replace its weights."""
    out = tmp_path / "m"
    assert model_init(capsys, str(out), "--preset", "micro")[0] == 0
    weights = (out / "model.safetensors").read_bytes()
    code, stderr = model_init(capsys, str(out), "--preset", "micro", "--seed", "5")
    assert code == 2 and "not empty" in stderr
    assert (out / "model.safetensors").read_bytes() == weights
    (out / "model-00001-of-00002.safetensors").write_bytes(b"left over")
    forced = model_init(capsys, str(out), "--preset", "micro", "--seed", "5", "--force")
    assert forced[0] == 0
    assert (out / "model.safetensors").read_bytes() != weights
    assert not (out / "model-00001-of-00002.safetensors").exists()
    load_model(out)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--set", "vocab_size=1e9"], "vocab_size must be an integer"),
        (["--set", "num_hidden_layers=0"], "num_hidden_layers must be an integer >= 1"),
        (["--set", "head_dim=abc"], "head_dim must be an integer"),
        (["--set", "max_position_embeddings=1"], "max_position_embeddings"),
        (["--set", "eos_token_id=99999"], "eos_token_id"),
        (["--set", "rope_theta=-1"], "rope_theta"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_model_init_names_the_field_a_bad_value_is_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    code, stderr = model_init(capsys, str(tmp_path / "m"), "--preset", "micro", *args)
    assert code == 2 and words in stderr, stderr
    assert "Traceback" not in stderr


def test_model_init_config_file_must_hold_an_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fields = tmp_path / "fields.json"
    fields.write_text("[1, 2]")
    code, stderr = model_init(capsys, str(tmp_path / "m"), "--config", str(fields))
    assert code == 2 and "must hold a JSON object" in stderr
