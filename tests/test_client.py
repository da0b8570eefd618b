"""The process's one HTTP client (storage/client): a shard read (storage/http) and an image
download (storage/webget) go through the same urllib3 pool manager, each with its own pool size,
against a real server on loopback."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
from PIL import Image

from shardkit.core.config import WebConfig
from shardkit.storage.client import CONNECTIONS_PER_HOST, http_client
from shardkit.storage.download import download
from shardkit.storage.http import get_direct

from .servers import FaultServer

PACKAGE = Path(__file__).resolve().parents[1] / "shardkit"


def jpeg() -> bytes:
    pixels = np.random.default_rng(5).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


def test_a_shard_read_and_an_image_download_share_the_process_pool_manager(tmp_path: Path) -> None:
    web = WebConfig(retries=0, timeout=5.0, per_host=3)
    image = jpeg()
    with FaultServer(image) as server:
        port = int(server.base.rsplit(":", 1)[1])
        get_direct(server.url("/image/a"), str(tmp_path / "a"), None)
        assert download(server.url("/image/b"), web) == image + b"b"
    assert (tmp_path / "a").read_bytes() == image + b"a"
    pools = http_client().manager.pools.keys()  # (urllib3's container refuses iteration)
    sizes = {key.key_maxsize for key in pools if key.key_port == port}
    assert sizes == {CONNECTIONS_PER_HOST, web.per_host}  # one manager, the pool size each caller asked


def test_only_the_client_module_makes_a_pool_manager() -> None:
    makers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"\bPoolManager\(", path.read_text(encoding="utf-8"))
    )
    assert makers == ["storage/client.py"]
