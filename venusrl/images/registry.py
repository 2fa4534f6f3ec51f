"""Pulls from a registry over the OCI distribution API (what Docker Hub, GHCR, ECR, Harbor and
`registry:2` speak), with its token auth.

A request answered 401 carries `WWW-Authenticate`: `Bearer realm=...,service=...,scope=...` sends
us to the realm for a token (with the user's credentials, if any, as Basic auth), `Basic` wants
the credentials on the request itself. Credentials come from a Docker `config.json`
(`docker login` writes one: `{"auths": {"HOST": {"auth": base64("USER:PASS")}}}`). Manifests and
blobs are verified against their digests; a tag's manifest digest is checked against the
registry's `Docker-Content-Digest`. Transient failures (connection errors, 429, 5xx) are retried
with backoff, honouring `Retry-After` up to a bound.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from venusrl.images.oci import (
    DOCKER_CONFIG,
    DOCKER_LIST,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
    ImageError,
    Readable,
    sha256_digest,
    verified,
)
from venusrl.images.reference import DOCKER_HUB, ImageRef
from venusrl.images.sources import LayerBlob, Resolved, resolve_manifest

_ACCEPT = ", ".join((OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST))
_MAX_MANIFEST = 4 << 20
_RETRIES = 4
_MAX_RETRY_AFTER_S = 30.0
_LOOPBACK = re.compile(r"^(localhost|127\.\d+\.\d+\.\d+|\[::1\])(:\d+)?$")


def load_credentials(path: Path | None) -> dict[str, tuple[str, str]]:
    """host -> (user, password) from a Docker config.json; {} when there is no file."""
    if path is None or not path.exists():
        return {}
    try:
        auths = json.loads(path.read_text()).get("auths", {})
    except (OSError, ValueError, AttributeError) as e:
        raise ImageError(f"registry credentials {path}: cannot read ({e})") from None
    creds = {}
    for host, entry in auths.items():
        if not isinstance(entry, dict):
            continue
        if "auth" in entry:
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise ImageError(
                    f"registry credentials {path}: {host}'s auth is not base64"
                ) from None
        else:
            user, password = str(entry.get("username", "")), str(entry.get("password", ""))
        creds[host.removeprefix("https://").removeprefix("http://").rstrip("/")] = (user, password)
    return creds


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


class Registry:
    """One repository on one registry; `resolve` and `open_layer` as the local sources give."""

    def __init__(
        self,
        ref: ImageRef,
        credentials: dict[str, tuple[str, str]],
        insecure: tuple[str, ...] = (),
        timeout_s: float = 60.0,
    ) -> None:
        self.name, self.ref = str(ref), ref
        host = "registry-1.docker.io" if ref.registry == DOCKER_HUB else ref.registry
        plain = ref.registry in insecure or bool(_LOOPBACK.match(ref.registry))
        self.plain = plain
        self.origin = f"{'http' if plain else 'https'}://{host}"
        self.base = f"{self.origin}/v2/{ref.repository}"
        self.creds = credentials.get(ref.registry) or credentials.get(host)
        if ref.registry == DOCKER_HUB and self.creds is None:
            self.creds = credentials.get("index.docker.io/v1") or credentials.get("index.docker.io")
        # Blobs are often redirected to a store elsewhere (httpx drops our Authorization
        # there). Identity encoding: the digests are of the bytes as stored, not as sent.
        self.client = httpx.Client(
            timeout=timeout_s, follow_redirects=True, headers={"Accept-Encoding": "identity"}
        )
        self._auth: str | None = None  # the Authorization header that worked

    def close(self) -> None:
        self.client.close()

    # --- requests ----------------------------------------------------------------------------

    def _send(self, path: str, accept: str | None, stream: bool) -> httpx.Response:
        url = f"{self.base}/{path}"
        for attempt in range(_RETRIES):
            headers = {"Accept": accept} if accept else {}
            if self._auth:
                headers["Authorization"] = self._auth
            try:
                request = self.client.build_request("GET", url, headers=headers)
                response = self.client.send(request, stream=stream)
            except httpx.TransportError as e:
                if attempt == _RETRIES - 1:
                    raise ImageError(f"image {self.name}: cannot reach {url}: {e}") from None
                time.sleep(0.5 * 2**attempt)
                continue
            if response.status_code == 401 and attempt < _RETRIES - 1 and self._ours(response):
                response.close()
                self._authenticate(response)
                continue
            if response.status_code in (429, 500, 502, 503, 504) and attempt < _RETRIES - 1:
                response.close()
                retry_after = response.headers.get("Retry-After", "")
                wait = float(retry_after) if retry_after.isdigit() else 0.5 * 2**attempt
                time.sleep(min(wait, _MAX_RETRY_AFTER_S))
                continue
            if response.status_code != 200:
                response.read()
                response.close()
                raise ImageError(
                    f"image {self.name}: GET {url} answered {response.status_code}:"
                    f" {response.text[:300]}"
                )
            return response
        raise ImageError(f"image {self.name}: GET {url} failed {_RETRIES} times")

    def _ours(self, response: httpx.Response) -> bool:
        """Whether the answer is the registry's own, not that of a store a redirect led to:
        only the registry's challenges get the user's credentials."""
        url = response.url
        return f"{url.scheme}://{url.netloc.decode()}" == self.origin

    def _authenticate(self, response: httpx.Response) -> None:
        scheme, params = _challenge(response.headers.get("WWW-Authenticate", ""))
        basic = None
        if self.creds is not None:
            basic = "Basic " + base64.b64encode(":".join(self.creds).encode()).decode()
        if scheme == "basic":
            if basic is None:
                raise ImageError(
                    f"image {self.name}: {self.ref.registry} wants credentials:"
                    " give sandbox.registry_auth_file (a Docker config.json)"
                )
            self._auth = basic
            return
        if scheme != "bearer" or "realm" not in params:
            raise ImageError(f"image {self.name}: unsupported auth challenge {scheme!r}")
        realm = httpx.URL(params["realm"])
        if realm.scheme != "https" and not (self.plain and realm.scheme == "http"):
            raise ImageError(
                f"image {self.name}: the registry sends us for a token to {params['realm']!r}:"
                " only https, or http for an insecure registry, gets the credentials"
            )
        query = {"service": params.get("service", "")}
        query["scope"] = params.get("scope") or f"repository:{self.ref.repository}:pull"
        headers = {"Authorization": basic} if basic else {}
        try:
            answer = self.client.get(params["realm"], params=query, headers=headers)
        except httpx.TransportError as e:
            raise ImageError(f"image {self.name}: token server {params['realm']}: {e}") from None
        if answer.status_code != 200:
            raise ImageError(
                f"image {self.name}: token server {params['realm']} answered"
                f" {answer.status_code}: {answer.text[:300]}"
            )
        try:
            body = answer.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise ImageError(f"image {self.name}: token server {params['realm']} gave no token")
        self._auth = f"Bearer {token}"

    def _get(self, path: str, accept: str | None, limit: int) -> tuple[httpx.Headers, bytes]:
        """The body of a small document, read no further than `limit` bytes."""
        response = self._send(path, accept, stream=True)
        data = bytearray()
        try:
            for chunk in response.iter_raw():
                data += chunk
                if len(data) > limit:
                    raise ImageError(f"image {self.name}: {path} is over {limit} bytes")
        finally:
            response.close()
        return response.headers, bytes(data)

    # --- the source's two verbs --------------------------------------------------------------

    def resolve(self) -> Resolved:
        reference = self.ref.digest or self.ref.tag
        headers, body = self._get(f"manifests/{reference}", _ACCEPT, _MAX_MANIFEST)
        media_type = headers.get("Content-Type", "").split(";")[0]
        if self.ref.digest:
            verified(body, self.ref.digest, f"image {self.name}: manifest")
            digest = self.ref.digest
        else:
            digest = sha256_digest(body)
            stated = headers.get("Docker-Content-Digest")
            if stated and stated.startswith("sha256:") and stated != digest:
                raise ImageError(
                    f"image {self.name}: manifest digest mismatch: the registry says {stated},"
                    f" the body is {digest}"
                )
        top = Descriptor(media_type or OCI_MANIFEST, digest, len(body))
        fetched = {digest: body}

        def fetch(d: Descriptor, what: str) -> bytes:
            if d.digest in fetched:
                return fetched[d.digest]
            kind = "blobs" if what == "config" else "manifests"
            accept = f"{OCI_CONFIG}, {DOCKER_CONFIG}" if what == "config" else _ACCEPT
            _, data = self._get(f"{kind}/{d.digest}", accept, _MAX_MANIFEST)
            return verified(data, d.digest, f"image {self.name}: {what} {d.digest}")

        return resolve_manifest(self.name, top, fetch)

    @contextlib.contextmanager
    def open_layer(self, layer: LayerBlob) -> Iterator[Readable]:
        assert layer.blob_digest is not None
        response = self._send(f"blobs/{layer.blob_digest}", None, stream=True)
        try:
            yield _StreamReader(response.iter_raw())
        finally:
            response.close()


class _StreamReader:
    """A file-like `read` over an iterator of chunks (the response body as it arrives)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.buf = chunks, b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self.buf) < n:
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            self.buf += chunk
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out
