"""Ids of requests without an X-Request-ID: unique within a process and across processes,
a forked one included (several frontend processes share the routers' active-request view,
keyed by request id)."""

from __future__ import annotations

import os
import re

from tandem.frontend.api.request_input import new_request_id


def test_ids_are_32_hex_digits_and_never_repeat() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_a_forked_process_draws_its_own_prefix() -> None:
    parent = new_request_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id and leave at once
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 32 and child[:16] != parent[:16]
    assert new_request_id()[:16] == parent[:16]
