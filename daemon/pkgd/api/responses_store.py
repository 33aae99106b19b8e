"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``.

Bounded and in memory, one store per API-server process (``frontend.responses_store_size``
responses, the oldest dropped first; 0 = none). With several API servers a client must reach
the same server again to continue a stored response; a restart forgets them all.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any


@dataclasses.dataclass
class StoredResponse:
    """A response object and the conversation it ended (chat messages, instructions excluded:
    OpenAI does not carry ``instructions`` over to a follow-up)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        self._items[response["id"]] = StoredResponse(response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def __len__(self) -> int:
        return len(self._items)
