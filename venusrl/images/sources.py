"""Where an image's bytes come from, on this machine: an OCI image layout directory, a tar of one
(oci-archive), or what `docker save` writes (docker-archive, either form). The registry is
`registry.py`; both give a `Resolved` image and open its layers' blobs.

`docker save`'s forms: since Docker 1.10 a `manifest.json` lists each image's config and layer
tars (since Docker 25 beside an OCI layout in the same tar); before it, a `repositories` file
names each tag's top layer, and each layer's directory holds its `json` (with its parent's id
and, at the top, the image's config) and its `layer.tar`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from venusrl.images.oci import (
    INDEX_TYPES,
    LAYER_COMPRESSION,
    MANIFEST_TYPES,
    REF_NAME,
    Descriptor,
    ImageConfig,
    ImageError,
    Manifest,
    Readable,
    load_json,
    media_type_of,
    parse_index,
    pick_platform,
    sha256_digest,
    verified,
)
from venusrl.images.reference import ImageRef

_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def host_arch() -> str:
    return _ARCH.get(platform.machine(), platform.machine())


@dataclass(frozen=True)
class LayerBlob:
    """One layer to unpack: its blob's digest where a manifest gives one (a docker-archive gives
    none), its compression ("detect": read from its first bytes) and its diff_id."""

    diff_id: str
    blob_digest: str | None
    compression: str
    size: int | None = None


@dataclass(frozen=True)
class Resolved:
    """An image read far enough to run: its id, its config, its layers bottom first."""

    image_id: str  # the manifest's digest, or the config's for a docker-archive
    config: ImageConfig
    layers: tuple[LayerBlob, ...]


class ImageSource(Protocol):
    name: str  # the reference, for errors

    def resolve(self) -> Resolved: ...

    def open_layer(self, layer: LayerBlob) -> contextlib.AbstractContextManager[Readable]: ...


def sniff_compression(stream: Readable) -> tuple[str, Readable]:
    """(compression, the same stream from its first byte) by the blob's magic number."""
    head = stream.read(4)
    rest: Readable = _Prefixed(head, stream)
    if head[:2] == b"\x1f\x8b":
        return "gzip", rest
    if head == b"\x28\xb5\x2f\xfd":
        return "zstd", rest
    return "none", rest


class _Prefixed(io.RawIOBase):
    def __init__(self, head: bytes, rest: Readable) -> None:
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out = self.head if n < 0 else self.head[:n]
            self.head = self.head[len(out) :]
            if n < 0:
                out += self.rest.read()
            return out
        return self.rest.read(n)


# --- files of a directory or of a tar ----------------------------------------------------------


class _Files(Protocol):
    def read(self, path: str, limit: int) -> bytes: ...

    def exists(self, path: str) -> bool: ...

    def open(self, path: str) -> contextlib.AbstractContextManager[Readable]: ...


