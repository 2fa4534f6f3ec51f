"""Framing between the pool and its zygotes and sandbox members.

A frame is a 4-byte big-endian header length, a JSON header, then raw byte blobs whose lengths the
header lists under "blobs". JSON and sizes only: the pool never unpickles anything a sandbox sends,
and it refuses frames larger than it asked for, so a hostile sandbox cannot make it run code or
allocate without bound.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

MAX_HEADER_BYTES = 1 << 20
_LEN = struct.Struct(">I")

Header = dict[str, Any]


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


def send(sock: socket.socket, header: Header, blobs: tuple[bytes, ...] = ()) -> None:
    sock.sendall(encode(header, blobs))


def recv(sock: socket.socket, max_blob_bytes: int = 1 << 30) -> tuple[Header, list[bytes]]:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_HEADER_BYTES:
        raise WireError(f"frame header of {n} bytes is over the limit")
    header, sizes = _parse_header(_recv_exact(sock, n), max_blob_bytes)
    return header, [_recv_exact(sock, s) for s in sizes]


def send_with_fd(sock: socket.socket, header: Header, fd: int) -> None:
    data = encode(header)
    socket.send_fds(sock, [data], [fd])


def recv_with_fd(sock: socket.socket) -> tuple[Header, int | None]:
    """A frame that may carry one file descriptor (SCM_RIGHTS), received close-on-exec."""
    data, fds, _flags, _addr = socket.recv_fds(
        sock, MAX_HEADER_BYTES + 4, 1, socket.MSG_CMSG_CLOEXEC
    )
    if len(data) < 4:
        raise EOFError
    (n,) = _LEN.unpack(data[:4])
    header, _ = _parse_header(data[4 : 4 + n], 0)
    return header, (fds[0] if fds else None)


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
