"""Pulls from a real registry server (the distribution registry, Debian's docker-registry) on
loopback, behind its token auth: a token server of the test's issues RS256 tokens the registry
verifies against the test's certificate. skopeo pushes the images, so the registry holds what a
real client uploaded."""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from venusrl.envs.templates import IMAGE_ID_BASE
from venusrl.images.build import ImageSpec, LayerWriter, write_oci
from venusrl.images.oci import ImageError
from venusrl.images.store import ImageStore

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="unpacking layers needs root (owners)"),
    pytest.mark.skipif(
        shutil.which("docker-registry") is None, reason="apt-get install docker-registry"
    ),
]
USER, PASSWORD = "trainer", secrets.token_hex(8)
SERVICE, ISSUER = "venusrl-test-registry", "venusrl-test-issuer"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Registry:
    host: str
    storage: Path
    token_requests: list[dict[str, str]]

    def push(self, source: str, name: str) -> None:
        subprocess.run(
            ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--dest-creds",
             f"{USER}:{PASSWORD}", source, f"docker://{self.host}/{name}"],
            check=True, capture_output=True,
        )  # fmt: skip


def _token_server(
    key: Path, cert_der: bytes, requests: list[dict[str, str]]
) -> ThreadingHTTPServer:
    class Tokens(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            from urllib.parse import parse_qs, urlparse

            query = {k: v[0] for k, v in parse_qs(urlparse(self.path).query).items()}
            requests.append(query)
            sent = self.headers.get("Authorization", "")
            if sent != "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode():
                self.send_response(401)
                self.end_headers()
                return
            _, name, actions = query["scope"].split(":")
            now = int(time.time())
            header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(cert_der).decode()]}
            claims = {
                "iss": ISSUER, "sub": USER, "aud": SERVICE, "exp": now + 300, "nbf": now - 10,
                "iat": now, "jti": secrets.token_hex(8),
                "access": [{"type": "repository", "name": name, "actions": actions.split(",")}],
            }  # fmt: skip
            signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
            signature = subprocess.run(
                ["openssl", "dgst", "-sha256", "-sign", str(key)],
                input=signing.encode(), capture_output=True, check=True,
            ).stdout  # fmt: skip
            body = json.dumps({"token": f"{signing}.{_b64(signature)}"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Tokens)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    where = tmp_path_factory.mktemp("registry")
    key, cert = where / "key.pem", where / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=venusrl-test-token"],
        check=True, capture_output=True,
    )  # fmt: skip
    der = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-outform", "DER"], capture_output=True, check=True
    ).stdout
    requests: list[dict[str, str]] = []
    tokens = _token_server(key, der, requests)
    port = _free_port()
    config = where / "config.yml"
    config.write_text(
        json.dumps(  # YAML is a superset of JSON
            {
                "version": 0.1,
                "log": {"level": "error"},
                "storage": {"filesystem": {"rootdirectory": str(where / "storage")}},
                "http": {"addr": f"127.0.0.1:{port}", "secret": secrets.token_hex(8)},
                "auth": {
                    "token": {
                        "realm": f"http://127.0.0.1:{tokens.server_address[1]}/token",
                        "service": SERVICE,
                        "issuer": ISSUER,
                        "rootcertbundle": str(cert),
                    }
                },
            }
        )
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the registry did not start: {proc.stderr.read()!r}") from None
            time.sleep(0.05)
    try:
        yield Registry(f"127.0.0.1:{port}", where / "storage", requests)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        tokens.shutdown()


def _image(tmp_path: Path, tag: str) -> str:
    layer = LayerWriter(tmp_path / f"{tag}.tar")
    layer.file("etc/motd", f"image {tag}\n".encode())
    layer.file("bin/tool", os.urandom(256 << 10), mode=0o755)
    layer.close()
    write_oci(ImageSpec([tmp_path / f"{tag}.tar"], working_dir="/etc"), tmp_path / "oci", tag)
    return f"oci:{tmp_path}/oci:{tag}"


def _credentials(tmp_path: Path, host: str) -> Path:
    path = tmp_path / "docker-config.json"
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def test_a_pull_through_token_auth_gets_the_image_skopeo_pushed(
    registry: Registry, tmp_path: Path
) -> None:
    registry.push(_image(tmp_path, "v1"), "swe/task:v1")
    anonymous = httpx.get(f"http://{registry.host}/v2/swe/task/manifests/v1")
    assert anonymous.status_code == 401  # the registry itself wants a token
    assert anonymous.headers["WWW-Authenticate"].startswith("Bearer realm=")
    store = ImageStore(
        tmp_path / "cache", 1 << 30, IMAGE_ID_BASE, _credentials(tmp_path, registry.host)
    )
    image = store.pull(f"{registry.host}/swe/task:v1")
    assert image.read_text("/etc/motd") == "image v1\n"
    assert image.config.working_dir == "/etc"
    assert registry.token_requests[-1]["scope"] == "repository:swe/task:pull"
    assert registry.token_requests[-1]["service"] == SERVICE
    pinned = store.pull(f"docker://{registry.host}/swe/task@{image.image_id}")  # by digest
    assert pinned.layers == image.layers


def test_a_pull_without_credentials_is_refused_clearly(registry: Registry, tmp_path: Path) -> None:
    registry.push(_image(tmp_path, "private"), "swe/private:v1")
    store = ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE)
    with pytest.raises(ImageError, match=r"token server .* answered 401"):
        store.pull(f"{registry.host}/swe/private:v1")


def test_a_blob_the_registry_serves_altered_is_refused(registry: Registry, tmp_path: Path) -> None:
    registry.push(_image(tmp_path, "altered"), "swe/altered:v1")
    store = ImageStore(
        tmp_path / "cache", 1 << 30, IMAGE_ID_BASE, _credentials(tmp_path, registry.host)
    )
    manifest = json.loads(
        subprocess.run(
            ["skopeo", "inspect", "--raw", "--tls-verify=false", "--creds", f"{USER}:{PASSWORD}",
             f"docker://{registry.host}/swe/altered:v1"],
            capture_output=True, check=True,
        ).stdout
    )  # fmt: skip
    digest = manifest["layers"][0]["digest"].split(":")[1]
    data = registry.storage / "docker/registry/v2/blobs/sha256" / digest[:2] / digest / "data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ImageError, match=r"digest mismatch|not a readable"):
        store.pull(f"{registry.host}/swe/altered:v1")
    assert store.cache.stats().layers == 0
