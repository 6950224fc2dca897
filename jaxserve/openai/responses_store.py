"""The responses a server keeps (`store`, on by default as OpenAI's) for `previous_response_id` and
GET /v1/responses/{id}: in memory, the most recently used `size` of them (a bounded LRU: an old id is then a 404, as
an unknown one). Each keeps its response object and its conversation's items (its input after its predecessors',
then its output), which a request continuing it is answered after."""
from __future__ import annotations

import collections
import dataclasses

from jaxserve.openai.errors import ApiError

DEFAULT_STORE_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object
    conversation: list[dict]  # input items then output items, oldest first


class ResponseStore:
    def __init__(self, size: int = DEFAULT_STORE_SIZE):
        if size < 0:
            raise ValueError(f"the responses store size must be >= 0, got {size}")
        self.size = size
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict, conversation: list[dict]) -> None:
        if self.size == 0:
            return
        self._entries[body["id"]] = StoredResponse(body, conversation)
        self._entries.move_to_end(body["id"])
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response, or OpenAI's 404 (invalid_request_error, naming `param` if given)."""
        found = self._entries.get(response_id)
        if found is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param, "response_not_found")
        self._entries.move_to_end(response_id)
        return found
