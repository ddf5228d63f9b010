"""`tandem serve --engine vllm --workers 2 --router kv --migration-limit 3` on the real vLLM
(issue 16): the OpenAI SDK through tandem; KV-aware routing fed by vLLM's own KV events
(a repeated prefix goes to the worker that holds it, cached_tokens > 0); vLLM's Prometheus
metrics from the worker; engine step samples for the planner (issue 10); a client disconnect
frees the request in vLLM; LoRA adapters pass through to vLLM's own LoRA (issue 32); SIGKILL
of a vLLM worker mid-stream with migration loses no request and leaves no EngineCore behind;
then, with the stack stopped, greedy output equals vLLM's own OpenAI server on the same prompts,
and a 1P1D stack (NixlConnector on CPU) gives the same greedy tokens as the aggregated one.

One stack for the whole module (a vLLM engine takes 20+ s to start); tests run in order. When
the tests of that stack are done, it is told to stop while vLLM's own server and the 1P1D stack
start together (`successors`): a vLLM start is three processes importing vLLM one after
another, about one core, so the three engines share the two cores instead of the single
server's start leaving one idle, and the old stack's drain overlaps them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.eventually import eventually
from tests.support.lora_adapters import write_adapter
from tests.support.services import free_port
from tests.support.tandem_procs import REPO, TandemProcess, http_request, wait_instances
from tests.support.vllm_env import (
    BLOCK_SIZE,
    ENGINE_FLAGS,
    ENV,
    require_vllm_venv,
)
from tokenizers import Tokenizer

from tandem import errors
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    StructuredOutput,
    decode_output,
    encode,
)
from tandem.runtime.discovery.file import open_record
from tandem.runtime.tcp import TcpRequestClient

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(600)]
MODEL = "smollm2"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def add(a, b):",
]
GREEDY_TOKENS = 24
MIN_REMOTE_PROMPT = 6  # 1P1D: the prompts above have 5, 8, 5 and 7 tokens
START_TIMEOUT_S = 480
ADMIN_KEY = "admin-vllm-e2e"  # /v1/route/explain and the LoRA routes are admin routes
MAX_LORA_RANK = 8  # vLLM's --max-lora-rank on the stack's workers


class Stack:
    def __init__(
        self, proc: TandemProcess, base_url: str, ids: set[str], run_dir: Path | None = None
    ) -> None:
        self.proc, self.base_url, self.instance_ids = proc, base_url, ids
        self.run_dir = run_dir
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        self.greedy: dict[str, str] = {}

    def worker_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"started worker\d+ pid=(\d+)", self.proc.log())]

    def metrics_urls(self, role: str = r"\w+") -> list[str]:
        pattern = rf"vLLM engine started: .* disagg={role} metrics=(http://\S+)"
        return re.findall(pattern, self.proc.log())


def _start(args: list[str], log: Path, python: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [str(python), *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(vllm_hf_dir: Path) -> Path:
    return vllm_hf_dir


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, hf_dir: Path) -> Iterator[Stack]:
    python = require_vllm_venv()
    tmp = tmp_path_factory.mktemp("vllm-serve")
    port = free_port()
    args = ["-m", "tandem.cli", "serve", "--engine", "vllm", "--workers", "2", "--router", "kv"]
    args += ["--migration-limit", "3", "--port", str(port), "--run-dir", str(tmp / "run")]
    args += ["--admin-api-key", ADMIN_KEY]
    args += ["--model", str(hf_dir), "--served-model-name", MODEL, *ENGINE_FLAGS]
    # vLLM's LoRA on the same workers (its base-model tokens stay vLLM's own server's, below)
    lora_dir = tmp / "adapters"
    lora_dir.mkdir()
    args += ["--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--lora-dir", str(lora_dir)]
    popen = _start(args, tmp / "serve.log", python)
    proc = TandemProcess(name="serve", proc=popen, log_path=tmp / "serve.log")
    stack: Stack | None = None
    try:
        # while vLLM starts (importing torch for them takes seconds on a loaded host)
        write_adapter(lora_dir, "a1", rank=MAX_LORA_RANK, seed=1)
        write_adapter(lora_dir, "too-big", rank=2 * MAX_LORA_RANK, seed=2)
        base = f"http://127.0.0.1:{port}"
        ids = wait_instances(base, lambda i: len(i) == 2, timeout_s=START_TIMEOUT_S, proc=proc)
        stack = Stack(proc, base, ids, tmp / "run")
        yield stack
    finally:
        proc.stop(grace_s=30)


def test_openai_sdk_through_tandem_serve(stack: Stack) -> None:
    chat = stack.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 5
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = stack.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 10
    for prompt in PROMPTS:  # kept for the comparison with vLLM's own server at the end
        out = stack.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        stack.greedy[prompt] = out.choices[0].text


def _explain(stack: Stack, prompt: str) -> dict:
    status, _, body = http_request(
        f"{stack.base_url}/v1/route/explain",
        {"model": MODEL, "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert status == 200, body
    return json.loads(body)


def test_kv_routing_sends_a_repeated_prefix_to_its_holder(stack: Stack) -> None:
    for i in range(3):
        prefix = f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(60))
        first = stack.client.completions.create(
            model=MODEL, prompt=prefix + " Summary:", max_tokens=2, temperature=0
        )
        assert first.usage.prompt_tokens >= 3 * BLOCK_SIZE
        # the holder's BlockStored events reach the router: it sees the overlap there only
        deadline = time.monotonic() + 10
        while True:
            explain = _explain(stack, prefix + " Question:")
            overlaps = [c["overlap_blocks"] for c in explain["candidates"]]
            if max(overlaps) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert explain["block_size"] == BLOCK_SIZE
        assert sorted(overlaps)[0] == 0 and max(overlaps) >= 2, explain
        again = stack.client.completions.create(
            model=MODEL, prompt=prefix + " Question:", max_tokens=2, temperature=0
        )
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached is not None and cached >= 2 * BLOCK_SIZE, again.usage


def test_vllm_prometheus_metrics_are_served_by_each_worker(stack: Stack) -> None:
    urls = stack.metrics_urls()
    assert len(urls) == 2
    for url in urls:
        body = _scrape(url)
        assert "vllm:num_requests_running" in body and "vllm:kv_cache_usage_perc" in body


def test_vllm_workers_schedule_by_the_request_class(stack: Stack) -> None:
    """tandem's vLLM workers run vLLM's priority policy by default and take every class."""
    assert len(re.findall(r"vLLM engine started: .* scheduling=priority", stack.proc.log())) == 2
    for priority in (-1, 2):
        out = stack.client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": priority}
        )
        assert out.usage.completion_tokens == 2


def _step_totals(stack: Stack) -> tuple[float, float]:
    """(prefill tokens, steps) the vLLM workers reported in their planner WorkerStats, summed
    over workers from the frontend's merged worker metrics."""
    status, _, body = http_request(f"{stack.base_url}/metrics/workers", timeout_s=5)
    assert status == 200, body
    prefill = steps = 0.0
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "tandem_worker_step_prefill_tokens_total":
                prefill += sample.value
            elif sample.name == "tandem_worker_step_duration_seconds_count":
                steps += sample.value
    return prefill, steps


