"""Reading images: every format the runtime takes gives the same image, skopeo and umoci read
what `build` writes, and the merged tree is the one umoci's own unpack makes."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.conftest import BuiltImages
from tests.images.built import base_layer
from venusrl.envs.templates import IMAGE_ID_BASE
from venusrl.images.build import (
    ImageSpec,
    LayerWriter,
    write_docker_archive,
    write_oci,
    write_oci_archive,
)
from venusrl.images.oci import ImageConfig, ImageError
from venusrl.images.reference import parse_ref
from venusrl.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking layers needs root (owners)")


def whiteout_layer(path: Path) -> Path:
    """Deletes /data/gone, makes /data/old opaque (only its new file stays), adds a link."""
    layer = LayerWriter(path)
    layer.raw(tarfile.TarInfo("data/.wh.gone"), b"")
    layer.dir("data/old")
    layer.raw(tarfile.TarInfo("data/old/.wh..wh..opq"), b"")
    layer.file("data/old/new", b"new\n")
    layer.symlink("data/link", "old/new")
    return layer.close()


def two_layer_spec(tmp_path: Path) -> ImageSpec:
    base = LayerWriter(tmp_path / "l0.tar")
    base.file("data/keep", b"keep\n")
    base.file("data/gone", b"gone\n")
    base.file("data/old/stale", b"stale\n")
    base.file("data/tree/leaf", b"leaf\n")
    base.close()
    top = LayerWriter(tmp_path / "l2.tar")
    top.file("data/tree", b"a file now\n")  # over the directory below: it hides its leaf
    top.close()
    return ImageSpec(
        [tmp_path / "l0.tar", whiteout_layer(tmp_path / "l1.tar"), tmp_path / "l2.tar"],
        env={"PATH": "/bin", "GREETING": "hi=there"},
        working_dir="/data",
        user="1000:50",
        entrypoint=("/bin/sh", "-c"),
        cmd=("echo hello",),
    )


def merged_tree(root: Path) -> dict[str, str]:
    """A directory tree as {path: "dir" | "link -> target" | content}."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = path.read_text()
    return out


def test_an_image_reads_the_same_from_an_oci_layout_an_oci_archive_and_both_docker_save_forms(
    tmp_path: Path,
) -> None:
    spec = two_layer_spec(tmp_path)
    write_oci(spec, tmp_path / "oci", "v1")
    write_oci_archive(spec, tmp_path / "image.oci.tar", "v1", compression="zstd")
    write_docker_archive(spec, tmp_path / "new.tar", "test/image:v1")
    write_docker_archive(spec, tmp_path / "old.tar", "test/image:v1", form="old")
    store = ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE)
    refs = [
        f"oci:{tmp_path}/oci:v1",
        f"oci-archive:{tmp_path}/image.oci.tar",
        f"docker-archive:{tmp_path}/new.tar",
        f"docker-archive:{tmp_path}/old.tar:test/image:v1",
    ]
    images = [store.pull(ref) for ref in refs]
    assert {im.config for im in images} == {images[0].config}
    assert {im.layers for im in images} == {images[0].layers}  # unpacked once, shared
    assert store.cache.stats().layers == 3
    config = images[0].config
    assert config.environment()["GREETING"] == "hi=there"
    assert config.working_dir == "/data"
    assert config.command() == ["/bin/sh", "-c", "echo hello"]
    assert config.command(["ls"]) == ["/bin/sh", "-c", "ls"]
    user = images[0].user()
    assert (user.uid, user.gid) == (1000, 50)


