"""KV transfer layer: agents, operations and backends (shm, tcp, optional nixl/mooncake)."""

from tandem.transfer.agent import TransferAgent, TransferResult, host_id
from tandem.transfer.base import (
    BACKEND_NAMES,
    OpKind,
    OpRef,
    OpStatus,
    RegionLayout,
    TransferBackend,
    TransferOpMeta,
    TransferStats,
    decode_meta,
    encode_meta,
)
from tandem.transfer.config import TransferAgentConfig
from tandem.transfer.operation import TransferOp
from tandem.transfer.region import MemoryRegion, sweep_stale_segments

__all__ = [
    "BACKEND_NAMES",
    "MemoryRegion",
    "OpKind",
    "OpRef",
    "OpStatus",
    "RegionLayout",
    "TransferAgent",
    "TransferAgentConfig",
    "TransferBackend",
    "TransferOp",
    "TransferOpMeta",
    "TransferResult",
    "TransferStats",
    "decode_meta",
    "encode_meta",
    "host_id",
    "sweep_stale_segments",
]
