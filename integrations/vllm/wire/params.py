"""The per-request options of the kvcomm vLLM plugin, in two objects of ``kv_transfer_params``:
``"kvcomm"``, what a client may send, and ``"kvcomm_server"`` (``SERVER_KEY``), what only kvcomm's
own callers set (`kvcomm serve` on the requests it sends its own app, ``VllmExecutor`` in
process). `kvcomm serve`'s middleware removes ``"kvcomm_server"`` whole from every client body.

Schema (JSON objects; every key optional, unknown keys rejected)::

    {"kvcomm": {
        "template": "<str>",                 # agent template id (default: "default")
        "tenant":   "<str>",                 # tenant key (default: "default"); `kvcomm serve`
                                             # with API keys overwrites it with the key's tenant
        "calibrate": false,                  # true: reuse nothing, prefill densely and learn
                                             # everything (each shared segment whose content
                                             # has a base becomes an anchor of its slot, up to
                                             # V): calibration traffic that fills the pools
                                             # (server-side planning only, not with "handle")
        "segments": [                        # shared segments, sorted, non-overlapping;
                                             # absent: detected automatically (vllm.planning.run_index)
            {"start": 12, "end": 40,         # prompt token span [start, end), end <= prompt length
             "slot": "task",                 # slot name (anchor pool); a known slot when the
                                             # server was started with a slot list
             "id": "<str>"}                  # optional shared content id (default: token hash)
        ]
     },
     "kvcomm_server": {
        "handle":  "<str>",                  # VllmExecutor: the channel order carrying KV to
                                             # inject / capture (the caller planned)
        "purpose": "client",                 # what the request is for (PURPOSES): "client" (a
                                             # client's request), "preamble" (computes the
                                             # preamble of the request planned ahead under
                                             # "ticket"; its prompt is that request's first
                                             # ``preamble_end`` tokens), "dense_twin" / "reuse_twin" (the quality
                                             # guard's twins of a sampled request: the dense one
                                             # with "calibrate", it learns; the reuse one with the
                                             # twin ticket, served the sampled plan again, it
                                             # learns nothing); only "client" is counted in metrics
        "ticket":  "<str>",                  # the plan made ahead for this request
                                             # (``ServerPlanner.plan_ahead``), used once
        "retain":  ["<content id>"],         # the context API: pin these contents' base KV
        "release": ["<content id>"]          # ... unpin and drop them (serve.contexts)
    }}

Sizes are bounded (``check_sizes``): ``template``, ``tenant``, ``handle``, ``ticket`` and every ``id`` at most
``MAX_NAME_LENGTH`` characters, at most ``MAX_SEGMENTS`` segments; `kvcomm serve` answers a
request over these bounds with HTTP 400 before it reaches the engine.

A request without the ``"kvcomm"`` key is not touched by the plugin. A request with an
invalid value gets no reuse at all (it is prefilled like stock vLLM) and its output's
``kv_transfer_params`` carries ``{"kvcomm": {"error": "<what was wrong and how to fix it>"}}``;
other requests are unaffected. `kvcomm serve` answers HTTP 400 instead for every error it can
see before vLLM tokenizes the prompt (``parse_params`` without a prompt length: types, keys,
names, order); only a span past the prompt's end is answered in-band.
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass
from typing import Any, Collection

SLOT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")  # \Z: "$" also matches before a final newline
"""A well-formed slot name (an annotation's ``slot``, a name in the connector's ``slots``)."""
_KEYS = {"template", "tenant", "segments", "calibrate"}
SERVER_KEY = "kvcomm_server"
"""The ``kv_transfer_params`` key of what only kvcomm's own callers set (module docstring)."""
_SERVER_KEYS = {"handle", "purpose", "ticket", "retain", "release"}
PURPOSES = ("client", "preamble", "dense_twin", "reuse_twin")
"""What a request is (``kvcomm_server.purpose``): a client's, a preamble request, a quality guard's twin."""
MAX_TENANT_LENGTH = 256
MAX_NAME_LENGTH = 256
"""Characters of a template, handle or segment id at most."""
MAX_SEGMENTS = 512
"""Annotated segments of one request at most."""
MAX_SHOWN = 200
"""Characters of a client's value an error message shows at most."""
_SEGMENT_KEYS = {"start", "end", "slot", "id"}


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` in at most about ``limit`` characters (a long string cut, with its length;
    containers shortened as ``reprlib`` does), for error messages and logs that name a client's
    value: one request must not write a multi-MB line."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlist, short.maxdict, short.maxlevel = limit, limit, 8, 8, 3
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_sizes(body: Any) -> None:
    """Raise ``KvcommParamsError`` when ``kv_transfer_params["kvcomm"]`` (``body``) is over the size
    bounds (``MAX_NAME_LENGTH``, ``MAX_TENANT_LENGTH``, ``MAX_SEGMENTS``); other mistakes are left
    for ``parse_params``, which needs the prompt."""
    if not isinstance(body, dict):
        return
    for key, bound in (("template", MAX_NAME_LENGTH), ("tenant", MAX_TENANT_LENGTH)):
        value = body.get(key)
        if isinstance(value, str) and len(value) > bound:
            raise KvcommParamsError(f"kv_transfer_params.kvcomm.{key} has {len(value)} characters; at most {bound} characters")
    segments = body.get("segments")
    if isinstance(segments, list):
        if len(segments) > MAX_SEGMENTS:
            raise KvcommParamsError(f"kv_transfer_params.kvcomm.segments has {len(segments)} entries; at most "
                                    f"{MAX_SEGMENTS} (merge adjacent spans of one slot)")
        for i, item in enumerate(segments):
            value = item.get("id") if isinstance(item, dict) else None
            if isinstance(value, str) and len(value) > MAX_NAME_LENGTH:
                raise KvcommParamsError(f"kv_transfer_params.kvcomm.segments[{i}].id has {len(value)} characters; "
                                        f"at most {MAX_NAME_LENGTH}")


class KvcommParamsError(ValueError):
    """Invalid ``kv_transfer_params["kvcomm"]``; the message says what and how to fix it."""


@dataclass(frozen=True)
class SpanAnnotation:
    """A shared segment named by the caller: prompt tokens ``[start, end)`` fill ``slot``."""

    start: int
    end: int
    slot: str
    shared_id: str | None = None


@dataclass(frozen=True)
class KvcommParams:
    handle: str | None
    template: str
    segments: tuple[SpanAnnotation, ...] | None
    """None: not given, detect shared segments automatically."""
    tenant: str = "default"
    calibrate: bool = False
    """Reuse nothing and learn all the dense prefill reveals (``ReuseEngine.calibration_plan``)."""
    retain: tuple[str, ...] = ()
    """Content ids whose base KV the tenant's engine keeps from now on (never evicted) until released."""
    release: tuple[str, ...] = ()
    """Content ids no longer kept: their bases are dropped (an anchor of the content keeps its own)."""
    ticket: str | None = None
    """The plan made ahead for this request (``ServerPlanner.plan_ahead``; set by `kvcomm serve`)."""
    purpose: str = "client"
    """What the request is (``PURPOSES``; set by `kvcomm serve`): a client's, a preamble request (with
    ``ticket``: it computes that plan's preamble, its prompt the preamble's end's prefix), or one of the
    quality guard's twins of a sampled request (``vllm.planning.guard``): with ``ticket`` the
    reuse twin (served the same plan, it learns nothing), with ``calibrate`` the dense twin (it
    learns, as calibration traffic does)."""

    @property
    def computes_preamble(self) -> bool:
        return self.purpose == "preamble"


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvcommParamsError(f"{where} must be an integer, got {type(value).__name__} {shown(value)}")
    return value


def parse_params(params: Any, prompt_len: int | None, known_slots: Collection[str] | None = None) -> KvcommParams | None:
    """Validate a request's ``kv_transfer_params``; None when it does not opt into kvcomm.

    prompt_len: the prompt's length in tokens; None where it is not known yet (`kvcomm serve`'s
    middleware, before vLLM tokenizes): every check but a span's end against it.
    known_slots: slot names the server accepts (None: any well-formed name).
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KvcommParamsError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    if "kvcomm" not in params:
        return None
    body = params["kvcomm"]
    if not isinstance(body, dict):
        raise KvcommParamsError(f"kv_transfer_params.kvcomm must be a JSON object, got {type(body).__name__}")
    unknown = set(body) - _KEYS
    if unknown:
        own = unknown & (_SERVER_KEYS | _OLD_SERVER_KEYS)
        moved = f" ({sorted(own)} are kvcomm's own, set by `kvcomm serve` and VllmExecutor, never by a client)" if own else ""
        raise KvcommParamsError(f"kv_transfer_params.kvcomm has unknown keys {shown(sorted(unknown))}; allowed: "
                                f"{sorted(_KEYS)}{moved}")
    check_sizes(body)
    template = body.get("template", "default")
    if not isinstance(template, str) or not template:
        raise KvcommParamsError(f"kv_transfer_params.kvcomm.template must be a non-empty string, got {shown(template)}")
    tenant = body.get("tenant", "default")
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_LENGTH:
        raise KvcommParamsError(
            f"kv_transfer_params.kvcomm.tenant must be a non-empty string of at most {MAX_TENANT_LENGTH} characters"
        )
    calibrate = body.get("calibrate", False)
    if not isinstance(calibrate, bool):
        raise KvcommParamsError(f"kv_transfer_params.kvcomm.calibrate must be true or false, got {shown(calibrate)}")
    server = _server(params.get(SERVER_KEY, {}), calibrate)
    handle = server.pop("handle")
    if "segments" not in body:
        return KvcommParams(handle, template, None, tenant, calibrate, **server)
    raw = body["segments"]
    if not isinstance(raw, list):
        raise KvcommParamsError(f"kv_transfer_params.kvcomm.segments must be a list, got {type(raw).__name__}")
    segments: list[SpanAnnotation] = []
    for i, item in enumerate(raw):
        where = f"kv_transfer_params.kvcomm.segments[{i}]"
        if not isinstance(item, dict):
            raise KvcommParamsError(f"{where} must be an object with start, end, slot (and optional id)")
        unknown = set(item) - _SEGMENT_KEYS
        missing = {"start", "end", "slot"} - set(item)
        if unknown or missing:
            raise KvcommParamsError(f"{where}: unknown keys {shown(sorted(unknown))}, missing keys {sorted(missing)}")
        start, end = _int(item["start"], f"{where}.start"), _int(item["end"], f"{where}.end")
        if not 0 <= start < end or (prompt_len is not None and end > prompt_len):
            raise KvcommParamsError(f"{where} spans [{start}, {end}); need 0 <= start < end <= {prompt_len} (the prompt length)")
        slot = item["slot"]
        if not isinstance(slot, str) or not SLOT_NAME.match(slot):
            raise KvcommParamsError(f"{where}.slot must be a name like 'task' (letters, digits, _ . -), got {shown(slot)}")
        if known_slots is not None and slot not in known_slots:
            raise KvcommParamsError(f"{where}.slot {shown(slot)} is not a known slot; known: {sorted(known_slots)}")
        shared_id = item.get("id")
        if shared_id is not None and (not isinstance(shared_id, str) or not shared_id):
            raise KvcommParamsError(f"{where}.id must be a non-empty string, got {shown(shared_id)}")
        if segments and start < segments[-1].end:
            raise KvcommParamsError(
                f"{where} [{start}, {end}) overlaps or precedes segments[{i - 1}] "
                f"[{segments[-1].start}, {segments[-1].end}); give segments sorted and non-overlapping"
            )
        segments.append(SpanAnnotation(start, end, slot, shared_id))
    return KvcommParams(handle, template, tuple(segments), tenant, calibrate, **server)


_OLD_SERVER_KEYS = {"contexts", "computes_head", "shadow"}
"""Keys of ``kvcomm`` that were kvcomm's own before ``kvcomm_server`` held them (named in the error)."""


def _name(value: Any, where: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_LENGTH):
        raise KvcommParamsError(f"{where} must be a non-empty string of at most {MAX_NAME_LENGTH} characters, "
                                f"got {shown(value)}")
    return value


def _server(value: Any, calibrate: bool) -> dict:
    """``kv_transfer_params.kvcomm_server`` as ``KvcommParams`` fields (all but handle: ``handle`` too)."""
    where = f"kv_transfer_params.{SERVER_KEY}"
    if not isinstance(value, dict):
        raise KvcommParamsError(f"{where} must be a JSON object, got {type(value).__name__}")
    unknown = set(value) - _SERVER_KEYS
    if unknown:
        raise KvcommParamsError(f"{where} has unknown keys {shown(sorted(unknown))}; allowed: {sorted(_SERVER_KEYS)}")
    handle = _name(value.get("handle"), f"{where}.handle")
    ticket = _name(value.get("ticket"), f"{where}.ticket")
    purpose = value.get("purpose", "client")
    if purpose not in PURPOSES:
        raise KvcommParamsError(f"{where}.purpose must be one of {list(PURPOSES)}, got {shown(purpose)}")
    if handle is not None and (calibrate or ticket is not None or purpose != "client"):
        raise KvcommParamsError(f"{where}.handle: the caller plans; no calibrate (calibrate there with "
                                "kvcomm.run_agent(..., calibrate=True)), ticket or purpose with it")
    if ticket is not None and calibrate:
        raise KvcommParamsError(f"{where}.ticket names a plan made ahead; a calibrating request has none")
    needs = {"preamble": ticket is not None, "reuse_twin": ticket is not None, "dense_twin": calibrate and ticket is None}
    if purpose in needs and not needs[purpose]:
        raise KvcommParamsError(f"{where}.purpose {purpose!r} needs {'calibrate and no ticket' if purpose == 'dense_twin' else 'a ticket'}")
    retain, release = (_ids(value.get(key, []), f"{where}.{key}") for key in ("retain", "release"))
    return {"handle": handle, "retain": retain, "release": release, "ticket": ticket, "purpose": purpose}


def _ids(ids: Any, where: str) -> tuple[str, ...]:
    """A list of content ids (``kvcomm_server.retain`` / ``release``)."""
    if not isinstance(ids, list) or len(ids) > MAX_SEGMENTS or not all(
            isinstance(i, str) and 0 < len(i) <= MAX_NAME_LENGTH for i in ids):
        raise KvcommParamsError(f"{where} must be a list of at most {MAX_SEGMENTS} content ids, got {shown(ids)}")
    return tuple(ids)
