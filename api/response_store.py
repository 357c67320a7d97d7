"""Stored responses of the Responses API (`store`, on by default): in memory, bounded by count and
by size (the least recently used go first), each readable only by the credential that created
it. A stored response keeps its body (GET /v1/responses/{id}) and its conversation as chat
messages, so a request naming it as `previous_response_id` continues that conversation."""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import Request

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20        # the bodies and conversations held, as JSON


def owner_of(request: Request) -> str:
    """Who may read what a request stores: a digest of its bearer token (on a keyless server the
    token a client sends still names it: another token sees none of its responses), or the
    browser session of the playground's own pages. Never the token itself."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    who = token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    if not who and request.scope.get("glassbox.auth") == "cookie":
        who = "\x00cookie"
    return hashlib.sha256(who.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    body: dict              # the response object as it was returned
    messages: list          # the conversation with the reply, as chat messages (no instructions)
    input_items: list       # this request's input, as items with ids (GET .../input_items)
    size: int


class ResponseStore:
    """Thread-safe: requests are prepared on worker threads, stored from the event loop."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, owner: str, body: dict, messages: list, input_items: list = ()) -> None:
        input_items = list(input_items)
        size = sum(len(json.dumps(x, ensure_ascii=False)) for x in (body, messages, input_items))
        if size > self.max_bytes:
            return              # larger than the whole store: kept by nobody
        with self._lock:
            self._drop(body["id"])
            self._items[body["id"]] = StoredResponse(owner, body, messages, input_items, size)
            self._bytes += size
            while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response if `owner` stored it (and it is still held), else None: another
        owner's response is as absent as one that never existed."""
        with self._lock:
            item = self._items.get(response_id)
            if item is None or item.owner != owner:
                return None
            self._items.move_to_end(response_id)
            return item

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            item = self._items.get(response_id)
            if item is None or item.owner != owner:
                return False
            self._drop(response_id)
            return True

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, response_id: str) -> None:
        item = self._items.pop(response_id, None)
        if item is not None:
            self._bytes -= item.size
