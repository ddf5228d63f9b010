"""The walk of one aggregated, streamed chat completion stays short (issue 29).

`tests/support/request_walk.py` records the `src/tandem` files that run on behalf of one
request (its docstring defines it). At 74b6e1e, before the structural step, the frontend's half
entered 34 files (41 with the worker's); the step brought it to the figures below. A change
that adds a stop to every request's path fails here with the path listed: walk it with
`python -m tests.support.request_walk` and either keep the request off the new module (a
feature the request does not use should cost it nothing) or raise the bound knowingly."""

from __future__ import annotations

from tests.support.request_walk import request_path, walk_one_chat

# 30 and 37 after the structural step; issue 33 added two stages every request passes, who is
# asking (frontend/tenancy.py) and its fair-share accounting in the router queue
# (router/queue.py): 32 and 39. Then what a plain request does not use went off its path: the
# API-key check with no key configured (frontend/auth.py), the identity with no tenants file
# and no identity header (frontend/tenancy.py), spans with tracing off (runtime/tracing.py) and
# the log lines' request id without JSON logs (runtime/log_format.py): 28 and 35. An
# adapter's placement (router/lora.py) stays off it too.
MAX_FRONTEND_FILES = 28
MAX_FILES = 35


async def test_the_walk_of_one_chat_completion_stays_short() -> None:
    request, idle = await walk_one_chat()
    path, front = request_path(request, idle)
    listing = "\n".join(f"  {'F' if f in front else 'W'}  {f}" for f in path)
    assert len(front) <= MAX_FRONTEND_FILES, f"frontend's half: {len(front)} files\n{listing}"
    assert len(path) <= MAX_FILES, f"request path: {len(path)} files\n{listing}"
    assert "tandem/frontend/pipeline/tools.py" not in path, "a chat without tools entered tools"
    assert "tandem/multimodal/prompt.py" not in path, "a text-only chat entered multimodal"
    unused = {  # what this frontend does not run: no API key, tenants file, tracing, JSON logs
        "tandem/frontend/auth.py",
        "tandem/frontend/tenancy.py",
        "tandem/runtime/tracing.py",
        "tandem/runtime/log_format.py",
    }
    assert not unused & set(path), f"a plain request entered {sorted(unused & set(path))}"
    assert not idle.order, f"background loops were counted in the idle window: {idle.order}"
