"""Writing images: layer tars and the image formats the runtime reads (an OCI layout, an
oci-archive, a docker-archive in either of `docker save`'s forms).

Made for the images the tests, the benchmarks and the SWE example build on a machine that can
reach no registry: from this machine's own files (`host_files`: busybox and the host's Python with
the libraries it links) or from a root filesystem mmdebstrap wrote. skopeo and umoci read what
this writes (tests/images).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from venusrl.images.oci import OCI_CONFIG, OCI_INDEX, OCI_MANIFEST, REF_NAME
from venusrl.images.sources import host_arch

_LAYER_TYPES = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
_EPOCH = 1_700_000_000
# The image layout spec's grammar for org.opencontainers.image.ref.name (skopeo holds to it).
_REF_NAME = re.compile(
    r"[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*(?:/[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*)*"
)  # fixed mtimes: the same inputs give the same digests


class LayerWriter:
    """A layer tar, entry by entry (reproducible: fixed mtimes, root-owned by default)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
        self._dirs: set[str] = set()

    def _info(
        self, name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0
    ) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, uid, gid, _EPOCH
        return info

    def _parents(self, name: str) -> None:
        parts = name.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            self.dir("/".join(parts[: i + 1]))

    def dir(self, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        name = name.strip("/")
        if name in self._dirs:
            return
        self._parents(name)
        self._dirs.add(name)
        self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode, uid, gid))

    def file(self, name: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0) -> None:
        self._parents(name)
        info = self._info(name.strip("/"), tarfile.REGTYPE, mode, uid, gid)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def symlink(self, name: str, target: str) -> None:
        self._parents(name)
        info = self._info(name.strip("/"), tarfile.SYMTYPE, 0o777)
        info.linkname = target
        self.tar.addfile(info)

    def raw(self, info: tarfile.TarInfo, data: bytes | None = None) -> None:
        """An entry exactly as given (hostile layers in tests are written this way)."""
        if data is not None:
            info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data) if data is not None else None)

    def host_path(
        self, source: str, name: str | None = None, skip: frozenset[str] = frozenset()
    ) -> None:
        """A file, symlink or directory tree of this machine, at `name` (its own path by
        default), owners made root; entries named in `skip` are left out."""
        name = (name or source).strip("/")
        st = os.lstat(source)
        if os.path.islink(source):
            self.symlink(name, os.readlink(source))
        elif os.path.isdir(source):
            self.dir(name, st.st_mode & 0o7777)
            for child in sorted(os.listdir(source)):
                if child not in skip:
                    self.host_path(os.path.join(source, child), f"{name}/{child}", skip)
        elif os.path.isfile(source):
            self._parents(name)
            info = self._info(name, tarfile.REGTYPE, st.st_mode & 0o777)
            info.size = st.st_size
            with open(source, "rb") as f:
                self.tar.addfile(info, f)

    def close(self) -> Path:
        self.tar.close()
        return self.path


def shared_libraries(binaries: Iterable[str]) -> list[str]:
    """The shared libraries (and the loader) that `ldd` says `binaries` need."""
    found: set[str] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0] if parts else ""
            if path.startswith("/"):
                found.add(path)
    return sorted(found)


def host_files(layer: LayerWriter, binaries: Sequence[str], trees: Sequence[str] = ()) -> None:
    """This machine's `binaries` with every library they link, plus whole directory `trees`,
    at the same paths, with every link on the way to each (/lib -> usr/lib, the loader's own
    link) as a link: a small root in which they run."""
    added: set[str] = set()
    for path in [*binaries, *shared_libraries(binaries), *trees]:
        _add_resolving(layer, path, added)


def _add_resolving(layer: LayerWriter, path: str, added: set[str], hops: int = 0) -> None:
    if hops > 32:
        raise ValueError(f"{path}: too many links")
    parts = [p for p in path.split("/") if p]
    for i in range(1, len(parts) + 1):
        here = "/" + "/".join(parts[:i])
        if not os.path.islink(here):
            continue
        target = os.readlink(here)
        if here not in added:
            added.add(here)
            layer.symlink(here, target)
        base = os.path.dirname(here)
        resolved = target if target.startswith("/") else os.path.normpath(f"{base}/{target}")
        rest = "/".join(parts[i:])
        _add_resolving(layer, f"{resolved}/{rest}" if rest else resolved, added, hops + 1)
        return
    if path not in added:
        added.add(path)
        layer.host_path(path)