def test_vllm_workers_report_engine_steps_for_the_planner(stack: Stack) -> None:
    before = _step_totals(stack)
    stack.client.completions.create(
        model=MODEL, prompt="Count: one two three four five six", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    asyncio.run(eventually(lambda: _step_totals(stack)[0] > before[0], timeout_s=10, poll_s=0.2))
    assert _step_totals(stack)[1] > before[1]


def _generate(stack: Stack, request: PreprocessedRequest) -> list[EngineOutput]:
    """`request` straight to a vLLM worker over the request plane (with the stack's cluster
    secret), as the frontend would send it."""
    assert stack.run_dir is not None
    secret = (stack.run_dir / "cluster-secret").read_text().strip()
    records = [
        open_record(p.read_bytes(), None) for p in (stack.run_dir / "discovery").glob("*.json")
    ]
    address = min(
        r.instance.address for r in records if r.instance.path == "tandem.backend.generate"
    )

    async def call() -> list[EngineOutput]:
        client = TcpRequestClient(secret=secret)
        try:
            stream = client.stream(
                address, "tandem.backend.generate", encode(request), request_id=request.request_id
            )
            return [decode_output(p) async for p in stream]
        finally:
            await client.close()

    return asyncio.run(asyncio.wait_for(call(), 120))


def _request(
    token_ids: list[int], max_tokens: int, *, ignore_eos: bool = True, **sampling: Any
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"sampling-{uuid.uuid4().hex}", model=MODEL, token_ids=token_ids,
        sampling=SamplingParams(temperature=0, **sampling), eos_token_ids=[2],
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )  # fmt: skip


def test_penalties_logit_bias_and_structured_output_reach_vllm(stack: Stack, hf_dir: Path) -> None:
    """The OpenAI-surface sampling fields (SamplingParams of the request plane) on the real
    vLLM: logit_bias -100 removes the greedy token, a json constraint makes parseable JSON,
    values vLLM refuses are an InvalidRequest naming them."""
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    prompt = tokenizer.encode("The capital of France is").ids
    greedy = [t for o in _generate(stack, _request(prompt, 3)) for t in o.token_ids]
    assert len(greedy) == 3
    biased = _generate(stack, _request(prompt, 3, logit_bias={greedy[0]: -100.0}))
    tokens = [t for o in biased for t in o.token_ids]
    assert len(tokens) == 3 and greedy[0] not in tokens
    penalized = _generate(stack, _request(prompt, 12, repetition_penalty=1.8))
    assert [t for o in penalized for t in o.token_ids][:1] == greedy[:1]  # nothing to repeat yet

    chat = tokenizer.encode("Describe a cat as a JSON object with a name and an age: ").ids
    json_object = StructuredOutput(kind="json")
    outs = _generate(stack, _request(chat, 120, ignore_eos=False, structured=json_object))
    text = tokenizer.decode([t for o in outs for t in o.token_ids], skip_special_tokens=True)
    assert outs[-1].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text

    with pytest.raises(errors.InvalidRequest, match="repetition_penalty"):
        _generate(stack, _request(prompt, 2, repetition_penalty=0.0))
    with pytest.raises(errors.InvalidRequest, match="json_schema"):
        _generate(stack, _request(prompt, 2, structured=StructuredOutput(kind="json_schema")))


def _scrape(url: str) -> str:
    """A worker's metrics page. Its server is a thread in the worker process, which vLLM's CPU
    threads and CI's other half can starve for seconds (a 5 s timeout failed CI once)."""
    return urllib.request.urlopen(url, timeout=60).read().decode()


def _running(stack: Stack) -> float:
    total = 0.0
    for url in stack.metrics_urls():
        body = _scrape(url)
        for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+-]+)$", body, re.M):
            total += float(m.group(1))
    return total


