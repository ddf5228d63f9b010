"""The data plane: KV blocks and image embeddings between processes.

Agents, operations and backends (shm, tcp, optional nixl/mooncake)."""

from tandem.transfer.agent import TransferAgent, TransferResult, host_id
from tandem.transfer.base import BACKEND_NAMES, TransferBackend
from tandem.transfer.client import cancel_soon
from tandem.transfer.config import TransferAgentConfig
from tandem.transfer.descriptor import (
    OpKind,
    OpRef,
    OpStatus,
    RegionLayout,
    TransferOpMeta,
    decode_meta,
    encode_meta,
)
from tandem.transfer.metrics import TransferStats
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
    "cancel_soon",
    "decode_meta",
    "encode_meta",
    "host_id",
    "sweep_stale_segments",
]
