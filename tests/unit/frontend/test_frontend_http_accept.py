"""When accept runs out of file descriptors the server sheds its newest connection, logs once,
backs off and keeps accepting (uvloop's own server would stop accepting for good). Runs the
server in a child process whose descriptors the test exhausts on command."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
from tests.support.processes import REPO

pytestmark = pytest.mark.timeout(30)

SERVER = textwrap.dedent(
    """
    import asyncio, logging, os, sys
    import uvloop
    from tandem.frontend.http.server import HttpServer

    async def hello(request, response):
        await response.send(200, b"hello", content_type=b"text/plain")

    async def main():
        server = HttpServer(hello)
        host, port = await server.start("127.0.0.1", 0)
        print("PORT", port, flush=True)
        hog = []
        loop = asyncio.get_running_loop()
        commands = asyncio.Queue()
        loop.add_reader(0, lambda: commands.put_nowait(sys.stdin.readline().strip()))
        while (command := await commands.get()) != "quit":
            if command == "hog":  # take every descriptor left, as a leak elsewhere would
                try:
                    while True:
                        hog.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    pass
                print("HOGGED", len(hog), flush=True)
            elif command == "free":
                for fd in hog:
                    os.close(fd)
                hog.clear()
                print("FREED", flush=True)
        await server.stop()

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    uvloop.run(main())
    """
)


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
    data = b""
    while not data.endswith(b"hello"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_accept_out_of_descriptors_sheds_the_newest_and_recovers() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    clients: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline().split()[1])

        def connect() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            clients.append(sock)
            return sock

        older, newest = connect(), connect()
        assert _get(older).endswith(b"hello") and _get(newest).endswith(b"hello")
        proc.stdin.write("hog\n")
        proc.stdin.flush()
        assert proc.stdout.readline().startswith("HOGGED")

        late = connect()  # its accept fails: EMFILE
        assert newest.recv(4096) == b""  # shed to make room
        assert _get(late).endswith(b"hello")  # and the server still accepts
        assert _get(older).endswith(b"hello")  # the older connection was kept

        proc.stdin.write("free\n")
        proc.stdin.flush()
        assert proc.stdout.readline().startswith("FREED")
        assert all(_get(sock).endswith(b"hello") for sock in (connect(), connect()))
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        assert proc.wait(10) == 0
        log = proc.stderr.read()
        assert log.count("shedding the newest") == 1, log  # logged once per episode
    finally:
        for sock in clients:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
