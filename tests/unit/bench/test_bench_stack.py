from __future__ import annotations

import sys

import psutil
import pytest

from tandem.bench.process_stack import ProcessStack, free_port, wait_ready

pytestmark = pytest.mark.timeout(30)

_STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_stop_kills_processes_that_ignore_sigterm(tmp_path):
    stack = ProcessStack(tmp_path)
    pid = stack.spawn("stubborn", [sys.executable, "-c", _STUBBORN])
    polite = stack.spawn("polite", [sys.executable, "-c", "import time; time.sleep(60)"])
    stack.stop(grace_s=0.5)
    for p in (pid, polite):
        assert not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
    assert stack.processes == []


def test_context_manager_stops_on_error(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), ProcessStack(tmp_path) as stack:
        pid = stack.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("boom")
    assert not psutil.pid_exists(pid)


def test_check_alive_names_the_dead_process_with_its_log(tmp_path):
    with ProcessStack(tmp_path) as stack:
        stack.spawn("crasher", [sys.executable, "-c", "print('bad flag xyz'); raise SystemExit(3)"])
        stack.processes[0].process.wait(timeout=10)
        with pytest.raises(RuntimeError, match=r"crasher pid=\d+ exited with 3(.|\n)*bad flag xyz"):
            stack.check_alive()


async def test_wait_ready_returns_model_after_probe(fake_openai):
    url = f"http://127.0.0.1:{fake_openai.port}"
    fake_openai.first_token_delay_s = fake_openai.token_gap_s = 0.0
    assert await wait_ready(url, timeout_s=5) == "fake-model"
    assert fake_openai.bodies[-1]["max_tokens"] == 1  # a real completion was tried


async def test_wait_ready_times_out_with_last_error():
    with pytest.raises(TimeoutError, match="not ready"):
        await wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=0.6)
