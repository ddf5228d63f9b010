"""`--tool-call-parser` and `--reasoning-parser` through the in-process stack: the worker's
flag (WorkerConfig, from `tandem worker` argv) travels in its ModelCard to the frontend, which
offers the tools in that format's markup (SmolLM2's template takes no tools) and parses a
scripted model output into `tool_calls` / `reasoning_content`, whole and streamed."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import openai
import pytest
from openai.types.responses import ResponseReasoningItem
from tests.support.frontend_stack import CHAT, FrontendStack
from tests.support.model_outputs import TOOLS
from tests.support.scripted_engine import ScriptedEngine

from tandem.cli import worker as worker_cli
from tandem.engines.worker import Worker, WorkerConfig
from tandem.runtime.flag_parser import parse_args

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
READY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
MISTRAL_OUT = (
    'I\'ll check both for you.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris"}'
    '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}'
)
R1_OUT = "The user wants the capital. It is Paris.\n</think>\n\nParis."


def _worker_config(argv: list[str]) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog="tandem worker")
    worker_cli.add_arguments(parser, ["--engine", "mocker", *argv])
    return worker_cli.worker_config_from_args(parse_args(parser, ["--engine", "mocker", *argv]))


@asynccontextmanager
async def _stack(
    text: str, argv: list[str], *, eos: bool = False
) -> AsyncIterator[tuple[FrontendStack, ScriptedEngine]]:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        engine = ScriptedEngine(text, eos=eos)
        worker = Worker(engine, await s.runtime(), _worker_config(argv))
        await worker.start()
        exit_stack.push_async_callback(worker.stop, 0)
        await s.start_frontend(READY)
        engine.prompts.clear()
        yield s, engine


def _events(text: str) -> list[dict[str, Any]]:
    lines = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


async def test_the_tool_call_parser_flag_reads_mistral_calls_whole_and_streamed() -> None:
    tools = [t.to_dict() for t in TOOLS]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Paris?"}], "tools": tools}
    # [TOOL_CALLS] is a special token, so the text keeps special tokens: not the EOS's text
    async with _stack(MISTRAL_OUT, ["--tool-call-parser", "mistral"], eos=True) as (s, engine):
        status, resp, _ = await s.post(CHAT, body)
        assert status == 200, resp
        choice = resp["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "I'll check both for you."
        calls = choice["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_current_weather", {"location": "Paris"}),
            ("get_time", {"timezone": "Europe/Paris"}),
        ]
        assert all(len(c["id"]) == 9 for c in calls)  # Mistral's call ids
        # SmolLM2's template takes no tools: the prompt asks for Mistral's markup
        assert "[TOOL_CALLS]" in engine.prompts[0] and "<tool_call>" not in engine.prompts[0]

        status, text, _ = await s.post(CHAT, {**body, "stream": True})
        assert status == 200
        content, streamed, finish = "", {}, None
        for event in _events(text):
            delta = event["choices"][0]["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls", []):
                entry = streamed.setdefault(d["index"], {"name": None, "args": ""})
                entry["name"] = entry["name"] or d["function"].get("name")
                entry["args"] += d["function"]["arguments"]
            finish = event["choices"][0]["finish_reason"] or finish
        assert content == "I'll check both for you." and finish == "tool_calls"
        assert [(c["name"], json.loads(c["args"])) for c in streamed.values()] == [
            ("get_current_weather", {"location": "Paris"}),
            ("get_time", {"timezone": "Europe/Paris"}),
        ]


async def test_the_reasoning_parser_flag_moves_thinking_into_reasoning_content() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}]}
    async with _stack(R1_OUT, ["--reasoning-parser", "deepseek_r1"]) as (s, _):
        status, resp, _ = await s.post(CHAT, body)
        assert status == 200, resp
        message = resp["choices"][0]["message"]
        assert message["reasoning_content"] == "The user wants the capital. It is Paris.\n"
        assert message["content"] == "Paris."

        status, text, _ = await s.post(CHAT, {**body, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in _events(text)]
        assert (
            "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        )
        assert "".join(d.get("content") or "" for d in deltas) == "Paris."
        assert not any("think>" in (d.get("content") or "") for d in deltas)

        off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        status, resp, _ = await s.post(CHAT, off)
        assert resp["choices"][0]["message"]["content"] == R1_OUT  # not parsed when off


def test_a_parser_name_not_known_stops_the_worker_naming_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _worker_config(["--tool-call-parser", "granite"])
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "'hermes', 'llama3_json', 'mistral'" in err
    with pytest.raises(SystemExit):
        _worker_config(["--reasoning-parser", "r1"])
    assert "'deepseek_r1', 'qwen3'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected one of: hermes"):
        WorkerConfig(tool_call_parser="granite")


async def test_a_reasoning_model_answers_responses_with_a_reasoning_item_first() -> None:
    async with _stack(R1_OUT, ["--reasoning-parser", "deepseek_r1"]) as (s, _):
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="none", max_retries=0)
        try:
            r = await client.responses.create(model=MODEL, input="Capital of France?")
            assert [item.type for item in r.output] == ["reasoning", "message"]
            reasoning = r.output[0]
            assert isinstance(reasoning, ResponseReasoningItem) and reasoning.content
            assert reasoning.content[0].text == "The user wants the capital. It is Paris.\n"
            assert r.output_text == "Paris."

            events = [e async for e in await client.responses.create(
                model=MODEL, input="Capital of France?", stream=True
            )]  # fmt: skip
            kinds = [e.type for e in events]
            assert kinds[:3] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
            ]
            first_text = kinds.index("response.output_text.delta")
            assert kinds.index("response.reasoning_text.done") < first_text
            assert (
                "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
                == reasoning.content[0].text
            )
            assert (
                "".join(e.delta for e in events if e.type == "response.output_text.delta")
                == "Paris."
            )
            done = events[-1]
            assert done.type == "response.completed"
            assert [item.type for item in done.response.output] == ["reasoning", "message"]
            assert [e.sequence_number for e in events] == list(range(len(events)))
        finally:
            await client.close()


async def test_a_forced_call_of_a_reasoning_model_is_a_call_not_reasoning() -> None:
    """The grammar writes the call from the first token: a parser that starts inside
    reasoning (deepseek_r1) must not take it for thoughts."""
    forced = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    tools = [t.to_dict() for t in TOOLS]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Time?"}],
        "tools": tools,
        "tool_choice": "required",
    }
    async with _stack(forced, ["--reasoning-parser", "deepseek_r1"]) as (s, _):
        status, resp, _ = await s.post(CHAT, body)
        assert status == 200, resp
        message = resp["choices"][0]["message"]
        assert message.get("reasoning_content") is None
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_every_endpoint_keeps_the_eos_out_of_a_mistral_models_text(path: str) -> None:
    """/v1/messages and /v1/responses build their choice the way chat does: the EOS that a
    tool-call parser's kept special tokens would let through is not text on either."""
    async with _stack("Sunny in Paris.", ["--tool-call-parser", "mistral"], eos=True) as (s, _):
        if path == "/v1/messages":
            tools = [
                {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                for t in (t.to_dict() for t in TOOLS)
            ]
            body = {"model": MODEL, "max_tokens": 32, "tools": tools}
            body["messages"] = [{"role": "user", "content": "Paris?"}]
            status, resp, _ = await s.post(path, body)
            assert status == 200, resp
            assert [b["text"] for b in resp["content"]] == ["Sunny in Paris."], resp
        else:
            body = {"model": MODEL, "input": "Paris?", "max_output_tokens": 32}
            status, resp, _ = await s.post(path, body)
            assert status == 200, resp
            texts = [c["text"] for o in resp["output"] for c in o.get("content", [])]
            assert texts == ["Sunny in Paris."], resp