# Parts of a standard library no sandbox tool needs.
_STDLIB_SKIP = frozenset(
    {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}
    | {"site-packages", "dist-packages", "EXTERNALLY-MANAGED"}
)


def host_python(
    layer: LayerWriter, python: str = "/usr/bin/python3", packages: Sequence[str] = ()
) -> str:
    """This machine's (system) `python` with its standard library and the libraries its
    extension modules link, as python3 on /usr/bin; `packages` (directories of pure-Python
    packages, pytest's say) go to its dist-packages. The interpreter's path in the image."""
    real = os.path.realpath(python)
    version = os.path.basename(real)  # python3.11
    stdlib = f"/usr/lib/{version}"
    if not os.path.isdir(f"{stdlib}/encodings"):
        raise ValueError(f"{python} is not a system Python with its standard library at {stdlib}")
    dynload = f"{stdlib}/lib-dynload"
    extensions = [os.path.join(dynload, f) for f in os.listdir(dynload) if f.endswith(".so")]
    host_files(layer, [real, *extensions])
    skip = _STDLIB_SKIP | {n for n in os.listdir(stdlib) if n.startswith("config-")}
    layer.host_path(stdlib, skip=skip)
    for link in ("usr/bin/python3", "usr/bin/python"):
        layer.symlink(link, version)
    for package in packages:
        layer.host_path(package, f"usr/lib/python3/dist-packages/{os.path.basename(package)}")
    return "/usr/bin/python3"


def busybox_layer(layer: LayerWriter, busybox: str = "/bin/busybox") -> None:
    """busybox at /bin with a link for each applet: a shell and the coreutils."""
    layer.host_path(busybox, "bin/busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        if applet != "busybox":
            layer.symlink(f"bin/{applet}", "busybox")


# --- the image formats -------------------------------------------------------------------------


@dataclass
class ImageSpec:
    """An image's config and its layers (uncompressed tar files, bottom first)."""

    layers: list[Path]
    env: Mapping[str, str] = field(default_factory=lambda: {"PATH": "/usr/local/bin:/usr/bin:/bin"})
    working_dir: str = ""
    user: str = ""
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ("/bin/sh",)

    def config(self, diff_ids: list[str]) -> dict[str, object]:
        run: dict[str, object] = {"Env": [f"{k}={v}" for k, v in self.env.items()]}
        for key, value in (
            ("WorkingDir", self.working_dir),
            ("User", self.user),
            ("Entrypoint", list(self.entrypoint)),
            ("Cmd", list(self.cmd)),
        ):
            if value:
                run[key] = value
        return {
            "architecture": host_arch(),
            "os": "linux",
            "created": "2023-11-14T22:13:20Z",
            "config": run,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created_by": "venusrl.images.build"} for _ in diff_ids],
        }


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _put_blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (blobs / digest[7:]).write_bytes(data)
    return digest, len(data)


# (layer file, its size and mtime, compression) -> its blob's (digest, size): the images of one
# layout that share a base layer compress it once.
_compressed: dict[tuple[str, int, int, str], tuple[str, int]] = {}


def _compress(source: Path, blobs: Path, compression: str) -> tuple[str, int]:
    """The layer as a blob in `blobs`: (digest, size)."""
    st = source.stat()
    key = (str(source.resolve()), st.st_size, st.st_mtime_ns, compression)
    known = _compressed.get(key)
    if known is not None and (blobs / known[0][7:]).exists():
        return known
    tmp = blobs / f".tmp-{os.getpid()}"
    with open(source, "rb") as src, open(tmp, "wb") as out:
        if compression == "gzip":
            with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1, mtime=0) as gz:
                shutil.copyfileobj(src, gz, 1 << 20)
        elif compression == "zstd":
            import zstandard

            zstandard.ZstdCompressor(level=3).copy_stream(src, out)
        else:
            shutil.copyfileobj(src, out, 1 << 20)
    digest = _sha256_file(tmp)
    size = tmp.stat().st_size
    tmp.rename(blobs / digest[7:])
    _compressed[key] = (digest, size)
    return digest, size


