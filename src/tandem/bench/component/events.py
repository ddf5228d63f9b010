"""`tandem bench events`: CPU per message of the ZMQ event bus's receive path, against a
receive loop that awaits each message (the baseline: what the bus did before it drained).

A publisher process sends `--messages` sealed messages of `--payload-bytes` (as a worker's KV
events and load metrics are sealed with the cluster secret) in bursts of `--burst` every
`--interval-ms`, from a PUB socket that drops nothing. This process receives them twice, each
time from a fresh publisher: through `ZmqEventBus` (subscribed; a consumer task takes every
message from the subscription, as the router's followers do), and through the baseline loop
(one awaited `recv_multipart` per message, the same opener and subscription). Per mode: the
receiving process's CPU (process_time) per message, from the first message to the last, and
the messages delivered.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq
import zmq.asyncio

from tandem.protocols.discovery import Instance
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events import curve
from tandem.runtime.events.envelope import EventOpener, EventSealer
from tandem.runtime.events.subscription import BufferedSubscription
from tandem.runtime.events.zmq import ZmqEventBus

SECRET = "bench-events-secret-0123456789abcdef"
SUBJECT = "tandem.kv_events.bench"
PROBE = b"probe"


def _publish(conn: Connection, args: argparse.Namespace) -> None:
    asyncio.run(_publish_async(conn, args))


async def _publish_async(conn: Connection, args: argparse.Namespace) -> None:
    """The publisher process (CURVE server, as a worker's bus with the cluster secret):
    probes until told to go, then the measured messages."""
    ctx = zmq.asyncio.Context()
    keys = curve.curve_keys(SECRET)
    auth = curve.start_authenticator(ctx, keys)
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    curve.make_server(sock, keys)
    conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    sealer = EventSealer(SECRET)
    give_up = time.monotonic() + args.timeout_s
    while not conn.poll():  # the subscriber answers once a probe arrived
        if time.monotonic() > give_up:
            return
        await sock.send_multipart([SUBJECT.encode(), sealer.seal(SUBJECT, PROBE)])
        await asyncio.sleep(0.01)
    conn.recv()
    payload = bytes(args.payload_bytes)
    for i in range(args.messages):
        await sock.send_multipart([SUBJECT.encode(), sealer.seal(SUBJECT, payload)])
        if i % args.burst == args.burst - 1:
            await asyncio.sleep(args.interval_ms / 1000.0)
    conn.poll(args.timeout_s)  # until the subscriber is done (ZMQ's I/O thread sends meanwhile)
    sock.close(linger=0)
    auth.stop()
    ctx.term()


async def _await_each(sock: zmq.asyncio.Socket, sub: BufferedSubscription) -> None:
    """The baseline receive loop: one awaited receive per message."""
    opener = EventOpener(SECRET)
    while True:
        subject_b, payload = await sock.recv_multipart()
        opened = opener.open(subject_b.decode(), payload)
        if opened is not None:
            sub.push(subject_b.decode(), opened)


async def _bus_receiver(port: int) -> tuple[BufferedSubscription, Callable[[], Awaitable[None]]]:
    disc = MemoryDiscovery()
    bus = ZmqEventBus(disc, secret=SECRET)
    sub = await bus.subscribe(SUBJECT)
    await disc.register(Instance(instance_id="bench-pub", namespace="tandem",
                                 component="_events", endpoint="pub",
                                 address=f"127.0.0.1:{port}"))  # fmt: skip
    return sub, bus.close


async def _loop_receiver(port: int) -> tuple[BufferedSubscription, Callable[[], Awaitable[None]]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    curve.make_client(sock, curve.curve_keys(SECRET))
    sock.connect(f"tcp://127.0.0.1:{port}")
    sub = BufferedSubscription(SUBJECT, 10_000)
    task = asyncio.create_task(_await_each(sock, sub))

    async def close() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close(linger=0)
        ctx.term()

    return sub, close


async def _measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    mp = multiprocessing.get_context("spawn")
    here, there = mp.Pipe()
    publisher = mp.Process(target=_publish, args=(there, args), daemon=True)
    publisher.start()
    try:
        if not here.poll(args.timeout_s):
            raise SystemExit(
                f"tandem bench events: the publisher did not start in {args.timeout_s:g} s"
            )
        port = here.recv()
        start = _bus_receiver if mode == "bus" else _loop_receiver
        sub, close = await start(port)
        try:
            async with asyncio.timeout(args.timeout_s):
                while (await anext(sub))[1] != PROBE:
                    pass
            here.send("go")
            received, cpu_start = 0, None
            try:
                async with asyncio.timeout(args.timeout_s):
                    async for _, payload in sub:
                        if payload == PROBE:
                            continue
                        if cpu_start is None:
                            cpu_start = time.process_time()
                        received += 1
                        if received == args.messages:
                            break
            except TimeoutError:
                pass
            cpu_s = time.process_time() - (cpu_start or time.process_time())
            here.send("done")
        finally:
            await close()
    finally:
        publisher.join(timeout=10)
        if publisher.is_alive():
            publisher.kill()
    return {"received": received, "cpu_us_per_message": 1e6 * cpu_s / max(received - 1, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "messages": args.messages,
        "payload_bytes": args.payload_bytes,
        "burst": args.burst,
        "interval_ms": args.interval_ms,
        "await_each": await _measure("await_each", args),
        "bus": await _measure("bus", args),
    }


def format_result(r: dict[str, Any]) -> str:
    base, bus = r["await_each"], r["bus"]
    ratio = base["cpu_us_per_message"] / max(bus["cpu_us_per_message"], 1e-9)
    return "\n".join([
        f"tandem bench events: {r['messages']} sealed messages of {r['payload_bytes']} B, "
        f"bursts of {r['burst']} every {r['interval_ms']:g} ms, one publisher process",
        f"{'receive path':28}{'CPU us/msg':>12}{'delivered':>11}",
        f"{'await each (baseline)':28}{base['cpu_us_per_message']:>12.1f}"
        f"{base['received']:>11}",
        f"{'ZmqEventBus (drains)':28}{bus['cpu_us_per_message']:>12.1f}{bus['received']:>11}",
        f"baseline CPU / bus CPU: {ratio:.2f}x",
    ])  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench events", description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--payload-bytes", type=int, default=300)
    p.add_argument("--burst", type=int, default=4, help="messages sent back to back")
    p.add_argument("--interval-ms", type=float, default=1.0, help="pause after each burst")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("messages", "burst", "payload_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}; expected 1 or more")
    if args.interval_ms < 0 or args.timeout_s <= 0:
        p.error("--interval-ms must be >= 0 and --timeout-s > 0")
    return args


def main(argv: list[str]) -> int:
    from tandem.bench.component.entry import figures_main

    return figures_main(argv, parse_args, lambda a: asyncio.run(run(a)), format_result)
