"""In-process catalog records: shared by every store opened on the same `MemoryDiscovery` (one
process, as the discovery itself is)."""

from __future__ import annotations

import weakref

from tandem.runtime.catalog.base import check_record

_spaces: weakref.WeakKeyDictionary[object, dict[str, bytes]] = weakref.WeakKeyDictionary()


def records_of(discovery: object) -> dict[str, bytes]:
    """The records that go with `discovery` (made on first use, dropped with it)."""
    records = _spaces.get(discovery)
    if records is None:
        records = _spaces[discovery] = {}
    return records


class MemoryRecordStore:
    """Implements `RecordStore` over a dict (a private one when none is given)."""

    where = "this process's memory"

    def __init__(self, records: dict[str, bytes] | None = None) -> None:
        self.records = {} if records is None else records

    async def get(self, key: str) -> bytes | None:
        return self.records.get(key)

    async def put(self, key: str, value: bytes) -> None:
        check_record(key, value)
        self.records[key] = bytes(value)

    async def delete(self, key: str) -> bool:
        return self.records.pop(key, None) is not None

    async def items(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, v in self.records.items() if k.startswith(prefix)}
