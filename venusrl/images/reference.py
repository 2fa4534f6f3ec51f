"""Image references, in skopeo's transport syntax, which SWE datasets' users already write:

    oci:PATH[:TAG]                  an OCI image layout directory
    oci-archive:PATH[:TAG]          a tar of one
    docker-archive:PATH[:NAME:TAG]  what `docker save` writes (either of its forms)
    docker://NAME[:TAG][@DIGEST]    a registry (the OCI distribution API)
    NAME[:TAG][@DIGEST]             the same as docker://NAME, as Docker reads it

A registry name without a host is Docker Hub's (`python` is docker.io/library/python:latest).
Local paths may not contain a colon: the first one after the path ends it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from venusrl.images.oci import ImageError, check_digest

LOCAL_TRANSPORTS = ("oci", "oci-archive", "docker-archive")
# skopeo's other transports: named so that a user who writes one is told, not sent to a registry.
UNSUPPORTED_TRANSPORTS = ("dir", "containers-storage", "docker-daemon", "ostree", "sif", "tarball")
DOCKER_HUB = "docker.io"
_NAME = re.compile(
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
)
_TAG = re.compile(r"[\w][\w.-]{0,127}")


@dataclass(frozen=True)
class ImageRef:
    transport: str  # "docker" (a registry) or one of LOCAL_TRANSPORTS
    path: str = ""  # local transports: the file or directory
    tag: str = ""  # local: the ref name or NAME:TAG picked inside it ("" = the only one)
    registry: str = ""  # docker: the host[:port]
    repository: str = ""  # docker: the repository, e.g. library/python
    digest: str = ""  # docker: a pinned manifest digest

    @property
    def is_registry(self) -> bool:
        return self.transport == "docker"

    def __str__(self) -> str:
        if not self.is_registry:
            return f"{self.transport}:{self.path}" + (f":{self.tag}" if self.tag else "")
        name = f"{self.registry}/{self.repository}"
        return (
            name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")
        )


def parse_ref(text: str) -> ImageRef:
    """`text` as an `ImageRef`, or `ImageError` saying what is wrong with it."""
    if not isinstance(text, str) or not text.strip():
        raise ImageError(f"an image reference must be a non-empty string, got {text!r}")
    transport, sep, rest = text.partition(":")
    if sep and transport in LOCAL_TRANSPORTS:
        path, _, tag = rest.partition(":")
        if not path:
            raise ImageError(f"image {text!r}: {transport}: needs a path")
        return ImageRef(transport, path=path, tag=tag)
    if sep and transport in UNSUPPORTED_TRANSPORTS:
        supported = ", ".join(f"{t}:" for t in (*LOCAL_TRANSPORTS, "docker"))
        raise ImageError(f"image {text!r}: transport {transport}: is not supported ({supported})")
    return _docker(text.removeprefix("docker://"))


def _docker(text: str) -> ImageRef:
    name, _, digest = text.partition("@")
    if digest:
        check_digest(digest, f"image {text!r}")
    tag = ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise ImageError(f"image {text!r}: {tag!r} is not a valid tag")
    first, slash, remainder = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, remainder
    else:
        registry, repository = DOCKER_HUB, name
        if "/" not in repository:
            repository = f"library/{repository}"
    if not _NAME.fullmatch(repository):
        raise ImageError(f"image {text!r}: {repository!r} is not a valid repository name")
    if not tag and not digest:
        tag = "latest"
    return ImageRef("docker", registry=registry, repository=repository, tag=tag, digest=digest)
