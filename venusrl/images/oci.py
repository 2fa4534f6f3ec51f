"""The OCI image format and Docker's schema 2, as far as running an image needs: media types,
digests, descriptors, indexes, manifests and the image config.

Everything is parsed from untrusted bytes: each parser checks the fields it reads and raises
`ImageError` naming the image and the field, never a KeyError from three layers down. Digests are
verified by the readers (`sources`, `registry`) with `Digester`, before a byte is trusted.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)

# Layer media types -> how the blob is compressed. Docker's "foreign" and OCI's
# "non-distributable" layers are the same tars; only where they may be fetched from differs.
LAYER_COMPRESSION = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "none",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "none",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd": "zstd",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}
REF_NAME = "org.opencontainers.image.ref.name"
MAX_JSON_BYTES = 4 << 20  # a manifest or config; real ones are a few KB
_HEX = {"sha256": 64, "sha512": 128}


class Readable(Protocol):
    """A stream of bytes: an open file, a tar member, a response body as it arrives."""

    def read(self, n: int = -1, /) -> bytes: ...


class ImageError(Exception):
    """An image that cannot be used: unreadable, malformed, hostile or missing. The message
    names the image and, where there is one, the entry or field at fault."""


def check_digest(digest: object, where: str) -> str:
    """`digest` as `ALGORITHM:HEX` of a known algorithm, or `ImageError`."""
    if not isinstance(digest, str):
        raise ImageError(f"{where}: a digest must be a string, got {digest!r}")
    algorithm, _, hexpart = digest.partition(":")
    if algorithm not in _HEX or not re.fullmatch(f"[0-9a-f]{{{_HEX[algorithm]}}}", hexpart):
        raise ImageError(f"{where}: {digest!r} is not a sha256 or sha512 digest")
    return digest


class Digester:
    """Hashes bytes as they stream past; `check` compares with the digest they must have
    (None: sha256, only computed)."""

    def __init__(self, digest: str | None) -> None:
        self.expected = digest
        self.algorithm = digest.partition(":")[0] if digest else "sha256"
        self._hash = hashlib.new(self.algorithm)
        self.size = 0

    def update(self, data: bytes) -> None:
        self._hash.update(data)
        self.size += len(data)

    @property
    def actual(self) -> str:
        return f"{self.algorithm}:{self._hash.hexdigest()}"

    def check(self, what: str) -> None:
        if self.actual != self.expected:
            raise ImageError(
                f"{what}: digest mismatch: expected {self.expected}, got {self.actual}"
            )


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def verified(data: bytes, digest: str, what: str) -> bytes:
    d = Digester(digest)
    d.update(data)
    d.check(what)
    return data


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    platform: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: object, where: str) -> Descriptor:
        if not isinstance(raw, dict):
            raise ImageError(f"{where}: a descriptor must be an object")
        media_type, size = raw.get("mediaType"), raw.get("size")
        if not isinstance(media_type, str):
            raise ImageError(f"{where}: mediaType must be a string, got {media_type!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ImageError(f"{where}: size must be a non-negative integer, got {size!r}")
        annotations = raw.get("annotations") or {}
        platform = raw.get("platform") or {}
        if not isinstance(annotations, dict) or not isinstance(platform, dict):
            raise ImageError(f"{where}: annotations and platform must be objects")
        return cls(
            media_type,
            check_digest(raw.get("digest"), f"{where}.digest"),
            size,
            {str(k): str(v) for k, v in annotations.items()},
            {str(k): str(v) for k, v in platform.items()},
        )


def load_json(data: bytes, where: str) -> dict[str, Any]:
    if len(data) > MAX_JSON_BYTES:
        raise ImageError(f"{where}: {len(data)} bytes is too large for a manifest or config")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ImageError(f"{where}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ImageError(f"{where}: must be a JSON object")
    return value


def media_type_of(document: Mapping[str, Any], fallback: str | None) -> str | None:
    """A manifest's or index's own mediaType; old OCI documents leave it to the descriptor."""
    mt = document.get("mediaType")
    return mt if isinstance(mt, str) else fallback


def parse_index(document: Mapping[str, Any], where: str) -> list[Descriptor]:
    entries = document.get("manifests")
    if not isinstance(entries, list):
        raise ImageError(f"{where}: an index must list its manifests")
    return [Descriptor.parse(e, f"{where}.manifests[{i}]") for i, e in enumerate(entries)]


@dataclass(frozen=True)
class Manifest:
    config: Descriptor
    layers: tuple[Descriptor, ...]

    @classmethod
    def parse(cls, document: Mapping[str, Any], where: str) -> Manifest:
        if document.get("schemaVersion") != 2:
            raise ImageError(
                f"{where}: schemaVersion {document.get('schemaVersion')!r} is not supported"
                " (only schema 2: Docker's schema 1 images must be converted)"
            )
        layers = document.get("layers")
        if not isinstance(layers, list):
            raise ImageError(f"{where}: a manifest must list its layers")
        parsed = tuple(Descriptor.parse(x, f"{where}.layers[{i}]") for i, x in enumerate(layers))
        for i, layer in enumerate(parsed):
            if layer.media_type not in LAYER_COMPRESSION:
                raise ImageError(
                    f"{where}.layers[{i}]: layer media type {layer.media_type!r} is not a tar"
                    f" this runtime unpacks (known: {', '.join(sorted(LAYER_COMPRESSION))})"
                )
        return cls(Descriptor.parse(document.get("config"), f"{where}.config"), parsed)


def pick_platform(manifests: list[Descriptor], where: str, arch: str) -> Descriptor:
    """The index's manifest for linux/`arch` (an index without platforms: its only entry)."""
    wanted = [
        d
        for d in manifests
        if d.media_type in MANIFEST_TYPES
        and d.platform.get("os", "linux") == "linux"
        and d.platform.get("architecture", arch) == arch
    ]
    if not wanted:
        found = sorted(
            {f"{d.platform.get('os')}/{d.platform.get('architecture')}" for d in manifests}
        )
        raise ImageError(f"{where}: no manifest for linux/{arch} (it has {', '.join(found)})")
    return wanted[0]


