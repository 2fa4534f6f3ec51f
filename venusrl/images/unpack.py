"""A layer tar unpacked into a directory of its own, ready to be an overlayfs lower layer.

Extraction never writes outside its directory: a name with `..`, an absolute name, or an entry
whose parent is a symlink (within the layer) is refused, and nothing is ever opened through a
symlink. Device nodes are dropped and setuid/setgid bits stripped (both reported); owners are
shifted into the sandboxes' id range (`uid_base` + the image's id), so the sandbox sees the
image's own owners. OCI whiteouts become what the kernel's overlay reads: `.wh.NAME` a 0:0
character device, `.wh..wh..opq` the opaque xattr (trusted.* for a mount by the host's root,
user.* for one inside a user namespace). Bytes and entries are bounded, and both the compressed
digest and the uncompressed one (the config's diff_id) are verified as the stream goes by.

The directory is the cache's private, fresh one: no one else writes there while this runs, so
checking each parent with lstat is not racy.
"""

from __future__ import annotations

import gzip
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from venusrl.images.oci import Digester, ImageError, Readable

ID_COUNT = 65536  # ids a sandbox's user namespace maps; others become nobody
NOBODY = 65534
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_bytes: int  # disk the layer may take once unpacked
    max_entries: int = 1_000_000


@dataclass
class UnpackReport:
    diff_id: str = ""
    entries: int = 0
    disk_bytes: int = 0
    dropped: list[str] = field(default_factory=list)  # device nodes, not written
    stripped: list[str] = field(default_factory=list)  # setuid/setgid bits removed
    nobody: list[str] = field(default_factory=list)  # owners outside the id range

    def notes(self) -> list[str]:
        """What was changed, for the log: counts and the first few entries of each."""
        out = []
        for what, names in (
            ("device nodes dropped", self.dropped),
            ("setuid/setgid bits stripped", self.stripped),
            ("owners past the id range made nobody", self.nobody),
        ):
            if names:
                shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                out.append(f"{len(names)} {what} ({shown})")
        return out


