"""Small images built here in seconds, from this machine's own files: busybox (a shell and the
coreutils), and busybox with Debian's python3, pytest and git."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from venusrl.images.build import ImageSpec, LayerWriter, busybox_layer, host_files, host_python

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n"
GROUP = b"root:x:0:\nagent:x:1000:\nstaff:x:50:agent\n"


def _top_levels(*distributions: str) -> tuple[str, ...]:
    """The top-level modules and packages these installed distributions put in site-packages,
    as paths (pytest also installs `py.py`)."""
    paths = set()
    for name in distributions:
        for file in metadata.files(name) or ():
            top = file.parts[0]
            if not top.endswith(".pth") and top not in ("..", "__pycache__"):
                site = Path(str(file.locate())).parents[len(file.parts) - 1]
                paths.add(str(site / top))
    return tuple(sorted(paths))


PYTEST = _top_levels("pytest", "pluggy", "iniconfig", "packaging", "pygments")
IMAGE_PYTHON = "/usr/bin/python3"  # Debian's, which the python image carries


def base_layer(path: Path) -> Path:
    layer = LayerWriter(path)
    busybox_layer(layer)
    layer.file("etc/passwd", PASSWD)
    layer.file("etc/group", GROUP)
    layer.dir("root", 0o700)
    layer.dir("home/agent", uid=1000, gid=1000)
    return layer.close()


def python_layer(path: Path) -> Path:
    layer = LayerWriter(path)
    host_python(layer, packages=PYTEST)
    host_files(layer, ["/usr/bin/git"])
    return layer.close()


def busybox_spec(where: Path, **config: object) -> ImageSpec:
    base = where / "base.tar"
    if not base.exists():
        base_layer(base)
    return ImageSpec([base], **config)  # type: ignore[arg-type]


def python_spec(where: Path, **config: object) -> ImageSpec:
    spec = busybox_spec(where)
    py = where / "python.tar"
    if not py.exists():
        python_layer(py)
    return ImageSpec([*spec.layers, py], **config)  # type: ignore[arg-type]


def have_debian_python() -> bool:
    return os.path.isdir("/usr/lib/python3.11/encodings") or any(
        Path("/usr/lib").glob("python3.*/encodings")
    )
