"""The API key: `--api-key`, $GLASSBOX_API_KEY or vLLM's $VLLM_API_KEY makes every route require
`Authorization: Bearer KEY`; serving on a non-loopback address (or a share link) without one is
refused unless --allow-unauthenticated says so, and then prints a warning."""
from __future__ import annotations

import hmac
import ipaddress
import os

from fastapi import Request

from .errors import APIError

API_KEY_ENV = "GLASSBOX_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"      # vLLM's: a deployment written for vLLM keeps it


def resolve_api_key(flag: str | None) -> str | None:
    """The flag if given, else $GLASSBOX_API_KEY, else $VLLM_API_KEY; an empty string means no
    key."""
    if flag is not None:
        return flag or None
    for env in (API_KEY_ENV, VLLM_API_KEY_ENV):
        if os.environ.get(env):
            return os.environ[env]
    return None


def is_loopback(host: str | None) -> bool:
    if host in (None, "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:          # a host name other than localhost: assume it is reachable
        return False


EXPOSED = ("the playground (chat, the model switch, the shared-prefix burst, every tab's "
           "view of the engine), the OpenAI-compatible API (/v1/*) and Gradio's API (/chat)")


def exposure_warning(host: str | None, api_key: str | None, share: bool = False) -> str | None:
    """The warning to print when the server is reachable from other machines without a key."""
    if api_key or (is_loopback(host) and not share):
        return None
    where = "a public share link" if share else f"{host}, reachable from other machines"
    return (f"WARNING: serving on {where} without a key: anyone who can reach it can use "
            f"{EXPOSED}. Pass --api-key KEY or set {API_KEY_ENV} (it then guards every route), "
            f"or bind to 127.0.0.1.")


def exposure_refusal(host: str | None, api_key: str | None, share: bool,
                     allow_unauthenticated: bool) -> str | None:
    """Why the server must not start (binding beyond localhost without a key needs an explicit
    --allow-unauthenticated), or None."""
    if allow_unauthenticated or exposure_warning(host, api_key, share) is None:
        return None
    where = "a public share link" if share else f"{host}"
    return (f"refusing to serve on {where} without a key: anyone who can reach it could use "
            f"{EXPOSED}. Pass --api-key KEY (or set {API_KEY_ENV} or {VLLM_API_KEY_ENV}); or, "
            f"to expose it on purpose, add --allow-unauthenticated.")


def bearer_check(api_key: str | None):
    """A FastAPI dependency that refuses requests without the key (a no-op without a key)."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None or request.scope.get("glassbox.auth") in ("bearer", "cookie"):
            return      # no key, or api.guard checked it already (a browser's cookie too)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer KEY' "
                                "(the key the server was started with, --api-key or "
                                f"{API_KEY_ENV})", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
    return check
