"""Recent answers of the Responses API, kept so that a follow-up request can
name one (`previous_response_id`) and send only its new items.

In memory, bounded: the least recently used answer leaves first once
`response_store_size` are kept (0 keeps none). Lost on restart, as a cache is.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    response: dict  # the response object as it was answered
    items: list[dict]  # the whole conversation: every input item, then the output items


class ResponseStore:
    def __init__(self, size: int):
        self.size = size
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict, input_items: list[dict]) -> None:
        if self.size <= 0:
            return
        self._kept[response["id"]] = StoredResponse(response, [*input_items, *response["output"]])
        self._kept.move_to_end(response["id"])
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None