@dataclass(frozen=True)
class ImageConfig:
    """What the image's config says about running it (the OCI config's `config` object), and
    the uncompressed digests of its layers (`rootfs.diff_ids`), bottom first."""

    diff_ids: tuple[str, ...]
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    architecture: str = ""

    @classmethod
    def parse(cls, document: Mapping[str, Any], where: str) -> ImageConfig:
        rootfs = document.get("rootfs")
        if not isinstance(rootfs, dict) or not isinstance(rootfs.get("diff_ids"), list):
            raise ImageError(f"{where}: the config must list rootfs.diff_ids")
        diff_ids = tuple(
            check_digest(d, f"{where}.rootfs.diff_ids[{i}]")
            for i, d in enumerate(rootfs["diff_ids"])
        )
        run = document.get("config") or {}
        if not isinstance(run, dict):
            raise ImageError(f"{where}.config must be an object")

        def strings(key: str) -> tuple[str, ...]:
            value = run.get(key) or []
            if isinstance(value, str):  # a few writers give a string where a list is due
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ImageError(f"{where}.config.{key} must be a list of strings")
            return tuple(value)

        def text(key: str) -> str:
            value = run.get(key) or ""
            if not isinstance(value, str):
                raise ImageError(f"{where}.config.{key} must be a string")
            return value

        env = strings("Env")
        for entry in env:
            if "=" not in entry or entry.startswith("="):
                raise ImageError(f"{where}.config.Env: {entry!r} is not NAME=VALUE")
        working_dir = text("WorkingDir")
        if working_dir and not working_dir.startswith("/"):
            raise ImageError(f"{where}.config.WorkingDir must be absolute, got {working_dir!r}")
        arch = document.get("architecture", "")
        return cls(
            diff_ids,
            env,
            working_dir,
            text("User"),
            strings("Entrypoint"),
            strings("Cmd"),
            arch if isinstance(arch, str) else "",
        )

    def environment(self) -> dict[str, str]:
        return dict(entry.split("=", 1) for entry in self.env)

    def command(self, args: list[str] | None = None) -> list[str]:
        """What `docker run IMAGE [ARGS]` runs: the entrypoint, then the arguments given or,
        without any, the image's Cmd."""
        return [*self.entrypoint, *(self.cmd if args is None else args)]
