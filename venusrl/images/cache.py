"""The layer cache: each layer unpacked once, by its diff_id, shared by every image, sandbox and
process on the machine, under a size bound.

    ROOT/cache.json              the id shift its layers were unpacked with
    ROOT/layers/sha256-HEX/      an unpacked layer (an overlay lower layer, never written again)
    ROOT/layers/sha256-HEX.json  its size and what unpacking changed
    ROOT/locks/sha256-HEX        flock: shared while a user holds the layer, exclusive while it
                                 is unpacked or evicted; its mtime is the layer's last use
    ROOT/tmp/                    unpacks in progress

Locks are per open file, so two threads of one process exclude each other as two processes
do: a layer asked for by several pulls at once is unpacked by the first, the others wait and
find it. Past the bound, the least recently used layers that nobody holds are evicted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from venusrl.images.oci import ImageError, Readable
from venusrl.images.sources import LayerBlob, sniff_compression
from venusrl.images.unpack import Limits, UnpackReport, unpack_layer

CACHE_VERSION = 1


@dataclass(frozen=True)
class CacheStats:
    layers: int
    disk_bytes: int
    max_bytes: int


def _key(diff_id: str) -> str:
    return diff_id.replace(":", "-")


class LayerCache:
    def __init__(self, root: Path, max_bytes: int, uid_base: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the layer cache's bound must be > 0 bytes, got {max_bytes}")
        self.root, self.max_bytes, self.uid_base = root, max_bytes, uid_base
        self.unpacked = 0  # layers this process unpacked (the others it found done)
        for sub in ("layers", "locks", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        # The host's root alone: sandboxes see layers only through the mounts it hands them
        # (read-only clones, made before they enter their user namespace), never by path.
        for d in (root, root / "layers", root / "locks", root / "tmp"):
            os.chmod(d, 0o700)
        self._check_meta()
        self._clean_tmp()

    def _check_meta(self) -> None:
        path = self.root / "cache.json"
        want = {"version": CACHE_VERSION, "uid_base": self.uid_base}
        with self._global_lock():
            if not path.exists():
                path.write_text(json.dumps(want))
                return
            try:
                have = json.loads(path.read_text())
            except ValueError:
                have = None
            if have != want:
                raise ImageError(
                    f"layer cache {self.root} was written for {have}, this runtime needs {want}:"
                    " give sandbox.image_cache_dir another directory, or remove this one"
                )

    def _clean_tmp(self) -> None:
        """Remove what unpacks that died left behind. An unpack holds its layer's lock alone
        for as long as its directory exists, so one whose lock is free is over (a pid would not
        say: the unpacker may live in another pid namespace)."""
        for entry in (self.root / "tmp").iterdir():
            with open(self.root / "locks" / entry.name.partition(".")[0], "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                shutil.rmtree(entry, ignore_errors=True)

    @contextlib.contextmanager
    def _global_lock(self) -> Iterator[None]:
        with open(self.root / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def layer_dir(self, diff_id: str) -> Path:
        return self.root / "layers" / _key(diff_id)

    def _meta(self, diff_id: str) -> Path:
        return self.root / "layers" / f"{_key(diff_id)}.json"

    # --- holding a layer ----------------------------------------------------------------------

    def hold(
        self,
        layer: LayerBlob,
        open_blob: Callable[[LayerBlob], contextlib.AbstractContextManager[Readable]],
        what: str,
    ) -> tuple[IO[str], Path]:
        """The layer's directory, unpacked here first if no one has, and the open lock file
        that keeps it from eviction until it is closed."""
        lock = open(self.root / "locks" / _key(layer.diff_id), "a")  # noqa: SIM115 (returned)
        try:
            while True:
                fcntl.flock(lock, fcntl.LOCK_SH)
                if self.layer_dir(layer.diff_id).is_dir():
                    os.utime(lock.fileno())
                    return lock, self.layer_dir(layer.diff_id)
                # Let go before asking for it alone: two holders turning shared into
                # exclusive at once would each wait for the other for ever.
                fcntl.flock(lock, fcntl.LOCK_UN)
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not self.layer_dir(layer.diff_id).is_dir():
                    self._unpack(layer, open_blob, what)
                    os.utime(lock.fileno())  # the newest use, before eviction can see it
                fcntl.flock(lock, fcntl.LOCK_UN)  # then shared, and look again
        except BaseException:
            lock.close()
            raise

    def _unpack(
        self,
        layer: LayerBlob,
        open_blob: Callable[[LayerBlob], contextlib.AbstractContextManager[Readable]],
        what: str,
    ) -> None:
        room = self._make_room(layer.size or 0)
        tmp = self.root / "tmp" / f"{_key(layer.diff_id)}.{uuid.uuid4().hex[:12]}"
        tmp.mkdir(mode=0o700)
        try:
            with open_blob(layer) as blob:
                compression, stream = layer.compression, blob
                if compression == "detect":
                    compression, stream = sniff_compression(blob)
                report = unpack_layer(
                    stream,
                    compression,
                    tmp,
                    blob_digest=layer.blob_digest,
                    blob_size=layer.size,
                    diff_id=layer.diff_id,
                    uid_base=self.uid_base,
                    limits=Limits(max_bytes=room),
                    what=what,
                )
            with self._global_lock():
                self._write_meta(layer.diff_id, report)
                tmp.rename(self.layer_dir(layer.diff_id))
            self.unpacked += 1
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.enforce_bound()

    def _write_meta(self, diff_id: str, report: UnpackReport) -> None:
        meta = {
            "diff_id": diff_id,
            "disk_bytes": report.disk_bytes,
            "entries": report.entries,
            "notes": report.notes(),
            "unpacked_at": time.time(),
        }
        self._meta(diff_id).write_text(json.dumps(meta))

    def notes(self, diff_id: str) -> list[str]:
        """What unpacking the layer changed (device nodes dropped, bits stripped)."""
        try:
            return list(json.loads(self._meta(diff_id).read_text()).get("notes", []))
        except (OSError, ValueError):
            return []

    # --- the bound ----------------------------------------------------------------------------

    def _layers(self) -> list[tuple[float, str, int]]:
        """(last use, diff_id, disk bytes) of each unpacked layer."""
        out = []
        for meta in (self.root / "layers").glob("*.json"):
            try:
                data = json.loads(meta.read_text())
                diff_id, size = str(data["diff_id"]), int(data["disk_bytes"])
            except (OSError, ValueError, KeyError):
                continue
            with contextlib.suppress(OSError):
                used = (self.root / "locks" / _key(diff_id)).stat().st_mtime
                out.append((used, diff_id, size))
        return out

    def stats(self) -> CacheStats:
        layers = self._layers()
        return CacheStats(len(layers), sum(s for _, _, s in layers), self.max_bytes)

    def _make_room(self, expected_bytes: int) -> int:
        """Evict what nobody holds so that a layer of about `expected_bytes` fits; the disk the
        new layer may then take (`ImageError` from the unpack past it)."""
        self.enforce_bound(self.max_bytes - expected_bytes)
        return self.max_bytes - self.stats().disk_bytes

    def enforce_bound(self, target_bytes: int | None = None) -> None:
        """Evict the least recently used layers nobody holds until the cache is under
        `target_bytes` (its bound by default)."""
        target = self.max_bytes if target_bytes is None else target_bytes
        with self._global_lock():
            layers = sorted(self._layers())
            used = sum(s for _, _, s in layers)
            for _, diff_id, size in layers:
                if used <= target:
                    return
                if self._evict(diff_id):
                    used -= size

    def _evict(self, diff_id: str) -> bool:
        with open(self.root / "locks" / _key(diff_id), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # someone holds it
            gone = self.root / "tmp" / f"{_key(diff_id)}.evicted-{uuid.uuid4().hex[:12]}"
            with contextlib.suppress(FileNotFoundError):
                self.layer_dir(diff_id).rename(gone)
            self._meta(diff_id).unlink(missing_ok=True)
        shutil.rmtree(gone, ignore_errors=True)
        return True
