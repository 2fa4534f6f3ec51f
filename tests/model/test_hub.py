"""`--model ORG/NAME`: a model in the local Hugging Face cache, laid out as the Hub lays it out."""

from __future__ import annotations

from pathlib import Path

import pytest

from venusrl import cli
from venusrl.config import ConfigError, load_config
from venusrl.engine.engine import Engine
from venusrl.model.directory import init_model_dir
from venusrl.model.hub import model_path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_with_model(cache: Path, repo_id: str) -> Path:
    """`cache/models--ORG--NAME/{refs/main, snapshots/REV/}` with a tiny model in the snapshot,
    as `huggingface_hub` leaves a download."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text(REVISION)
    return init_model_dir(repo / "snapshots" / REVISION, "tiny")


def test_a_hub_id_in_the_cache_that_hf_hub_cache_names_is_its_snapshot_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = cache_with_model(tmp_path / "hub", "tiny-org/Tiny-Qwen3-0.1B")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = load_config(None, ["model=tiny-org/Tiny-Qwen3-0.1B"])
    assert cfg.model == str(snapshot)  # stored resolved: a resume reads the same weights
    assert load_config(None, [f"model={cfg.model}"]).model == cfg.model
    engine = Engine.from_model_dir(model_path("tiny-org/Tiny-Qwen3-0.1B"))
    assert engine.tokenizer is not None
    # HF_HOME/hub is the cache when HF_HUB_CACHE is not set.
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert model_path("tiny-org/Tiny-Qwen3-0.1B") == snapshot


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_with_model(tmp_path / "hub", "tiny-org/model")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    local = init_model_dir(tmp_path / "work/tiny-org/model", "tiny")
    monkeypatch.chdir(tmp_path / "work")
    assert model_path("tiny-org/model") == Path("tiny-org/model")
    assert model_path("tiny-org/model").resolve() == local


def test_a_hub_id_not_in_the_cache_says_how_to_download_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"model: Value error, Qwen/Qwen3-0.6B is neither a"):
        load_config(None, ["model=Qwen/Qwen3-0.6B"])
    run_dir = tmp_path / "run"
    assert cli.main(["train", "--model", "Qwen/Qwen3-0.6B", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"Qwen/Qwen3-0.6B is neither a local directory nor a model in {tmp_path}/empty" in err
    assert "hf download Qwen/Qwen3-0.6B" in err and "huggingface-cli download" in err
    assert not run_dir.exists()
    # A path that is no hub id is left to the model-directory checks, as before.
    assert model_path("/no/such/model") == Path("/no/such/model")