class _DirFiles:
    def __init__(self, root: Path, name: str) -> None:
        if not root.is_dir():
            raise ImageError(f"image {name}: {root} is not a directory")
        self.root, self.name = root, name

    def _path(self, path: str) -> Path:
        if path.startswith("/") or ".." in path.split("/"):
            raise ImageError(f"image {self.name}: {path!r} points outside the image")
        return self.root / path

    def exists(self, path: str) -> bool:
        return self._path(path).is_file()

    def read(self, path: str, limit: int) -> bytes:
        try:
            with open(self._path(path), "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise ImageError(f"image {self.name}: cannot read {path}: {e.strerror}") from None
        if len(data) > limit:
            raise ImageError(f"image {self.name}: {path} is over {limit} bytes")
        return data

    @contextlib.contextmanager
    def open(self, path: str) -> Iterator[Readable]:
        try:
            f = open(self._path(path), "rb")  # noqa: SIM115 (closed below)
        except OSError as e:
            raise ImageError(f"image {self.name}: cannot read {path}: {e.strerror}") from None
        with f:
            yield f


class _TarFiles:
    def __init__(self, path: Path, name: str) -> None:
        self.name = name
        try:
            self.tar = tarfile.open(path, "r:*")  # noqa: SIM115 (open while the source is)
            members = self.tar.getmembers()
        except (OSError, tarfile.TarError) as e:
            raise ImageError(f"image {name}: cannot read {path} as a tar: {e}") from None
        self.members = {m.name.removeprefix("./"): m for m in members}

    def exists(self, path: str) -> bool:
        return path in self.members

    @contextlib.contextmanager
    def open(self, path: str) -> Iterator[Readable]:
        member = self.members.get(path)
        f = None
        if member is not None:
            with contextlib.suppress(KeyError, tarfile.TarError):  # a link to nothing
                f = self.tar.extractfile(member)
        if f is None:
            raise ImageError(f"image {self.name}: the archive has no file {path!r}")
        with f:
            yield f

    def read(self, path: str, limit: int) -> bytes:
        with self.open(path) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ImageError(f"image {self.name}: {path} is over {limit} bytes")
        return data


_JSON_LIMIT = 4 << 20


# --- OCI layouts --------------------------------------------------------------------------------


def _blob_path(digest: str) -> str:
    algorithm, _, hexpart = digest.partition(":")
    return f"blobs/{algorithm}/{hexpart}"


class OciLayout:
    """An OCI image layout (`oci:` a directory, `oci-archive:` a tar of one)."""

    def __init__(self, ref: ImageRef, files: _Files | None = None) -> None:
        self.name, self.ref = str(ref), ref
        path = Path(ref.path)
        self.files: _Files = files or (
            _DirFiles(path, self.name) if ref.transport == "oci" else _TarFiles(path, self.name)
        )

    def _blob(self, d: Descriptor, what: str) -> bytes:
        data = self.files.read(_blob_path(d.digest), _JSON_LIMIT)
        return verified(data, d.digest, f"image {self.name}: {what} {d.digest}")

    def _top(self) -> Descriptor:
        where = f"image {self.name}: index.json"
        layout = load_json(
            self.files.read("oci-layout", _JSON_LIMIT), f"image {self.name}: oci-layout"
        )
        if not str(layout.get("imageLayoutVersion", "")).startswith("1."):
            raise ImageError(f"image {self.name}: oci-layout version {layout!r} is not 1.x")
        manifests = parse_index(load_json(self.files.read("index.json", _JSON_LIMIT), where), where)
        if self.ref.tag:
            named = [d for d in manifests if d.annotations.get(REF_NAME) == self.ref.tag]
            if not named:
                tags = sorted({d.annotations.get(REF_NAME, "") for d in manifests} - {""})
                raise ImageError(
                    f"image {self.name}: no manifest named {self.ref.tag!r} (it has {tags})"
                )
            return named[0]
        if len(manifests) != 1:
            tags = sorted({d.annotations.get(REF_NAME, "") for d in manifests} - {""})
            raise ImageError(
                f"image {self.name}: the layout holds {len(manifests)} images; name one {tags}"
            )
        return manifests[0]

    def resolve(self) -> Resolved:
        return resolve_manifest(self.name, self._top(), self._blob)

    def open_layer(self, layer: LayerBlob) -> contextlib.AbstractContextManager[Readable]:
        assert layer.blob_digest is not None
        return self.files.open(_blob_path(layer.blob_digest))


def resolve_manifest(name: str, top: Descriptor, fetch: Any) -> Resolved:
    """From a descriptor of a manifest or an index (followed to this machine's platform) to the
    image; `fetch(descriptor, what)` gives a blob's bytes, verified."""
    descriptor = top
    for _ in range(3):  # an index of indexes is legal, a loop is not
        raw = fetch(descriptor, "manifest")
        document = load_json(raw, f"image {name}: manifest {descriptor.digest}")
        kind = media_type_of(document, descriptor.media_type)
        if kind in INDEX_TYPES or (kind is None and "manifests" in document):
            where = f"image {name}: index {descriptor.digest}"
            descriptor = pick_platform(parse_index(document, where), where, host_arch())
            continue
        if kind not in MANIFEST_TYPES and kind is not None:
            raise ImageError(f"image {name}: {descriptor.digest} has media type {kind!r}")
        manifest = Manifest.parse(document, f"image {name}: manifest {descriptor.digest}")
        return _with_config(name, descriptor.digest, manifest, fetch)
    raise ImageError(f"image {name}: indexes nest too deep")


def _with_config(name: str, image_id: str, manifest: Manifest, fetch: Any) -> Resolved:
    where = f"image {name}: config {manifest.config.digest}"
    config = ImageConfig.parse(load_json(fetch(manifest.config, "config"), where), where)
    if len(config.diff_ids) != len(manifest.layers):
        raise ImageError(
            f"image {name}: the manifest has {len(manifest.layers)} layers, the config"
            f" {len(config.diff_ids)} diff_ids"
        )
    layers = tuple(
        LayerBlob(diff_id, d.digest, LAYER_COMPRESSION[d.media_type], d.size)
        for diff_id, d in zip(config.diff_ids, manifest.layers, strict=True)
    )
    return Resolved(image_id, config, layers)


# --- docker save -------------------------------------------------------------------------------


class DockerArchive:
    """What `docker save` writes; `docker-archive:PATH:NAME:TAG` picks one of its images."""

    def __init__(self, ref: ImageRef) -> None:
        self.name, self.ref = str(ref), ref
        self.files = _TarFiles(Path(ref.path), self.name)
        self._layer_paths: dict[str, str] = {}  # diff_id -> member

    def resolve(self) -> Resolved:
        if self.files.exists("manifest.json"):
            return self._new_form()
        if self.files.exists("repositories"):
            return self._old_form()
        raise ImageError(
            f"image {self.name}: neither manifest.json nor repositories: not a docker-archive"
        )

    def open_layer(self, layer: LayerBlob) -> contextlib.AbstractContextManager[Readable]:
        return self.files.open(self._layer_paths[layer.diff_id])

    def _new_form(self) -> Resolved:
        raw = self.files.read("manifest.json", _JSON_LIMIT)
        try:
            entries = json.loads(raw)
        except ValueError as e:
            raise ImageError(f"image {self.name}: manifest.json is not JSON ({e})") from None
        if not isinstance(entries, list) or not entries:
            raise ImageError(f"image {self.name}: manifest.json must list the images")
        entry = self._pick(entries)
        config_path, layer_paths = entry.get("Config"), entry.get("Layers")
        if not isinstance(config_path, str) or not isinstance(layer_paths, list):
            raise ImageError(f"image {self.name}: manifest.json entries need Config and Layers")
        raw_config = self.files.read(config_path, _JSON_LIMIT)
        image_id = sha256_digest(raw_config)
        stem = Path(config_path).name.removesuffix(".json")
        if len(stem) == 64 and image_id != f"sha256:{stem}":  # named after its own digest
            raise ImageError(
                f"image {self.name}: config {config_path}: digest mismatch ({image_id})"
            )
        where = f"image {self.name}: {config_path}"
        config = ImageConfig.parse(load_json(raw_config, where), where)
        if len(config.diff_ids) != len(layer_paths):
            raise ImageError(
                f"image {self.name}: {len(layer_paths)} layers listed, {len(config.diff_ids)}"
                " diff_ids in the config"
            )
        for diff_id, path in zip(config.diff_ids, layer_paths, strict=True):
            if not isinstance(path, str):
                raise ImageError(f"image {self.name}: manifest.json: a layer path must be a string")
            self._layer_paths[diff_id] = path
        layers = tuple(LayerBlob(d, None, "detect") for d in config.diff_ids)
        return Resolved(image_id, config, layers)

    def _pick(self, entries: list[Any]) -> Any:
        if not self.ref.tag:
            if len(entries) > 1:
                raise ImageError(
                    f"image {self.name}: the archive holds {len(entries)} images; name one"
                    " (docker-archive:PATH:NAME:TAG)"
                )
            return entries[0]
        wanted = self.ref.tag if ":" in self.ref.tag else f"{self.ref.tag}:latest"
        for entry in entries:
            tags = entry.get("RepoTags") or [] if isinstance(entry, dict) else []
            if wanted in tags or f"docker.io/library/{wanted}" in tags:
                return entry
        raise ImageError(f"image {self.name}: no image tagged {wanted!r} in the archive")

    def _old_form(self) -> Resolved:
        repos = load_json(self.files.read("repositories", _JSON_LIMIT), f"image {self.name}")
        tops = [
            (f"{repo}:{tag}", top)
            for repo, tags in repos.items()
            if isinstance(tags, dict)
            for tag, top in tags.items()
        ]
        if self.ref.tag:
            wanted = self.ref.tag if ":" in self.ref.tag else f"{self.ref.tag}:latest"
            tops = [t for t in tops if t[0] == wanted]
        if len(tops) != 1:
            raise ImageError(f"image {self.name}: name one image of {[t[0] for t in tops]}")
        chain: list[str] = []
        layer_id, top_json = tops[0][1], None
        while layer_id:
            if not isinstance(layer_id, str) or not layer_id.isalnum() or len(chain) > 500:
                raise ImageError(f"image {self.name}: bad layer id {layer_id!r}")
            meta = load_json(self.files.read(f"{layer_id}/json", _JSON_LIMIT), f"image {self.name}")
            top_json = top_json or meta
            chain.append(layer_id)
            layer_id = meta.get("parent", "")
        chain.reverse()
        diff_ids = []
        for layer_id in chain:  # no content digests in this form: the tar's own sha256 is it
            with self.files.open(f"{layer_id}/layer.tar") as f:
                diff_id = _sha256_stream(f)
            self._layer_paths[diff_id] = f"{layer_id}/layer.tar"
            diff_ids.append(diff_id)
        assert top_json is not None
        run = top_json.get("config") or top_json.get("container_config") or {}
        document = {
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "config": run,
            "architecture": top_json.get("architecture", ""),
        }
        config = ImageConfig.parse(document, f"image {self.name}: {chain[-1]}/json")
        # Layer ids of this form are random, not digests: the image is named by its content.
        image_id = sha256_digest(json.dumps(document, sort_keys=True).encode())
        layers = tuple(LayerBlob(d, None, "detect") for d in diff_ids)
        return Resolved(image_id, config, layers)


def _sha256_stream(f: Readable) -> str:
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def local_source(ref: ImageRef) -> ImageSource:
    if ref.transport == "docker-archive":
        return DockerArchive(ref)
    if ref.transport in ("oci", "oci-archive"):
        if not os.path.exists(ref.path):
            raise ImageError(f"image {ref}: {ref.path} does not exist")
        return OciLayout(ref)
    raise ImageError(f"image {ref}: not a local image")
