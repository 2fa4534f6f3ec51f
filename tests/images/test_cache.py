"""The layer cache: a layer is unpacked once however many pulls ask for it at once (threads or
processes), and past its bound the least recently used layers nobody holds are evicted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from venusrl.envs.templates import IMAGE_ID_BASE
from venusrl.images.build import ImageSpec, LayerWriter, write_oci
from venusrl.images.oci import ImageError
from venusrl.images.store import ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking layers needs root (owners)")

PULL = """
import json, sys
from pathlib import Path
from venusrl.images.store import ImageStore
store = ImageStore(Path(sys.argv[1]), 1 << 30, int(sys.argv[3]))
sys.stdin.readline()  # everyone starts together
image = store.pull(sys.argv[2])
print(json.dumps({"unpacked": store.cache.unpacked, "layers": [str(p) for p in image.layers]}))
"""


def layers(tmp_path: Path, sizes: list[int], tag: str = "v1") -> str:
    paths = []
    for i, size in enumerate(sizes):
        layer = LayerWriter(tmp_path / f"{tag}-{i}.tar")
        layer.file(f"layer{i}-{tag}/blob", os.urandom(size))
        paths.append(layer.close())
    write_oci(ImageSpec(paths), tmp_path / "oci", tag, compression="none")
    return f"oci:{tmp_path}/oci:{tag}"


def test_concurrent_pulls_of_one_layer_unpack_it_once_in_threads_and_processes(
    tmp_path: Path,
) -> None:
    ref = layers(tmp_path, [4 << 20, 4 << 20, 1 << 20])
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PULL, str(cache), ref, str(IMAGE_ID_BASE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    stores = [ImageStore(cache, 1 << 30, IMAGE_ID_BASE) for _ in range(3)]
    start = threading.Barrier(len(stores) + 1)
    found: list[tuple[Path, ...]] = []

    def pull(store: ImageStore) -> None:
        start.wait()
        found.append(store.pull(ref).layers)

    threads = [threading.Thread(target=pull, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    start.wait()
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    for t in threads:
        t.join()
    unpacked = sum(o["unpacked"] for o in outs) + sum(s.cache.unpacked for s in stores)
    assert unpacked == 3  # each of the three layers once, by whoever came first
    assert {tuple(o["layers"]) for o in outs} == {tuple(map(str, found[0]))}
    assert len(set(found)) == 1


def test_past_its_bound_the_cache_evicts_unused_layers_and_keeps_held_ones(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache", 10 << 20, IMAGE_ID_BASE)
    first = store.pull(layers(tmp_path, [4 << 20], "a"))
    second = store.pull(layers(tmp_path, [4 << 20], "b"))
    # Both held: a third that would pass the bound cannot evict them.
    with pytest.raises(ImageError, match="disk bound"):
        store.pull(layers(tmp_path, [4 << 20], "c"))
    assert first.layers[0].is_dir() and second.layers[0].is_dir()
    first.release()
    third = store.pull(layers(tmp_path, [4 << 20], "c"))
    assert not first.layers[0].exists()  # the unused one went
    assert second.layers[0].is_dir() and third.layers[0].is_dir()
    assert store.cache.stats().disk_bytes <= 10 << 20
    second.release()
    again = store.pull(f"oci:{tmp_path}/oci:a")  # evicted layers unpack again when asked for
    assert again.layers[0].is_dir() and not second.layers[0].exists()


def test_a_cache_unpacked_for_another_id_range_is_refused(tmp_path: Path) -> None:
    ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE)
    with pytest.raises(ImageError, match="another directory"):
        ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE + 1)


def test_pulls_of_images_that_share_a_base_layer_do_not_wait_on_each_other_for_ever(
    tmp_path: Path,
) -> None:
    """Many threads of one process pull four images at once, all on one base layer: each waits
    for whoever unpacks a layer it needs, and the base is unpacked once."""
    base = LayerWriter(tmp_path / "base.tar")
    base.file("usr/lib/big", os.urandom(8 << 20))
    base.close()
    refs = []
    for i in range(4):
        top = LayerWriter(tmp_path / f"top{i}.tar")
        top.file(f"task/{i}", b"x")
        write_oci(
            ImageSpec([base.path, top.close()]), tmp_path / "oci", f"t{i}", compression="none"
        )
        refs.append(f"oci:{tmp_path}/oci:t{i}")
    store = ImageStore(tmp_path / "cache", 1 << 30, IMAGE_ID_BASE)
    start = threading.Barrier(8)
    pulled: list[Path] = []

    def pull(ref: str) -> None:
        start.wait()
        pulled.append(store.pull(ref).layers[0])

    threads = [threading.Thread(target=pull, args=(refs[i % 4],), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "pulls deadlocked"
    assert len(set(pulled)) == 1 and len(pulled) == 8
    assert store.cache.unpacked == 5  # the base once, each image's top once
