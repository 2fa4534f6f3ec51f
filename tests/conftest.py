"""Shared fixtures: real model directories written by the reference implementation, and a
stand-in HTTP server for shape checks of clients of servers that cannot run here."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

# Two cores: oversubscribing threads makes timings (and test time) 10x worse.
torch.set_num_threads(int(os.environ.get("VENUSRL_TEST_THREADS", "1")))

# Where the engine tests that also hold on a GPU run (parity with transformers, the triton
# backend, decode graphs): `VENUSRL_TEST_DEVICE=cuda` runs them there (benchmarks/gpu_check.sh),
# and `VENUSRL_TEST_ATTENTION=triton` puts the parity tests on the triton backend.
TEST_DEVICE = torch.device(os.environ.get("VENUSRL_TEST_DEVICE", "cpu"))
TEST_ATTENTION = os.environ.get("VENUSRL_TEST_ATTENTION", "torch")
if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
    raise pytest.UsageError("VENUSRL_TEST_DEVICE=cuda, but torch sees no CUDA device")


def write_hf_model(path: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight model saved by `transformers` itself: the reference for parity tests.

    Weights use a large init std so that greedy outputs vary from token to token (with HF's
    0.02 a random model repeats one token, which would make parity tests weak).
    """
    import transformers

    config_cls = {
        "qwen3": transformers.Qwen3Config,
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
    }[model_type]
    base: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
        initializer_range=0.2,
    )
    base.update(overrides)
    torch.manual_seed(seed)
    model = config_cls(**base)
    hf = transformers.AutoModelForCausalLM.from_config(model, dtype=torch.float32)
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", head_dim=16)


Reply = Callable[[dict[str, Any]], tuple[int, Any]]


@dataclass
class StandIn:
    """A real HTTP server that answers each path with its reply function (404 for the rest) and
    records every request: to check what a client sends and reads, in a shape a test writes
    down. It checks shapes only; the server it stands in for may behave otherwise."""

    url: str
    replies: dict[str, Reply]
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, body)


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    replies: dict[str, Reply] = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    found = StandIn(f"http://127.0.0.1:{server.server_address[1]}", replies)

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: dict[str, Any]) -> None:
            found.requests.append((self.path, body))
            reply = replies.get(self.path)
            status, data = reply(body) if reply else (404, {"detail": "Not Found"})
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self.answer({})

        def do_POST(self) -> None:
            self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        def log_message(self, *args: Any) -> None:
            pass

    server.RequestHandlerClass = Handler
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield found
    server.shutdown()
    server.server_close()


@dataclass(frozen=True)
class BuiltImages:
    """Images built once per session (tests/images/built.py), and a layer cache for them."""

    layout: Path  # an OCI image layout holding both
    python: str  # busybox, Debian's python3 with pytest, git; WorkingDir /work, Env PROBE=1
    busybox: str  # busybox only; User agent, WorkingDir /home/agent
    cache: Path

    def store(self) -> Any:
        from venusrl.envs.templates import IMAGE_ID_BASE
        from venusrl.images.store import ImageStore

        return ImageStore(self.cache, 8 << 30, IMAGE_ID_BASE)


@pytest.fixture(scope="session")
def test_images(tmp_path_factory: pytest.TempPathFactory) -> BuiltImages:
    from tests.images.built import busybox_spec, python_spec
    from venusrl.images.build import write_oci

    where = tmp_path_factory.mktemp("images")
    layout = where / "layout"
    write_oci(
        python_spec(where, working_dir="/work", env={"PATH": "/usr/bin:/bin", "PROBE": "1"}),
        layout,
        "python",
    )
    write_oci(busybox_spec(where, user="agent", working_dir="/home/agent"), layout, "busybox")
    return BuiltImages(layout, f"oci:{layout}:python", f"oci:{layout}:busybox", where / "cache")
