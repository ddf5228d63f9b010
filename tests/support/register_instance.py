"""Child process for discovery tests: register one instance, print READY, wait to be killed.

python -m tests.support.register_instance <discovery> <dir-or-etcd-url> <instance_id> [ttl_s]
"""

from __future__ import annotations

import asyncio
import sys

from tandem.protocols.discovery import Instance
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.registry import make_discovery


async def main(kind: str, where: str, instance_id: str, ttl_s: float) -> None:
    location = {"discovery_dir": where} if kind == "file" else {"etcd_url": where}
    cfg = RuntimeConfig(discovery=kind, lease_ttl_s=ttl_s, **location)  # type: ignore[arg-type]
    discovery = make_discovery(cfg)
    await discovery.register(
        Instance(
            instance_id=instance_id,
            namespace="t",
            component="backend",
            endpoint="generate",
            address="127.0.0.1:1",
        )
    )
    print("READY", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ttl = float(sys.argv[4]) if len(sys.argv) > 4 else 2.0
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], ttl))
