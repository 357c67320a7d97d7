"""Connections cannot hold the server: raw sockets against the playground's server (and the bare
API's) started with short limits. Headers that never finish, bodies that stall and idle
keep-alive connections are closed on time; connections beyond the cap are answered 503 at
once while a normal request still succeeds; afterwards the server's file descriptors are back
at their baseline."""
from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

from ui_helpers import free_port, require_engine, wait_until  # noqa: I001

HEADER_S, BODY_S, KEEP_ALIVE_S, CAP = 2.0, 2.0, 1.0, 64
SLACK_S = 4.0           # a loaded 2-core machine answers late; "never" is what fails


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def limits():
    from api.connections import ConnectionLimits
    return ConnectionLimits(timeout_header=HEADER_S, timeout_body=BODY_S,
                            timeout_keep_alive=KEEP_ALIVE_S, max_connections=CAP)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    require_engine()
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import app
    from engine import LLM
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    demo = app.build_app(llm)
    port = free_port()
    app.launch(demo, port=port, prevent_thread_lock=True, connections=limits())
    yield port
    demo.close()
    demo.hub.shutdown()


def connect(port: int, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        s.sendall(data)
    return s


def until_closed(s: socket.socket, within: float) -> tuple[bytes, float]:
    """Read until the server closes the connection: (what it sent, seconds it took); raises
    AssertionError when it is still open after `within` seconds."""
    t0, got = time.monotonic(), b""
    s.settimeout(0.2)
    while time.monotonic() - t0 < within:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return got, time.monotonic() - t0
        if not chunk:
            return got, time.monotonic() - t0
        got += chunk
    raise AssertionError(f"still open after {within:.0f} s (sent {got[:80]!r})")


def ok(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_headers_that_never_finish_are_closed_within_the_header_timeout(server):
    socks = [connect(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
             for _ in range(40)]
    silent = connect(server)                        # connected, and never sends a byte
    try:
        for s in socks:
            got, took = until_closed(s, HEADER_S + SLACK_S)
            assert not got or got.startswith(b"HTTP/1.1 408"), got[:100]
        assert until_closed(silent, HEADER_S + SLACK_S)[0] == b""
    finally:
        for s in socks + [silent]:
            s.close()
    assert ok(server)


def test_a_stalled_body_is_answered_408_and_closed(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 4000000\r\n\r\n")
    socks = [connect(server, head + b'{"prompt": "' + b"x" * 65536) for _ in range(20)]
    try:
        for s in socks:
            got, _ = until_closed(s, BODY_S + SLACK_S)
            assert got.startswith(b"HTTP/1.1 408"), got[:200]
            assert b"request_timeout" in got and b"--timeout-body" in got
    finally:
        for s in socks:
            s.close()
    assert ok(server)


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    s = connect(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        got, took = until_closed(s, KEEP_ALIVE_S + SLACK_S)
        assert got.startswith(b"HTTP/1.1 200"), got[:100]
        assert took >= KEEP_ALIVE_S * 0.8
    finally:
        s.close()


def test_connections_beyond_the_cap_get_503_at_once_and_service_resumes(server):
    fds0 = open_fds()
    held = [connect(server) for _ in range(CAP)]
    try:
        time.sleep(0.3)
        extra = [connect(server, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                 for _ in range(200)]
        t0 = time.monotonic()
        for s in extra:
            got, _ = until_closed(s, SLACK_S)
            assert got.startswith(b"HTTP/1.1 503"), got[:200]
            assert b"--max-connections" in got
            s.close()
        assert time.monotonic() - t0 < SLACK_S
    finally:
        for s in held:
            s.close()
    wait_until(lambda: ok(server), timeout=10)
    # every connection the server held is closed: its descriptors are back at the baseline
    wait_until(lambda: open_fds() <= fds0 + 2, timeout=HEADER_S + SLACK_S)


def test_the_bare_api_server_has_the_same_limits(qwen3_dir):
    from api.server import BackgroundServer, create_app
    from engine import LLM
    with LLM(qwen3_dir, device="cpu", num_kv_blocks=16, block_size=4) as llm:
        srv = BackgroundServer(create_app(llm), connections=limits())
        try:
            s = connect(srv.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            got, _ = until_closed(s, HEADER_S + SLACK_S)
            s.close()
            assert not got or got.startswith(b"HTTP/1.1 408")
        finally:
            srv.stop()
