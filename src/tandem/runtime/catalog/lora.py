"""`LoraCatalog`: the LoRA adapters a deployment can serve (issue 32), one `LoraCard` per
adapter name under `loras/<namespace>/<name>` in the catalog. Frontends write it (`POST
/v1/load_lora_adapter`, `--lora`); frontends, routers and workers read it (a worker loads a
cataloged adapter on demand). Adapter names are unique per namespace, across base models,
since a request picks one by `model=<name>` alone."""

from __future__ import annotations

import logging

import msgspec

from tandem.protocols.lora import LoraCard
from tandem.runtime.catalog.base import RecordStore

logger = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(LoraCard)


class LoraCatalog:
    """Typed view of the adapter records of one namespace; safe from one event loop."""

    def __init__(self, store: RecordStore, namespace: str) -> None:
        self.store, self.namespace = store, namespace
        self._prefix = f"loras/{namespace}/"

    @property
    def where(self) -> str:
        return self.store.where

    async def get(self, name: str) -> LoraCard | None:
        data = await self.store.get(self._prefix + name)
        return None if data is None else self._decode(name, data)

    async def list(self) -> list[LoraCard]:
        """Every cataloged adapter, by name."""
        found = await self.store.items(self._prefix)
        cards = [self._decode(key.removeprefix(self._prefix), data) for key, data in found.items()]
        return sorted((c for c in cards if c is not None), key=lambda c: c.name)

    async def put(self, card: LoraCard) -> None:
        await self.store.put(self._prefix + card.name, msgspec.json.encode(card))

    async def delete(self, name: str) -> bool:
        return await self.store.delete(self._prefix + name)

    def _decode(self, name: str, data: bytes) -> LoraCard | None:
        try:
            card = _decoder.decode(data)
        except msgspec.DecodeError as exc:
            logger.warning("ignoring catalog record of adapter %r: %s", name, exc)
            return None
        return card if card.name == name else None
