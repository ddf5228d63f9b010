"""A stand-alone process publishing KV events exactly as vLLM does (ZMQ PUB, multipart
[topic, seq u64 big-endian, msgpack KVEventBatch of array_like tagged structs], ROUTER
replay socket). Driven line by line over stdin: `warm`, `run`, `quit`."""

from __future__ import annotations

import hashlib
import sys
import time

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list
    medium: str | None


BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS))
OTHER = list(range(5000, 5000 + 2 * BS))


def engine_hash(i: int) -> bytes:  # newer vLLM: sha256 bytes per block
    return hashlib.sha256(f"blk{i}".encode()).digest()


def scripted() -> list[tuple[list, bool]]:
    """(events, published?) per batch; the third is lost on the wire (replay only)."""
    h = [engine_hash(i) for i in range(8)]
    return [
        ([BlockStored(h[:4], None, PROMPT[: 4 * BS], BS, None, "GPU")], True),
        ([BlockStored(h[4:], h[3], PROMPT[4 * BS :], BS, None, "GPU")], True),
        ([BlockRemoved([h[7]], "GPU")], False),
        ([BlockStored([91, 92], None, OTHER, BS, None, "GPU")], True),
        ([], True),
    ]


def main() -> None:
    ctx = zmq.Context()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{pub_port}|tcp://127.0.0.1:{replay_port}", flush=True)
    encoder = msgspec.msgpack.Encoder()
    buffer: list[tuple[int, bytes]] = []
    seq = 0
    poller = zmq.Poller()
    poller.register(replay, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)

    def send(events: list, publish: bool) -> None:
        nonlocal seq
        payload = encoder.encode(EventBatch(time.time(), events, 0))
        buffer.append((seq, payload))
        if publish:
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        seq += 1

    while True:
        for sock, _ in poller.poll(1000):
            if sock is replay:
                client, _, start = replay.recv_multipart()
                first = int.from_bytes(start, "big")
                for s, payload in buffer:
                    if s >= first:
                        replay.send_multipart([client, b"", s.to_bytes(8, "big"), payload])
                replay.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])
                continue
            line = sys.stdin.readline().strip()
            if line == "warm":
                send([], True)
            elif line == "run":
                for events, published in scripted():
                    send(events, published)
                print(f"done {seq - 1}", flush=True)
            elif line in ("quit", ""):
                return


if __name__ == "__main__":
    main()
