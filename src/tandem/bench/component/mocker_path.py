"""`tandem bench mocker-path`: CPU per request of the mocker worker's path, in one process.

What a `tandem worker --engine mocker --speedup-ratio 0` does with each request, minus the
sockets: decode the `PreprocessedRequest` (msgpack; the prompt stays the wire's u32 buffer, as
the Worker hands it to the mocker), run it through a `MockerEngine` (admission,
block hashing, prefix-cache bookkeeping, pseudo-tokens, step loop and output streams), encode
each output, and encode every KV event batch as the worker's publisher does (onto an in-process
bus nobody subscribes to). `--concurrency` requests run at once; the bench's own prompts
(random token ids, all distinct, so a full pool evicts on every admission after the first ~1M
tokens). CPU time
(process_time) per request, best of `--repeat` rounds, so a busy shared host inflates it less
than wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from tandem.bench.workload import SyntheticConfig, synthetic_requests


async def _round(
    isl: int, num: int, concurrency: int, token_ids: bool, temperature: float, hashes: bool
) -> float:
    from tandem.engines.mocker.config import MockerConfig
    from tandem.engines.mocker.engine import MockerEngine
    from tandem.engines.worker_events import KvEventPublisher
    from tandem.protocols.engine import (
        PreprocessedRequest,
        SamplingParams,
        StopConditions,
        decode_request,
        encode,
        encode_request,
    )
    from tandem.runtime.events.memory import MemoryEventBus
    from tandem.tokens.hashing import sequence_hashes

    config = MockerConfig(
        speedup_ratio=0, context_length=max(8192, 2 * isl), kv_events_token_ids=token_ids
    )
    size = config.block_size

    prompts = [s.token_ids for s in synthetic_requests(SyntheticConfig(isl=isl, osl=32), num)]
    payloads = [  # the wire form a frontend sends (with a KV router's hashes: --block-hashes)
        encode_request(
            PreprocessedRequest(
                request_id=f"r{i}",
                model="m",
                token_ids=ids,
                sampling=SamplingParams(temperature=temperature),
                stop=StopConditions(max_tokens=32, ignore_eos=True),
            ),
            block_hashes=sequence_hashes(ids, size) if hashes else None,
            hash_block_size=size if hashes else 0,
        )
        for i, ids in enumerate(prompts)
    ]
    engine = MockerEngine(config)
    await engine.start()
    publisher = KvEventPublisher(MemoryEventBus(), "bench.kv_events", "w", buffer_size=4096)

    async def publish() -> None:
        async for batch in engine.kv_events():
            await publisher.publish(batch)

    pump = asyncio.create_task(publish())
    gate = asyncio.Semaphore(concurrency)

    async def one(payload: bytes) -> None:
        async with gate:
            async for out in engine.generate(decode_request(payload, materialize=False)):
                encode(out)

    start = time.process_time()
    await asyncio.gather(*(one(p) for p in payloads))
    await engine.stop()  # ends kv_events() once drained
    await pump
    return (time.process_time() - start) * 1e3 / num


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench mocker-path", description=__doc__)
    parser.add_argument("--isl", default="64,6000,32000", help="comma list of prompt lengths")
    parser.add_argument("--num-requests", type=int, default=64, help="per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="best of N rounds")
    parser.add_argument(
        "--kv-events-token-ids", action="store_true", help="the mocker's opt-in token ids"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy requests")
    parser.add_argument(
        "--block-hashes", action="store_true", help="requests carry a KV router's block hashes"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.repeat < 1:
        parser.error("--num-requests, --concurrency and --repeat must be >= 1")
    results = []
    for isl in (int(x) for x in args.isl.split(",")):
        best = min(
            asyncio.run(
                _round(
                    isl,
                    args.num_requests,
                    args.concurrency,
                    args.kv_events_token_ids,
                    args.temperature,
                    args.block_hashes,
                )
            )
            for _ in range(args.repeat)
        )
        results.append({"isl": isl, "cpu_ms_per_request": best})
        print(f"ISL {isl:6d}: {best:7.3f} CPU-ms per request (best of {args.repeat})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