class _Hashing:
    """A read-only stream that hashes what passes through it, and refuses to pass more than
    `max_bytes` (what the manifest says the blob is, where it says)."""

    def __init__(
        self, raw: Readable, digester: Digester, max_bytes: int | None = None, what: str = ""
    ) -> None:
        self.raw, self.digester, self.max_bytes, self.what = raw, digester, max_bytes, what
        self.seen = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.seen += len(data)
        if self.max_bytes is not None and self.seen > self.max_bytes:
            raise ImageError(
                f"{self.what}: the blob is longer than the {self.max_bytes} bytes its manifest says"
            )
        self.digester.update(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


# Headers whose body tarfile reads whole into memory: long names and PAX records.
_META_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
_MAX_META = 1 << 20


class _BoundedInfo(tarfile.TarInfo):
    """A member header that refuses a long-name or PAX body past `_MAX_META` before tarfile
    reads it: a layer's header could otherwise ask for gigabytes of memory."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _META_TYPES and self.size > _MAX_META:
            raise tarfile.HeaderError(f"a {self.size}-byte extended header (over {_MAX_META})")
        return super()._proc_member(tarfile_)  # type: ignore[misc]


def _decompressed(raw: Readable, compression: str) -> Readable:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[call-overload]
    if compression == "zstd":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(
            raw,  # type: ignore[arg-type]
            read_across_frames=True,
        )
        return reader
    if compression == "none":
        return raw
    raise ImageError(f"unknown layer compression {compression!r}")


def clean_name(name: str, what: str) -> str:
    """The entry's path relative to the layer's root ("" for the root itself), or ImageError
    for one that would leave it."""
    if "\0" in name:
        raise ImageError(f"{what}: entry {name!r} has a NUL byte in its name")
    if name.startswith("/"):
        raise ImageError(f"{what}: entry {name!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"{what}: entry {name!r} climbs out of the layer with '..'")
    return "/".join(parts)


class _Layer:
    """One extraction: the destination, the id shift, the running totals."""

    def __init__(self, dest: Path, uid_base: int, limits: Limits, what: str) -> None:
        self.dest, self.uid_base, self.limits, self.what = dest, uid_base, limits, what
        self.report = UnpackReport()
        self.dir_times: list[tuple[str, float]] = []

    def fail(self, name: str, problem: str) -> ImageError:
        return ImageError(f"{self.what}: entry {name!r}: {problem}")

    def path(self, rel: str) -> str:
        return f"{self.dest}/{rel}" if rel else str(self.dest)

    def ids(self, info: tarfile.TarInfo, rel: str) -> tuple[int, int]:
        uid, gid = info.uid, info.gid
        if not (0 <= uid < ID_COUNT and 0 <= gid < ID_COUNT):
            self.report.nobody.append(rel)
            uid = uid if 0 <= uid < ID_COUNT else NOBODY
            gid = gid if 0 <= gid < ID_COUNT else NOBODY
        return self.uid_base + uid, self.uid_base + gid

    def parent_dir(self, rel: str, name: str) -> None:
        """Every directory above `rel`, made where missing; a symlink or a file on the way is
        refused, so nothing is ever written through a link."""
        parts = rel.split("/")[:-1]
        for i in range(len(parts)):
            sub = "/".join(parts[: i + 1])
            try:
                st = os.lstat(self.path(sub))
            except FileNotFoundError:
                os.mkdir(self.path(sub), 0o755)
                os.chown(self.path(sub), self.uid_base, self.uid_base)
                continue
            if stat.S_ISLNK(st.st_mode):
                raise self.fail(name, f"its parent {sub!r} is a symlink: it would be followed out")
            if stat.S_ISCHR(st.st_mode):  # a whiteout: deleted below, made again in this layer
                os.unlink(self.path(sub))
                os.mkdir(self.path(sub), 0o755)
                os.chown(self.path(sub), self.uid_base, self.uid_base)
                self.opaque(sub, name)
            elif not stat.S_ISDIR(st.st_mode):
                raise self.fail(name, f"its parent {sub!r} is not a directory")

    def opaque(self, rel: str, name: str) -> None:
        for key in OPAQUE_XATTRS:
            try:
                os.setxattr(self.path(rel), key, b"y", follow_symlinks=False)
            except OSError as e:
                raise self.fail(
                    name,
                    f"cannot mark {rel or '/'} opaque ({e.strerror}): the layer cache needs"
                    " a filesystem with trusted and user xattrs (ext4, xfs, btrfs)",
                ) from None

    def clear(self, rel: str, info: tarfile.TarInfo) -> bool:
        """Make room for `info` at `rel` (a later entry of the same name wins, as in tar);
        True when it replaces this layer's whiteout (a directory made again: opaque). Device
        nodes are never written, so a character device here is a whiteout."""
        try:
            st = os.lstat(self.path(rel))
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode) and info.isdir():
            return False
        if stat.S_ISDIR(st.st_mode):
            raise self.fail(
                info.name, "replaces a directory of the same layer with a non-directory"
            )
        os.unlink(self.path(rel))
        return stat.S_ISCHR(st.st_mode)

    def add(self, tar: tarfile.TarFile, info: tarfile.TarInfo) -> None:
        rel = clean_name(info.name, self.what)
        self.report.entries += 1
        if self.report.entries > self.limits.max_entries:
            raise self.fail(info.name, f"the layer has over {self.limits.max_entries} entries")
        if not rel:
            return  # the root's own entry: the cache owns the root
        self.parent_dir(rel, info.name)
        parent, _, base = rel.rpartition("/")
        if base == OPAQUE:
            self.opaque(parent, info.name)
            return
        if base.startswith(WHITEOUT):
            self.whiteout(parent, base[len(WHITEOUT) :], info.name)
            return
        replaces_whiteout = self.clear(rel, info)
        path = self.path(rel)
        uid, gid = self.ids(info, rel)
        mode = info.mode & 0o7777
        if mode & (stat.S_ISUID | stat.S_ISGID) and not info.isdir():
            self.report.stripped.append(rel)
            mode &= ~(stat.S_ISUID | stat.S_ISGID)
        if info.isdir():
            if not os.path.isdir(path):
                os.mkdir(path, 0o700)
            os.chmod(path, mode & ~stat.S_ISUID)
            self.dir_times.append((rel, info.mtime))
            self.report.disk_bytes += 4096
            if replaces_whiteout:
                self.opaque(rel, info.name)
        elif info.isreg():
            self.file(tar, info, path, mode)
        elif info.issym():
            if "\0" in info.linkname or len(info.linkname) > 4095:
                raise self.fail(info.name, "its symlink target is not a valid path")
            os.symlink(info.linkname, path)
        elif info.islnk():
            self.hardlink(info, path)
        elif info.isfifo():
            os.mkfifo(path, mode)
        elif info.ischr() or info.isblk():
            self.report.dropped.append(rel)
            return
        else:
            raise self.fail(info.name, f"unknown tar entry type {info.type!r}")
        os.chown(path, uid, gid, follow_symlinks=False)
        if not info.isdir():
            os.utime(path, (info.mtime, info.mtime), follow_symlinks=False)

    def file(self, tar: tarfile.TarFile, info: tarfile.TarInfo, path: str, mode: int) -> None:
        source = tar.extractfile(info)
        assert source is not None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            while chunk := source.read(_CHUNK):
                self.report.disk_bytes += len(chunk)
                if self.report.disk_bytes > self.limits.max_bytes:
                    raise self.fail(
                        info.name,
                        f"the layer passes its disk bound of {self.limits.max_bytes} bytes",
                    )
                os.write(fd, chunk)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def hardlink(self, info: tarfile.TarInfo, path: str) -> None:
        target = clean_name(info.linkname, self.what)
        if not target:
            raise self.fail(info.name, "hard-links to the layer's root")
        self.parent_dir(target, info.name)  # no symlink above the target: lstat follows those
        try:
            st = os.lstat(self.path(target))
        except FileNotFoundError:
            raise self.fail(
                info.name, f"hard-links to {target!r}, which the layer does not have"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise self.fail(info.name, f"hard-links to {target!r}, which is not a regular file")
        os.link(self.path(target), path, follow_symlinks=False)

    def whiteout(self, parent: str, name: str, entry: str) -> None:
        if not name or name in (".", ".."):
            raise self.fail(entry, "is a whiteout of nothing")
        rel = f"{parent}/{name}" if parent else name
        try:
            st = os.lstat(self.path(rel))
        except FileNotFoundError:
            os.mknod(self.path(rel), stat.S_IFCHR, os.makedev(0, 0))
            return
        if stat.S_ISDIR(st.st_mode):
            self.opaque(rel, entry)  # the lower one is gone, this layer's stays
        # a file of this layer hides the lower one already

    def finish(self) -> None:
        for rel, mtime in reversed(self.dir_times):
            os.utime(self.path(rel), (mtime, mtime), follow_symlinks=False)
        os.chown(self.dest, self.uid_base, self.uid_base)
        os.chmod(self.dest, 0o755)


def unpack_layer(
    blob: Readable,
    compression: str,
    dest: Path,
    *,
    blob_digest: str | None,
    blob_size: int | None,
    diff_id: str | None,
    uid_base: int,
    limits: Limits,
    what: str,
) -> UnpackReport:
    """Unpack the layer `blob` into the empty directory `dest`, verifying the blob against
    `blob_digest` and its length against `blob_size`, and the tar against `diff_id` (None:
    only computed). `what` names the image and layer in errors. `ImageError` on anything
    refused; `dest` is then the caller's to delete."""
    compressed = _Hashing(blob, Digester(blob_digest), blob_size, what)
    raw_tar = _Hashing(_decompressed(compressed, compression), Digester(diff_id))
    layer = _Layer(dest, uid_base, limits, what)
    try:
        with tarfile.open(  # type: ignore[call-overload]
            fileobj=raw_tar, mode="r|", tarinfo=_BoundedInfo
        ) as tar:
            for info in tar:
                layer.add(tar, info)
        raw_tar.drain()
        compressed.drain()
    except ImageError:
        raise
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, ValueError) as e:
        raise ImageError(f"{what}: not a readable {compression} tar: {e}") from None
    except OSError as e:
        raise ImageError(f"{what}: unpacking failed: {e}") from None
    if blob_digest is not None:
        compressed.digester.check(f"{what} (blob)")
    if diff_id is not None:
        raw_tar.digester.check(f"{what} (uncompressed, the config's diff_id)")
    layer.finish()
    layer.report.diff_id = raw_tar.digester.actual
    return layer.report
