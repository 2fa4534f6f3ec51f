"""Framing between the pool and its zygotes and sandbox members.

A frame is a 4-byte big-endian header length, a JSON header, then raw byte blobs whose lengths the
header lists under "blobs". JSON and sizes only: the pool never unpickles anything a sandbox sends,
and it refuses frames larger than it asked for, so a hostile sandbox cannot make it run code or
allocate without bound. The blocking side also runs on an image's own Python (3.8 syntax).
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:  # the sandbox's side never imports asyncio: it costs a zygote's start
    import asyncio

MAX_HEADER_BYTES = 1 << 20
_LEN = struct.Struct(">I")

Header = Dict[str, Any]


class WireError(Exception):
    """The peer sent something that is not a well-formed frame within the limits."""


def encode(header: Header, blobs: tuple[bytes, ...] = ()) -> bytes:
    head = json.dumps({**header, "blobs": [len(b) for b in blobs]}).encode()
    return b"".join((_LEN.pack(len(head)), head, *blobs))


def _parse_header(
    raw: bytes, max_blob_bytes: int | Callable[[Header], int]
) -> tuple[Header, list[int]]:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # deep nesting is hostile too
        raise WireError(f"bad frame header: {e!r}") from None
    sizes = header.get("blobs", []) if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise WireError("frame header must be an object with a list of blob sizes")
    if callable(max_blob_bytes):
        max_blob_bytes = max_blob_bytes(header)
    if sum(sizes) > max_blob_bytes:
        raise WireError(f"frame of {sum(sizes)} bytes is over the limit of {max_blob_bytes}")
    return header, sizes


# --- blocking side (zygote and member processes) ----------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send(
    sock: socket.socket, header: Header, blobs: tuple[bytes, ...] = (), fds: tuple[int, ...] = ()
) -> None:
    """A frame, and `fds` passed with its first bytes (SCM_RIGHTS)."""
    data = encode(header, blobs)
    if fds:
        rights = array.array("i", fds).tobytes()
        sent = sock.sendmsg([data[:4]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        data = data[sent:]
    sock.sendall(data)


def recv_with_fds(
    sock: socket.socket, max_fds: int, max_blob_bytes: int = 1 << 30
) -> tuple[Header, list[bytes], list[int]]:
    """A frame and the file descriptors that came with it (at most `max_fds`, close-on-exec)."""
    fds: list[int] = []
    prefix = b""
    if max_fds:
        space = socket.CMSG_SPACE(max_fds * array.array("i").itemsize)
        prefix, ancillary, _flags, _addr = sock.recvmsg(4, space, socket.MSG_CMSG_CLOEXEC)
        if not prefix:
            raise EOFError
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(data[: len(data) - len(data) % got.itemsize])
                fds.extend(got)
    try:
        (n,) = _LEN.unpack(prefix + _recv_exact(sock, 4 - len(prefix)))
        if n > MAX_HEADER_BYTES:
            raise WireError(f"frame header of {n} bytes is over the limit")
        header, sizes = _parse_header(_recv_exact(sock, n), max_blob_bytes)
        return header, [_recv_exact(sock, size) for size in sizes], fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def recv(sock: socket.socket, max_blob_bytes: int = 1 << 30) -> tuple[Header, list[bytes]]:
    header, blobs, _ = recv_with_fds(sock, 0, max_blob_bytes)
    return header, blobs


# --- asyncio side (the pool) -------------------------------------------------------------------


async def read(
    reader: asyncio.StreamReader, max_blob_bytes: int | Callable[[Header], int]
) -> tuple[Header, list[bytes]]:
    """`max_blob_bytes` may depend on the header (on which request a reply answers)."""
    (n,) = _LEN.unpack(await reader.readexactly(4))
    if n > MAX_HEADER_BYTES:
        raise WireError(f"frame header of {n} bytes is over the limit")
    header, sizes = _parse_header(await reader.readexactly(n), max_blob_bytes)
    return header, [await reader.readexactly(s) for s in sizes]
