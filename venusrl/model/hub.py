"""A model named by its Hugging Face Hub id (`Qwen/Qwen3-0.6B`), found in the local cache.

A local directory always wins over a hub id of the same spelling. The cache is read with
huggingface_hub's own `snapshot_download(local_files_only=True)`, so its layout, `refs/`,
`HF_HUB_OFFLINE` and future changes are the library's, not ours; nothing is downloaded: a run
never fetches gigabytes on its own, it says how to.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# ORG/NAME as the Hub spells repository ids (huggingface_hub.utils.validate_repo_id).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_path(model: str) -> Path:
    """The model directory `model` names: a local directory, or a hub id's snapshot in the
    local Hugging Face cache; `ValueError` saying how to download it when it is neither."""
    path = Path(model).expanduser()
    if path.exists() or not _HUB_ID.match(model) or model.endswith("."):
        return path
    # Imported here: it takes ~0.3 s, half of reading a config, and most configs name no hub id.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, local_files_only=True, cache_dir=_cache_dir()))
    except LocalEntryNotFoundError:
        where = _cache_dir() or constants.HF_HUB_CACHE
        raise ValueError(
            f"{model} is neither a local directory nor a model in {where}: download it with"
            f" `hf download {model}` (older huggingface_hub: `huggingface-cli download {model}`)"
        ) from None


def _cache_dir() -> str | None:
    """The cache the environment names now: huggingface_hub reads HF_HUB_CACHE and HF_HOME once,
    at import, and a process may set them after that (a test, a launcher)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None
