"""The blob store on every discovery backend: what one process puts, another reads back by
sha256, verified; a corrupt or unknown blob is a named error; a store's blobs go with it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tandem.runtime.blobs.base import BlobCorruptError, BlobMissingError, BlobStore, blob_id
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.registry import make_blob_store, make_discovery

pytestmark = pytest.mark.timeout(60)
DATA = os.urandom(3 << 20)  # bigger than one etcd request: chunked


@asynccontextmanager
async def _two_stores(config: RuntimeConfig) -> AsyncIterator[tuple[BlobStore, BlobStore]]:
    """Two processes' stores on the same discovery (two discovery clients where the backend
    has a service; one shared object for memory)."""
    disc_a = make_discovery(config)
    disc_b = disc_a if config.discovery == "memory" else make_discovery(config)
    a, b = make_blob_store(config, disc_a), make_blob_store(config, disc_b)
    try:
        yield a, b
    finally:
        await b.close()
        await a.close()
        await disc_a.close()
        if disc_b is not disc_a:
            await disc_b.close()


async def _round_trip(config: RuntimeConfig) -> None:
    async with _two_stores(config) as (a, b):
        sha = await a.put(DATA)
        assert sha == blob_id(DATA)
        assert await a.put(DATA) == sha  # written once per content
        assert await b.get(sha) == DATA
        with pytest.raises(BlobMissingError):
            await b.get(blob_id(b"never put"))
        with pytest.raises(ValueError, match="sha256"):
            await b.get("../../etc/passwd")


async def test_memory(tmp_path: Path) -> None:
    await _round_trip(RuntimeConfig())


async def test_file(tmp_path: Path) -> None:
    await _round_trip(RuntimeConfig(discovery="file", discovery_dir=str(tmp_path / "disc")))


async def test_file_corrupt_blob_is_named(tmp_path: Path) -> None:
    config = RuntimeConfig(discovery="file", discovery_dir=str(tmp_path / "disc"))
    async with _two_stores(config) as (a, b):
        sha = await a.put(b"tokenizer bytes")
        [path] = list((tmp_path / "disc").rglob(f"{sha}.blob"))
        path.write_bytes(b"altered bytes!!")
        with pytest.raises(BlobCorruptError, match="corrupt or altered"):
            await b.get(sha)


@pytest.mark.e2e
async def test_etcd(etcd_server) -> None:
    await _round_trip(RuntimeConfig(discovery="etcd", etcd_url=etcd_server.url))
