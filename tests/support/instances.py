"""Worker `Instance` records for router tests that need no real worker behind them."""

from __future__ import annotations

from tandem.protocols.discovery import Instance, ModelCard


def backend_instance(i: int, card: ModelCard | None = None, address: str | None = None) -> Instance:
    """Instance `w{i}` of `tandem.backend.generate` (address 127.0.0.1:{9000 + i} by default)."""
    return Instance(
        instance_id=f"w{i}",
        namespace="tandem",
        component="backend",
        endpoint="generate",
        address=address or f"127.0.0.1:{9000 + i}",
        model=card,
    )
