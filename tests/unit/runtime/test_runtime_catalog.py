"""The catalog on every discovery backend: what one process writes another reads, it outlives
the discovery client that wrote it (no lease), and with a cluster secret a record that does
not verify is ignored as if absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.protocols.lora import LoraCard
from tandem.runtime.catalog.lora import LoraCatalog
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.registry import make_catalog, make_discovery

pytestmark = pytest.mark.timeout(60)
SECRET = "f3b1c9a0d47e8a6b2c5d9e0f1a3b7c4d"
CARD = LoraCard(name="org/sql-lora", base_model="smollm2", path="/adapters/sql", created_s=1.5)


async def _outlives_its_writer(config: RuntimeConfig) -> None:
    writer = make_discovery(config)
    catalog = LoraCatalog(make_catalog(config, writer), "tandem")
    await catalog.put(CARD)
    await catalog.put(LoraCard(name="b", base_model="smollm2", path="/adapters/b"))
    assert await catalog.get("org/sql-lora") == CARD
    if config.discovery != "memory":
        await writer.close()  # its process is gone; a memory catalog lives with its object
    reader = writer if config.discovery == "memory" else make_discovery(config)
    again = LoraCatalog(make_catalog(config, reader), "tandem")
    other_namespace = LoraCatalog(make_catalog(config, reader), "other")
    try:
        assert [c.name for c in await again.list()] == ["b", "org/sql-lora"]
        assert await again.get("org/sql-lora") == CARD
        assert await other_namespace.list() == []
        assert await again.delete("b") and not await again.delete("b")
        assert await again.get("b") is None
        assert [c.name for c in await catalog.list()] == ["org/sql-lora"]
    finally:
        await reader.close()


async def test_memory() -> None:
    await _outlives_its_writer(RuntimeConfig())


async def test_file(tmp_path: Path) -> None:
    config = RuntimeConfig(
        discovery="file", discovery_dir=str(tmp_path / "d"), cluster_secret=SECRET
    )
    await _outlives_its_writer(config)


async def test_etcd(etcd_server) -> None:  # type: ignore[no-untyped-def]
    await _outlives_its_writer(
        RuntimeConfig(discovery="etcd", etcd_url=etcd_server.url, cluster_secret=SECRET)
    )


async def test_file_record_of_another_secret_is_ignored(tmp_path: Path) -> None:
    theirs = RuntimeConfig(discovery="file", discovery_dir=str(tmp_path / "d"),
                           cluster_secret="9" + SECRET[1:])  # fmt: skip
    ours = RuntimeConfig(discovery="file", discovery_dir=str(tmp_path / "d"), cluster_secret=SECRET)
    forger = LoraCatalog(make_catalog(theirs, make_discovery(theirs)), "tandem")
    await forger.put(CARD)
    catalog = LoraCatalog(make_catalog(ours, make_discovery(ours)), "tandem")
    assert await catalog.get(CARD.name) is None
    assert await catalog.list() == []
    files = os.listdir(tmp_path / "d" / "catalog")
    assert files == ["loras%2Ftandem%2Forg%2Fsql-lora.rec"]  # one file per key, quoted


async def test_limits() -> None:
    store = make_catalog(RuntimeConfig(), make_discovery(RuntimeConfig()))
    with pytest.raises(ValueError, match="exceeds the limit"):
        await store.put("k", b"x" * (65 << 10))
    with pytest.raises(ValueError, match="catalog key"):
        await store.put("", b"x")