def test_client_disconnect_frees_the_request_in_vllm(stack: Stack) -> None:
    stream = stack.client.completions.create(
        model=MODEL, prompt="Count slowly:", max_tokens=800, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for seen, _ in enumerate(stream, 1):
        if seen == 3:
            break
    assert _running(stack) >= 1  # still generating in vLLM
    stream.close()
    deadline = time.monotonic() + 15
    while _running(stack) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(stack) == 0


def _admin_post(stack: Stack, path: str, **body: str) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, _, reply = http_request(f"{stack.base_url}{path}", body, timeout_s=60, headers=headers)
    return status, reply.decode()


def test_lora_adapters_pass_through_to_vllm(stack: Stack) -> None:
    """Workers started with vLLM's --enable-lora: an adapter loaded through tandem's frontend is
    vLLM's (listed with the base as parent, a greedy chat under its name answers other tokens
    than the base's), unloading it makes the name unknown, and what vLLM refuses (a rank over
    --max-lora-rank) is a 400 with vLLM's reason. A base-model request batched with an adapter
    request keeps the base model's tokens (vLLM's CPU LoRA ops gave it the adapter's update:
    engines/vllm/lora_ops.py). Its adapters are written by `stack`."""
    messages = [{"role": "user", "content": "Name a color."}]

    def chat(model: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
        url = f"{stack.base_url}/v1/chat/completions"
        status, _, reply = http_request(url, body, 60, headers=headers)
        return status, json.loads(reply)

    status, base = chat(MODEL)
    assert status == 200, base
    status, text = _admin_post(stack, "/v1/load_lora_adapter", lora_name="a1", lora_path="a1")
    assert status == 200, text
    models = json.loads(http_request(f"{stack.base_url}/v1/models")[2])["data"]
    assert {m["id"]: m.get("parent") for m in models} == {MODEL: None, "a1": MODEL}
    status, adapted = chat("a1")
    assert status == 200 and adapted["model"] == "a1", adapted
    assert adapted["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    pin = {"x-worker-instance-id": min(stack.instance_ids)}  # both on one vLLM: one batch
    running = stack.client.chat.completions.create(
        model="a1", messages=messages, max_tokens=400, temperature=0, stream=True,
        extra_headers=pin, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in running:  # until a1 has generated a token: it runs beside the base request
        if chunk.choices and chunk.choices[0].delta.content:
            break
    status, beside = chat(MODEL, pin)
    running.close()  # a1 was still generating (400 tokens); closing aborts it in vLLM
    assert status == 200 and beside["choices"] == base["choices"], beside

    status, text = _admin_post(stack, "/v1/unload_lora_adapter", lora_name="a1")
    assert status == 200, text
    status, gone = chat("a1")
    assert status == 404 and gone["error"]["code"] == "model_not_found", gone

    too_big = {"lora_name": "too-big", "lora_path": "too-big"}
    status, text = _admin_post(stack, "/v1/load_lora_adapter", **too_big)
    assert status == 400, text
    reason = f"LoRA rank {2 * MAX_LORA_RANK} is greater than max_lora_rank {MAX_LORA_RANK}"
    assert reason in json.loads(text)["error"]["message"], text
    assert chat("too-big")[0] == 404


async def _one_stream(client: openai.AsyncOpenAI, i: int, started: asyncio.Event) -> int:
    stream = await client.completions.create(
        model=MODEL, prompt=f"Story number {i}:", max_tokens=120, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = 0
    usage = None
    async for chunk in stream:
        chunks += bool(chunk.choices)
        if chunks >= 4:
            started.set()
        usage = chunk.usage or usage
    assert usage is not None
    return int(usage.completion_tokens)


def test_sigkill_of_a_vllm_worker_mid_stream_migrates_and_reaps(stack: Stack) -> None:
    victim = stack.worker_pids()[0]
    engine_children = [p.pid for p in psutil.Process(victim).children(recursive=True)]
    assert engine_children  # EngineCore, its Worker, the reaper

    async def run() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)
        started = asyncio.Event()
        tasks = [asyncio.create_task(_one_stream(client, i, started)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 120)
        os.kill(victim, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    assert asyncio.run(run()) == [120] * 4  # every stream complete, none failed
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in engine_children):
        time.sleep(0.1)
    alive = [p for p in engine_children if psutil.pid_exists(p)]
    assert not alive, f"processes of the killed worker still running: {alive}"


class Successors:
    """vLLM's own OpenAI server and the 1P1D `tandem serve`, started together."""

    def __init__(self, tmp: Path, hf_dir: Path, python: Path) -> None:
        self.server_port, self.disagg_port = free_port(), free_port()
        self.server_log = tmp / "vllm.log"
        args = ["-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
        args += ["--port", str(self.server_port), "--model", str(hf_dir)]
        args += ["--served-model-name", MODEL, *ENGINE_FLAGS]
        self.server = _start(args, self.server_log, python)
        args = ["-m", "tandem.cli", "serve", "--engine", "vllm", "--prefill-workers", "1"]
        # conditional disaggregation: prompts of 6+ tokens are prefilled remotely, shorter ones
        # on the decode worker itself (a kv_consumer vLLM still prefills what it is given)
        args += ["--decode-workers", "1", "--disagg-min-prefill-tokens", str(MIN_REMOTE_PROMPT)]
        args += ["--port", str(self.disagg_port), "--run-dir", str(tmp / "run")]
        args += ["--model", str(hf_dir), "--served-model-name", MODEL, *ENGINE_FLAGS]
        try:
            popen = _start(args, tmp / "serve.log", python)
        except BaseException:
            self.stop_server()
            raise
        self.disagg = TandemProcess(name="serve-1p1d", proc=popen, log_path=tmp / "serve.log")

    def stop_server(self) -> None:
        if self.server.poll() is not None:
            return
        self.server.send_signal(signal.SIGTERM)
        try:
            self.server.wait(30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait(10)


@pytest.fixture(scope="module")
def successors(
    stack: Stack, hf_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Successors]:
    """Once the aggregated stack's tests are done: that stack told to stop (SIGTERM), vLLM's
    own server and the 1P1D stack started meanwhile, then the old stack awaited."""
    assert len(stack.greedy) == len(PROMPTS)
    python = require_vllm_venv()
    stack.proc.signal(signal.SIGTERM)
    started = Successors(tmp_path_factory.mktemp("vllm-successors"), hf_dir, python)
    try:
        stack.proc.stop(grace_s=30)  # its drain overlapped the imports of the new engines
        yield started
    finally:
        started.stop_server()
        started.disagg.stop(grace_s=30)


def test_greedy_output_equals_vllms_own_openai_server(stack: Stack, successors: Successors) -> None:
    server = successors.server
    try:
        base = f"http://127.0.0.1:{successors.server_port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while http_request_ok(f"{base}/v1/models") is False:
            assert server.poll() is None, successors.server_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM's server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for prompt, ours in stack.greedy.items():
            theirs = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert theirs.choices[0].text == ours, prompt
    finally:
        successors.stop_server()  # its cores to the 1P1D stack


def _metric_sum(url: str, name: str, label: str = "") -> float:
    """Sum of the metric's samples whose labels contain `label`."""
    body = _scrape(url)
    pattern = rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$"
    return sum(float(v) for labels, v in re.findall(pattern, body, re.M) if label in labels)


def test_one_prefill_one_decode_gives_the_aggregated_greedy_tokens(
    stack: Stack, successors: Successors
) -> None:
    proc = successors.disagg
    try:
        base = f"http://127.0.0.1:{successors.disagg_port}"
        proc.wait_log(r"tandem serve ready", timeout_s=START_TIMEOUT_S)
        disagg = Stack(proc, base, set())
        num_remote = num_local = 0
        for prompt in PROMPTS:
            out = disagg.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.usage.completion_tokens == GREEDY_TOKENS
            assert out.choices[0].text == stack.greedy[prompt], prompt
            if out.usage.prompt_tokens >= MIN_REMOTE_PROMPT:
                num_remote += out.usage.prompt_tokens
            else:
                num_local += out.usage.prompt_tokens
        assert num_remote and num_local
        # the KV really moved: the decode worker pulled every remote prompt's tokens over NIXL
        # and computed only the local ones (vLLM counts prompt tokens by where their KV came
        # from)
        (decode_url,) = disagg.metrics_urls("decode")
        assert _metric_sum(decode_url, "vllm:nixl_bytes_transferred_sum") > 0
        assert _metric_sum(decode_url, "vllm:nixl_num_failed_transfers_total") == 0
        by_source = "vllm:prompt_tokens_by_source_total"
        assert _metric_sum(decode_url, by_source, 'source="local_compute"') == num_local
        assert _metric_sum(decode_url, by_source, 'source="external_kv_transfer"') == num_remote
        # the prefill worker dies: a remote-sized prompt is then prefilled on the decode worker
        # (the orchestrator's fallback), with the aggregated greedy tokens and no error
        (prefill_pid,) = re.findall(r"started prefill\d+ pid=(\d+)", proc.log())
        os.kill(int(prefill_pid), signal.SIGKILL)
        prompt = PROMPTS[1]  # 8 tokens: routed to the prefill worker while it lived
        out = disagg.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.usage.prompt_tokens >= MIN_REMOTE_PROMPT
        assert out.choices[0].text == stack.greedy[prompt]
        local = _metric_sum(decode_url, by_source, 'source="local_compute"')
        assert local == num_local + out.usage.prompt_tokens  # computed here, not pulled
    finally:
        proc.stop(grace_s=30)


def http_request_ok(url: str) -> bool:
    with contextlib.suppress(OSError):
        return http_request(url, timeout_s=2)[0] == 200
    return False
