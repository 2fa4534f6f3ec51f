"""Images by reference, ready to be sandbox roots: resolved (from a local file or a registry),
their layers unpacked into the shared layer cache and held there while the image is in use.

An `Image` is what a sandbox pool needs of one: its layer directories (bottom first), what its
config says about running it (Env, WorkingDir, User, Entrypoint/Cmd), its user database, and
where its Python is, if it has one. `ImageStore.get` pulls an image once per store however many
callers ask at once; `Image.release` lets its layers be evicted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from venusrl.images.cache import LayerCache
from venusrl.images.oci import ImageConfig, ImageError
from venusrl.images.reference import ImageRef, parse_ref
from venusrl.images.registry import Registry, load_credentials
from venusrl.images.sources import ImageSource, local_source
from venusrl.images.unpack import ID_COUNT, OPAQUE_XATTRS

log = logging.getLogger(__name__)
# Where a Python may be, in the order looked at: the image's PATH comes first (`python_path`).
PYTHON_CANDIDATES = ("python3", "python")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class User:
    uid: int
    gid: int
    home: str
    name: str


@dataclass
class Image:
    ref: str
    image_id: str
    config: ImageConfig
    layers: tuple[Path, ...]  # unpacked, bottom first
    _locks: list[IO[str]] = field(default_factory=list, repr=False)

    # --- the merged tree, read without mounting ----------------------------------------------

    def lookup(self, path: str) -> tuple[Path, int] | None:
        """(the file, its lstat mode) that `path` is in the merged image, top layer first,
        honouring whiteouts and opaque directories; symlinks are not followed (one above
        `path` ends the lookup, as a file there does: either hides the layers below)."""
        parts = [p for p in path.split("/") if p]
        for layer in reversed(self.layers):
            hidden = False  # under an opaque directory of this layer: not in the ones below
            for depth in range(len(parts) + 1):
                here = layer.joinpath(*parts[:depth])
                try:
                    st = here.lstat()
                except (FileNotFoundError, NotADirectoryError):
                    break
                if stat.S_ISCHR(st.st_mode):  # a whiteout: gone below too
                    return None
                if depth == len(parts):
                    return here, st.st_mode
                if not stat.S_ISDIR(st.st_mode):
                    return None
                if depth > 0 and _opaque(here):
                    hidden = True
            if hidden:
                return None
        return None

    def read_text(self, path: str, limit: int = 4 << 20) -> str | None:
        found = self.lookup(path)
        if found is None or not stat.S_ISREG(found[1]):
            return None
        with open(found[0], "rb") as f:
            return f.read(limit).decode(errors="replace")

    def resolve_exec(self, name: str, path_var: str) -> str | None:
        """Where `name` is found on `path_var` in the image, following its symlinks inside the
        image (a relative or absolute link is resolved against the image's root)."""
        for directory in path_var.split(":"):
            if not directory.startswith("/"):
                continue
            candidate = self._follow(f"{directory.rstrip('/')}/{name}")
            if candidate is not None:
                return f"{directory.rstrip('/')}/{name}"
        return None

    def _follow(self, path: str, hops: int = 16) -> str | None:
        """`path` if it is (a link chain to) an executable regular file in the image."""
        for _ in range(hops):
            found = self.lookup(path)
            if found is None:
                return None
            file, mode = found
            if stat.S_ISREG(mode):
                return path if mode & 0o111 else None
            if not stat.S_ISLNK(mode):
                return None
            target = os.readlink(file)
            parent = path.rsplit("/", 1)[0]
            path = _normalize(target if target.startswith("/") else f"{parent}/{target}")
        return None

    # --- what the config says ------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        env = self.config.environment()
        env.setdefault("PATH", _DEFAULT_PATH)
        return env

    def python_path(self) -> str | None:
        """The image's Python interpreter (on its PATH), or None."""
        path_var = self.environment()["PATH"]
        for name in PYTHON_CANDIDATES:
            found = self.resolve_exec(name, path_var)
            if found is not None:
                return found
        return None

    def user(self, spec: str | None = None) -> User:
        """The config's `User` (or `spec`), as Docker reads it: NAME or UID, with an optional
        :GROUP or :GID; names are looked up in the image's /etc/passwd and /etc/group."""
        spec = (self.config.user if spec is None else spec) or "0"
        name, _, group = spec.partition(":")
        passwd = [e for e in _table(self.read_text("/etc/passwd")) if len(e) >= 7]
        groups = [g for g in _table(self.read_text("/etc/group")) if len(g) >= 3]
        key = 2 if name.isdigit() else 0
        entry = next((e for e in passwd if e[key] == name and e[2].isdigit()), None)
        if entry is None and not name.isdigit():
            raise ImageError(
                f"image {self.ref}: user {name!r} (its config's User) is not in its /etc/passwd"
            )
        uid = int(name) if name.isdigit() else int(entry[2])  # type: ignore[index]
        # Docker's rule: a uid the image does not list runs with gid 0.
        gid = int(entry[3]) if entry is not None and entry[3].isdigit() else 0
        if group:
            if group.isdigit():
                gid = int(group)
            else:
                match = next((g for g in groups if g[0] == group), None)
                if match is None or not match[2].isdigit():
                    raise ImageError(f"image {self.ref}: group {group!r} is not in /etc/group")
                gid = int(match[2])
        if not (0 <= uid < ID_COUNT and 0 <= gid < ID_COUNT):
            raise ImageError(
                f"image {self.ref}: user {spec!r} is uid {uid} gid {gid}, outside the"
                f" {ID_COUNT} ids a sandbox maps"
            )
        home = entry[5] if entry is not None and entry[5].startswith("/") else "/"
        return User(uid, gid, home, entry[0] if entry is not None else name)

    def release(self) -> None:
        """Its layers may be evicted once no other holder has them."""
        for lock in self._locks:
            lock.close()
        self._locks.clear()


def _opaque(directory: Path) -> bool:
    for key in OPAQUE_XATTRS:
        with contextlib.suppress(OSError):
            if os.getxattr(directory, key, follow_symlinks=False) == b"y":
                return True
    return False


def _normalize(path: str) -> str:
    """An absolute path with `.` and `..` resolved as the kernel does at the root."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part and part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


def _table(text: str | None) -> list[list[str]]:
    if not text:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


class ImageStore:
    """Images of one machine's layer cache. Thread- and process-safe; `get` from asyncio."""

    def __init__(
        self,
        cache_dir: Path,
        max_bytes: int,
        uid_base: int,
        credentials_file: Path | None = None,
        insecure_registries: tuple[str, ...] = (),
    ) -> None:
        self.cache = LayerCache(cache_dir, max_bytes, uid_base)
        self.credentials_file = credentials_file
        self.insecure = insecure_registries
        self._images: dict[str, Image] = {}
        self._holders: dict[str, int] = {}
        self._pulling: dict[str, asyncio.Future[Image]] = {}
        self._noted: set[str] = set()  # layers whose unpack notes were logged

    def source(self, ref: ImageRef) -> ImageSource:
        if ref.is_registry:
            return Registry(ref, load_credentials(self.credentials_file), self.insecure)
        return local_source(ref)

    def pull(self, reference: str) -> Image:
        """The image, its layers unpacked and held (blocking: resolving and unpacking)."""
        ref = parse_ref(reference)
        source = self.source(ref)
        try:
            resolved = source.resolve()
            image = Image(str(ref), resolved.image_id, resolved.config, ())
            dirs = []
            try:
                for i, layer in enumerate(resolved.layers):
                    what = f"image {ref}: layer {i} ({layer.blob_digest or layer.diff_id})"
                    lock, path = self.cache.hold(layer, source.open_layer, what)
                    image._locks.append(lock)
                    dirs.append(path)
                    if layer.diff_id not in self._noted:  # once per layer, not per image
                        self._noted.add(layer.diff_id)
                        for note in self.cache.notes(layer.diff_id):
                            log.warning("%s: %s", what, note)
            except BaseException:
                image.release()
                raise
        finally:
            if isinstance(source, Registry):
                source.close()
        image.layers = tuple(dirs)
        return image

    async def get(self, reference: str) -> Image:
        """`pull`, once per store for each reference however many ask at once; each `get`
        holds the image until its `put`."""
        if reference not in self._images:
            pending = self._pulling.get(reference)
            if pending is None:
                pending = asyncio.ensure_future(asyncio.to_thread(self.pull, reference))
                self._pulling[reference] = pending
                pending.add_done_callback(lambda _: self._pulling.pop(reference, None))
            image = await asyncio.shield(pending)
            self._images.setdefault(reference, image)
        self._holders[reference] = self._holders.get(reference, 0) + 1
        return self._images[reference]

    def put(self, reference: str) -> None:
        """One holder is done with the image: with the last, its layers may be evicted."""
        left = self._holders.get(reference, 0) - 1
        if left > 0:
            self._holders[reference] = left
            return
        self._holders.pop(reference, None)
        image = self._images.pop(reference, None)
        if image is not None:
            image.release()

    def close(self) -> None:
        for image in self._images.values():
            image.release()
        self._images.clear()
        self._holders.clear()
