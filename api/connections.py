"""Connections cannot hold the server: deadlines for a request's headers and body, idle
keep-alive, and a cap on open connections, at uvicorn's HTTP protocol (below the ASGI app, where
a connection that never finishes its headers is visible at all).

uvicorn's h11 protocol times out only an idle connection *after* a response: a connection that
never sends a byte, or sends half its headers, or announces a body and stalls, is kept for ever
(and `limit_concurrency` only answers 503 to a request that arrives). `GuardedH11Protocol`:

- headers: a request's headers must be complete `timeout_header` seconds after the connection
  opens (or after its first byte, on a kept-alive connection): else 408 (or, when it sent
  nothing, a plain close);
- body: the whole body must arrive `timeout_body` seconds after the headers: else 408, and the
  app sees the client gone;
- idle keep-alive: uvicorn's own `timeout_keep_alive` (vLLM's and uvicorn's 5 s);
- cap: a connection beyond `max_connections` is answered 503 (OpenAI's error shape) and closed
  at once, never registered, so a flood of idle sockets cannot use up file descriptors.

Gradio builds its uvicorn Config and Server itself (gradio.http_server.start_server), so
`gradio_server(...)` swaps in, for the duration of one launch, a subclass of Gradio's Server
that edits the Config before uvicorn loads it; `api.server.BackgroundServer` passes the same
settings to its own Config.
"""
from __future__ import annotations

import json
import logging
import resource
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REFUSE_WAIT_S = 1.0     # an over-cap connection that sends nothing is answered after this
FD_RESERVE = 256        # descriptors kept for everything but connections (files, pipes, ...)
DEFAULT_MAX_CONNECTIONS = 4096


@dataclass(frozen=True)
class ConnectionLimits:
    timeout_header: float = 10.0        # seconds for a request's headers
    timeout_body: float = 30.0          # seconds for a request's body, after its headers
    timeout_keep_alive: float = 5.0     # idle seconds between two requests (uvicorn's default)
    max_connections: int | None = None  # None: DEFAULT_MAX_CONNECTIONS, within the fd limit

    def __post_init__(self):
        for name in ("timeout_header", "timeout_body", "timeout_keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of "
                                 f"seconds, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be a positive integer, got "
                             f"{self.max_connections}")

    def cap(self) -> int:
        """The connection cap: the flag, else the default, kept FD_RESERVE below the process's
        file-descriptor limit (so accepting connections never starves opening a file)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = max(16, soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else None
        want = self.max_connections or DEFAULT_MAX_CONNECTIONS
        return want if room is None or self.max_connections else min(want, room)


def raise_fd_limit(target: int = 65536) -> None:
    """Raise this process's soft file-descriptor limit toward the hard one (vLLM does too), so
    the connection cap, not the OS, is what bounds connections. The command line calls it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def http_error(status: int, reason: str, message: str, code: str,
               headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 response (closing the connection) with an OpenAI error body."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close",
            *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and a connection cap (module
    docstring). `limits` and `cap` are set on the subclass `protocol_class` makes."""

    limits = ConnectionLimits()
    cap = DEFAULT_MAX_CONNECTIONS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timer = None
        self._body_timer = None
        self._refused = None          # the 503 timer of a connection beyond the cap

    # ---- the cap -------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.cap:
            self.transport = transport      # not registered: it holds no place in the count
            self._refused = self.loop.call_later(min(REFUSE_WAIT_S, self.limits.timeout_header),
                                                 self._refuse)
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def _refuse(self) -> None:
        if self._refused is not None:
            self._refused.cancel()
        if not self.transport.is_closing():
            self.transport.write(http_error(
                503, "Service Unavailable", f"the server has {self.cap} connections open, its "
                "limit (--max-connections); retry shortly", "too_many_connections",
                (("retry-after", "1"),)))
            self.transport.close()

    # ---- the deadlines ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return self._refuse()
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc) -> None:
        self._cancel_timers()
        if self._refused is not None:
            self._refused.cancel()
            return
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event) -> None:
        self._cancel_timers()           # the connection is the websocket protocol's from here
        super().handle_websocket_upgrade(event)

    def _mine(self) -> bool:
        return not self.transport.is_closing() and self.transport.get_protocol() is self

    def _watch(self) -> None:
        """Arm the timer the connection's state needs: waiting for headers (and not idle under
        uvicorn's keep-alive timer), or for a body; none while the app answers."""
        if not self._mine():
            return self._cancel_timers()
        state = self.conn.their_state
        if state is h11.IDLE:
            self._cancel("_body_timer")
            if self.timeout_keep_alive_task is None:
                self._arm_header_timer()
        elif state is h11.SEND_BODY:
            self._cancel("_header_timer")
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.timeout_body,
                                                        self._body_timeout)
        else:
            self._cancel_timers()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.timeout_header,
                                                      self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._mine() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial:                     # half a request: say why; nothing sent: just close
            self.transport.write(http_error(
                408, "Request Timeout", f"the request's headers did not arrive within "
                f"{self.limits.timeout_header:g} s (--timeout-header)", "request_timeout"))
        self.transport.close()

    def _body_timeout(self) -> None:
        self._body_timer = None
        if not self._mine() or self.conn.their_state is not h11.SEND_BODY:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self.transport.write(http_error(
                408, "Request Timeout", f"the request body did not arrive within "
                f"{self.limits.timeout_body:g} s of its headers (--timeout-body)",
                "request_timeout"))
        if cycle is not None:           # the app's receive() sees the client gone
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _cancel_timers(self) -> None:
        self._cancel("_header_timer")
        self._cancel("_body_timer")


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol bound to `limits` (uvicorn builds one protocol per connection)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"limits": limits, "cap": limits.cap()})


def configure(config, limits: ConnectionLimits, wrap: Callable | None = None,
              log_level: str | None = None) -> None:
    """Edit a uvicorn Config before it loads: our protocol, keep-alive, and `wrap(app)` as the
    outermost ASGI layer; `log_level` sets uvicorn's loggers (vLLM's --uvicorn-log-level)."""
    config.http = protocol_class(limits)
    config.timeout_keep_alive = limits.timeout_keep_alive
    config.limit_concurrency = None         # the cap is the protocol's, per connection
    if wrap is not None:
        config.app = wrap(config.app)
    if log_level:
        level = logging.getLevelName(log_level.upper()) if log_level != "trace" else 5
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(level)


_LAUNCH_LOCK = threading.Lock()


@contextmanager
def gradio_server(limits: ConnectionLimits, wrap: Callable | None = None,
                  log_level: str | None = None):
    """Within this block, the server Gradio's launch() starts has our protocol and `wrap`:
    gradio.http_server.Server is swapped for a subclass that edits the Config first."""
    from gradio import http_server
    with _LAUNCH_LOCK:          # one launch at a time sees the swapped class
        base = http_server.Server

        class Server(base):
            def __init__(self, config, *args, **kwargs):
                configure(config, limits, wrap, log_level)
                super().__init__(config, *args, **kwargs)
        http_server.Server = Server
        try:
            yield
        finally:
            http_server.Server = base

