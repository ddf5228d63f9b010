"""Child process for event-bus tests: publish `<subject>` = b"<seq>" every 20 ms forever
through a ZmqEventBus that registers in file discovery under `<dir>`.

    python -m tests.support.zmq_publisher <discovery-dir> <subject>
"""

from __future__ import annotations

import asyncio
import sys

from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.events.zmq import ZmqEventBus


async def main(directory: str, subject: str) -> None:
    bus = ZmqEventBus(FileDiscovery(directory), namespace="t")
    seq = 0
    await bus.publish(subject, b"%d" % seq)
    print("READY", flush=True)
    while True:
        seq += 1
        await bus.publish(subject, b"%d" % seq)
        await asyncio.sleep(0.02)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