def test_skopeo_and_umoci_read_what_build_writes_and_merge_it_as_the_runtime_does(
    tmp_path: Path,
) -> None:
    spec = two_layer_spec(tmp_path)
    write_oci(spec, tmp_path / "oci", "v1")
    write_docker_archive(spec, tmp_path / "new.tar", "test/image:v1")
    for ref in (f"oci:{tmp_path}/oci:v1", f"docker-archive:{tmp_path}/new.tar"):
        out = subprocess.run(["skopeo", "inspect", ref], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert '"GREETING=hi=there"' in out.stdout
    bundle = tmp_path / "bundle"
    subprocess.run(
        ["umoci", "unpack", "--image", f"{tmp_path}/oci:v1", str(bundle)],
        check=True,
        capture_output=True,
    )
    umoci = merged_tree(bundle / "rootfs")
    assert umoci["data/keep"] == "keep\n" and "data/gone" not in umoci
    assert "data/old/stale" not in umoci and umoci["data/old/new"] == "new\n"
    # The runtime's view of the merged image, read from its layers without mounting them.
    image = ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE).pull(f"oci:{tmp_path}/oci:v1")
    for rel, kind in umoci.items():
        found = image.lookup(rel)
        assert found is not None, rel
        if kind not in ("dir",) and not kind.startswith("link"):
            assert found[0].read_text() == kind
    assert image.lookup("data/gone") is None
    assert image.lookup("data/old/stale") is None
    assert umoci["data/tree"] == "a file now\n" and image.lookup("data/tree/leaf") is None


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_uncompressed_gzip_and_zstd_layers_unpack_to_the_same_tree(
    tmp_path: Path, compression: str
) -> None:
    spec = two_layer_spec(tmp_path)
    write_oci(spec, tmp_path / "oci", "v1", compression=compression)
    image = ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE).pull(f"oci:{tmp_path}/oci:v1")
    whiteouts = image.layers[1]
    assert (whiteouts / "data" / "gone").stat().st_rdev == os.makedev(0, 0)  # the overlay whiteout
    assert os.getxattr(whiteouts / "data" / "old", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(whiteouts / "data" / "old", "user.overlay.opaque") == b"y"
    assert (whiteouts / "data" / "old" / "new").stat().st_uid == IMAGE_ID_BASE  # root, shifted


def test_references_in_skopeo_syntax_and_docker_names() -> None:
    assert parse_ref("python").repository == "library/python"
    assert str(parse_ref("python")) == "docker.io/library/python:latest"
    ref = parse_ref("localhost:5000/swe/task:v2")
    assert (ref.registry, ref.repository, ref.tag) == ("localhost:5000", "swe/task", "v2")
    digest = "sha256:" + "a" * 64
    assert parse_ref(f"docker://ghcr.io/org/img@{digest}").digest == digest
    assert parse_ref("oci:/images/layout:v1").path == "/images/layout"
    assert parse_ref("docker-archive:/x.tar:repo/name:tag").tag == "repo/name:tag"
    for bad in ("", "Upper/Case", "dir:/some/where", "name:bad tag", f"x@sha256:{'z' * 64}"):
        with pytest.raises(ImageError):
            parse_ref(bad)


def test_a_config_naming_a_user_the_image_lacks_is_refused_naming_the_image(
    tmp_path: Path,
) -> None:
    base_layer(tmp_path / "base.tar")
    write_oci(ImageSpec([tmp_path / "base.tar"], user="ghost"), tmp_path / "oci", "v1")
    image = ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE).pull(f"oci:{tmp_path}/oci:v1")
    with pytest.raises(ImageError, match=r"oci:.*/oci:v1.*user 'ghost'.*/etc/passwd"):
        image.user()
    assert image.user("agent").uid == 1000
    with pytest.raises(ImageError, match="group 'nogroup'"):
        image.user("agent:nogroup")
    with pytest.raises(ImageError, match="outside"):
        image.user("70000")


def test_malformed_configs_are_refused_naming_the_field() -> None:
    ok = {"rootfs": {"diff_ids": []}}
    with pytest.raises(ImageError, match=r"rootfs\.diff_ids"):
        ImageConfig.parse({}, "image x")
    with pytest.raises(ImageError, match=r"config\.Env"):
        ImageConfig.parse({**ok, "config": {"Env": ["NOEQUALS"]}}, "image x")
    with pytest.raises(ImageError, match="WorkingDir must be absolute"):
        ImageConfig.parse({**ok, "config": {"WorkingDir": "rel"}}, "image x")


def test_an_images_python_is_found_on_its_path_through_its_links(test_images: BuiltImages) -> None:
    store = test_images.store()
    assert store.pull(test_images.python).python_path() == "/usr/bin/python3"
    assert store.pull(test_images.busybox).python_path() is None
