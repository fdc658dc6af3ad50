"""Client segment ids bound to their content.

A request may name a shared segment (``kv_transfer_params.kvcomm.segments[i].id``). The engine
keys base KV, anchors and deviations by a segment's id, so an id trusted as sent would let
other tokens sent under a known id be estimated from the wrong base. Here every annotated
segment is keyed by its content (``kvcomm.core.segments.content_id`` of its token ids,
whatever the client called it), and a client id is remembered per tenant with the content it
first named: the same id with other tokens is refused with a clear error (that request is
served without reuse), never planned.

Memory: at most ``MAX_IDS`` ids per tenant are remembered (least recently used forgotten); a
forgotten id is only a lost check, since keying is by content.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

from kvcomm.core.segments import content_id
from kvcomm.integrations.vllm.wire.params import KvcommParams, KvcommParamsError, shown

MAX_IDS = 4096
"""Client segment ids remembered per tenant."""


class SegmentIds:
    """Per tenant: client id -> the content id of the tokens it first named (LRU, ``max_ids``)."""

    def __init__(self, max_ids: int = MAX_IDS):
        self.max_ids = max_ids
        self._seen: dict[str, OrderedDict[str, str]] = {}
        self._lock = threading.Lock()

    def bind(self, tenant: str, token_ids: list[int], params: KvcommParams) -> KvcommParams:
        """``params`` with every annotated segment's id replaced by its content id. Raises
        ``KvcommParamsError`` when a client id was seen before (for ``tenant``) with other tokens."""
        if not params.segments:
            return params
        spans = []
        with self._lock:
            seen = self._seen.setdefault(tenant, OrderedDict())
            for i, span in enumerate(params.segments):
                content = content_id(token_ids[span.start : span.end])
                if span.shared_id is not None:
                    first = seen.get(span.shared_id)
                    if first is not None and first != content:
                        raise KvcommParamsError(
                            f"kv_transfer_params.kvcomm.segments[{i}].id {shown(span.shared_id)} was sent before with "
                            "other tokens; an id names one content: give this content a new id, or none")
                    seen[span.shared_id] = content
                    seen.move_to_end(span.shared_id)
                    while len(seen) > self.max_ids:
                        seen.popitem(last=False)
                spans.append(dataclasses.replace(span, shared_id=content))
        return dataclasses.replace(params, segments=tuple(spans))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._seen.values())