def write_oci(
    spec: ImageSpec, directory: Path, tag: str = "latest", compression: str = "gzip"
) -> str:
    """The image as an OCI image layout at `directory` (created, or added to): its manifest's
    digest. `tag` is its `org.opencontainers.image.ref.name`."""
    if not _REF_NAME.fullmatch(tag):
        raise ValueError(
            f"{tag!r} is not an OCI ref name (alphanumerics joined by one of -._:@+ or --)"
        )
    blobs = directory / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (directory / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    diff_ids, layers = [], []
    for layer in spec.layers:
        diff_ids.append(_sha256_file(layer))
        digest, size = _compress(layer, blobs, compression)
        layers.append({"mediaType": _LAYER_TYPES[compression], "digest": digest, "size": size})
    config_digest, config_size = _put_blob(blobs, json.dumps(spec.config(diff_ids)).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size},
        "layers": layers,
    }
    manifest_digest, manifest_size = _put_blob(blobs, json.dumps(manifest).encode())
    index_path = directory / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    entries = [
        m
        for m in (index or {}).get("manifests", [])
        if m.get("annotations", {}).get(REF_NAME) != tag
    ]
    entries.append(
        {
            "mediaType": OCI_MANIFEST,
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": {REF_NAME: tag},
        }
    )
    index_path.write_text(
        json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries})
    )
    return manifest_digest


def write_oci_archive(
    spec: ImageSpec, path: Path, tag: str = "latest", compression: str = "gzip"
) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        digest = write_oci(spec, Path(tmp), tag, compression)
        with tarfile.open(path, "w") as tar:
            for name in sorted(os.listdir(tmp)):
                tar.add(os.path.join(tmp, name), arcname=name)
    return digest


def write_docker_archive(spec: ImageSpec, path: Path, repo_tag: str, form: str = "new") -> str:
    """What `docker save` writes: `form` "new" (manifest.json, Docker >= 1.10) or "old"
    (per-layer json and a parent chain); the image's id."""
    diff_ids = [_sha256_file(layer) for layer in spec.layers]
    config = json.dumps(spec.config(diff_ids)).encode()
    image_id = "sha256:" + hashlib.sha256(config).hexdigest()
    repo, _, tag = repo_tag.rpartition(":")
    layer_ids: list[str] = []
    for diff_id in diff_ids:  # v1 ids: a chain over the parents, as Docker derived them
        parent = layer_ids[-1] if layer_ids else ""
        layer_ids.append(hashlib.sha256(f"{parent} {diff_id}".encode()).hexdigest())
    with tarfile.open(path, "w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), _EPOCH, 0o644
            tar.addfile(info, io.BytesIO(data))

        for i, (layer, layer_id) in enumerate(zip(spec.layers, layer_ids, strict=True)):
            tar.add(str(layer), arcname=f"{layer_id}/layer.tar")
            add(f"{layer_id}/VERSION", b"1.0")
            meta: dict[str, object] = {"id": layer_id, "created": "2023-11-14T22:13:20Z"}
            if i:
                meta["parent"] = layer_ids[i - 1]
            if i == len(layer_ids) - 1:
                meta |= {
                    k: v
                    for k, v in spec.config(diff_ids).items()
                    if k in ("config", "architecture", "os")
                }
            add(f"{layer_id}/json", json.dumps(meta).encode())
        add("repositories", json.dumps({repo: {tag: layer_ids[-1]}}).encode())
        if form == "new":
            add(f"{image_id[7:]}.json", config)
            entry = {
                "Config": f"{image_id[7:]}.json",
                "RepoTags": [repo_tag],
                "Layers": [f"{lid}/layer.tar" for lid in layer_ids],
            }
            add("manifest.json", json.dumps([entry]).encode())
        elif form != "old":
            raise ValueError(f"form must be 'new' or 'old', got {form!r}")
    return image_id
