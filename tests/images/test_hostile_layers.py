"""Hostile images: every layer entry that would write outside its layer, every digest that does
not match, every layer past the disk bound is refused with an error naming the image and the
entry, and nothing is written outside the cache. Device nodes are dropped and setuid bits
stripped (the entry is kept), and both are said."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from venusrl.envs.templates import IMAGE_ID_BASE
from venusrl.images.build import ImageSpec, LayerWriter, write_oci
from venusrl.images.oci import ImageError
from venusrl.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking layers needs root (owners)")


def entry(
    name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def image_of(tmp_path: Path, write: Callable[[LayerWriter], None]) -> str:
    layer = LayerWriter(tmp_path / "layer.tar")
    write(layer)
    layer.close()
    write_oci(ImageSpec([tmp_path / "layer.tar"]), tmp_path / "oci", "evil")
    return f"oci:{tmp_path}/oci:evil"


def store(tmp_path: Path, max_bytes: int = 1 << 30) -> ImageStore:
    return ImageStore(tmp_path / "cache", max_bytes, IMAGE_ID_BASE)


OUTSIDE = "/tmp/venusrl-hostile-layer-test"


@pytest.mark.parametrize(
    ("what", "write", "message"),
    [
        ("dot-dot", lambda layer: layer.raw(entry(f"a/../../..{OUTSIDE}"), b"x"), "climbs out"),
        ("absolute", lambda layer: layer.raw(entry(OUTSIDE), b"x"), "absolute path"),
        (
            "through a symlink",
            lambda layer: (
                layer.symlink("out", "/tmp"),
                layer.raw(entry("out/venusrl-hostile-layer-test"), b"x"),
            ),
            "is a symlink",
        ),
        (
            "hardlink out",
            lambda layer: layer.raw(entry("passwd", tarfile.LNKTYPE, "../../etc/passwd")),
            "climbs out",
        ),
        (
            "hardlink through a symlink",
            lambda layer: (
                layer.symlink("out", "/etc"),
                layer.raw(entry("x", tarfile.LNKTYPE, "out/passwd")),
            ),
            "is a symlink",
        ),
        (
            "hardlink to nothing",
            lambda layer: layer.raw(entry("x", tarfile.LNKTYPE, "etc/shadow")),
            "does not have",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_layer_entry_that_would_leave_its_layer_is_refused(
    tmp_path: Path, what: str, write: Callable[[LayerWriter], None], message: str
) -> None:
    ref = image_of(tmp_path, write)
    with pytest.raises(ImageError, match=message) as info:
        store(tmp_path).pull(ref)
    assert ref in str(info.value) and "entry" in str(info.value)
    assert not os.path.lexists(OUTSIDE)
    assert not any((tmp_path / "cache" / "layers").iterdir())  # nothing half-unpacked kept
    assert not any((tmp_path / "cache" / "tmp").iterdir())


def test_device_nodes_are_dropped_and_setuid_bits_stripped_and_both_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def write(layer: LayerWriter) -> None:
        node = entry("dev/sda", tarfile.BLKTYPE)
        node.devmajor, node.devminor = 8, 0
        layer.raw(node)
        layer.raw(entry("dev/mem", tarfile.CHRTYPE))
        layer.file("bin/su", b"#!/bin/sh\n", mode=0o4755)
        layer.file("bin/wall", b"#!/bin/sh\n", mode=0o2755)

    image = store(tmp_path).pull(image_of(tmp_path, write))
    (layer,) = image.layers
    assert not (layer / "dev" / "sda").exists() and not (layer / "dev" / "mem").exists()
    assert (layer / "bin" / "su").stat().st_mode & 0o7777 == 0o755
    assert (layer / "bin" / "wall").stat().st_mode & 0o7777 == 0o755
    said = caplog.text
    assert "2 device nodes dropped (dev/sda, dev/mem)" in said
    assert "setuid/setgid bits stripped (bin/su, bin/wall)" in said


def test_a_layer_past_the_disk_bound_is_refused(tmp_path: Path) -> None:
    ref = image_of(tmp_path, lambda layer: layer.file("big", b"\0" * (3 << 20)))
    with pytest.raises(ImageError, match="disk bound") as info:
        store(tmp_path, max_bytes=2 << 20).pull(ref)
    assert "entry 'big'" in str(info.value)
    assert store(tmp_path, max_bytes=2 << 20).cache.stats().disk_bytes == 0


def _layout(tmp_path: Path) -> tuple[Path, dict]:
    ref = image_of(tmp_path, lambda layer: layer.file("ok", b"fine\n"))
    layout = Path(ref.split(":")[1])
    return layout, json.loads((layout / "index.json").read_text())


def _blob(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.split(":")[1]


def test_a_blob_whose_digest_does_not_match_is_refused(tmp_path: Path) -> None:
    layout, index = _layout(tmp_path)
    manifest = json.loads(_blob(layout, index["manifests"][0]["digest"]).read_bytes())
    layer_blob = _blob(layout, manifest["layers"][0]["digest"])
    data = bytearray(layer_blob.read_bytes())
    data[-1] ^= 1  # gzip trailer: the bytes differ, the digest must say so
    layer_blob.write_bytes(bytes(data))
    with pytest.raises(ImageError, match=r"digest mismatch|not a readable"):
        store(tmp_path).pull(f"oci:{layout}:evil")
    assert store(tmp_path).cache.stats().layers == 0


def test_a_manifest_whose_digest_does_not_match_is_refused(tmp_path: Path) -> None:
    layout, index = _layout(tmp_path)
    path = _blob(layout, index["manifests"][0]["digest"])
    manifest = json.loads(path.read_bytes())
    manifest["annotations"] = {"tampered": "yes"}
    path.write_bytes(json.dumps(manifest).encode())
    with pytest.raises(ImageError, match=r"manifest sha256:.*digest mismatch"):
        store(tmp_path).pull(f"oci:{layout}:evil")


def _put(layout: Path, document: dict) -> tuple[str, int]:
    raw = json.dumps(document).encode()
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    _blob(layout, digest).write_bytes(raw)
    return digest, len(raw)


def _rewrite_manifest(tmp_path: Path, change: Callable[[Path, dict], None]) -> str:
    """The layout's image with its manifest changed by `change` (and stored under its new
    digest, so that only what `change` did is wrong)."""
    layout, index = _layout(tmp_path)
    manifest = json.loads(_blob(layout, index["manifests"][0]["digest"]).read_bytes())
    change(layout, manifest)
    digest, size = _put(layout, manifest)
    index["manifests"][0] |= {"digest": digest, "size": size}
    (layout / "index.json").write_text(json.dumps(index))
    return f"oci:{layout}:evil"


def test_a_config_whose_diff_ids_do_not_match_its_layers_is_refused(tmp_path: Path) -> None:
    def wrong_diff_ids(layout: Path, manifest: dict) -> None:
        config = json.loads(_blob(layout, manifest["config"]["digest"]).read_bytes())
        config["rootfs"]["diff_ids"] = ["sha256:" + "0" * 64]
        digest, size = _put(layout, config)
        manifest["config"] = {**manifest["config"], "digest": digest, "size": size}

    with pytest.raises(ImageError, match=r"diff_id.*digest mismatch"):
        store(tmp_path).pull(_rewrite_manifest(tmp_path, wrong_diff_ids))


def test_a_blob_longer_than_its_manifest_says_is_refused_as_it_streams(tmp_path: Path) -> None:
    def shorter(layout: Path, manifest: dict) -> None:
        manifest["layers"][0]["size"] = 16

    with pytest.raises(ImageError, match="longer than the 16 bytes its manifest says"):
        store(tmp_path).pull(_rewrite_manifest(tmp_path, shorter))


def test_an_extended_header_asking_for_gigabytes_is_refused_before_it_is_read(
    tmp_path: Path,
) -> None:
    header = entry("././@PaxHeader", tarfile.XHDTYPE)
    header.size = 1 << 30  # no body follows: reading it would wait on a gigabyte
    ref = image_of(tmp_path, lambda layer: layer.raw(header))
    with pytest.raises(ImageError, match="extended header"):
        store(tmp_path).pull(ref)
