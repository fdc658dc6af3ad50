"""The per-request options of the kvcomm vLLM plugin: ``kv_transfer_params["kvcomm"]``.

Schema (JSON object; every key optional, unknown keys rejected)::

    {"kvcomm": {
        "handle":   "<str>",                 # in-process callers (VllmExecutor) only: the
                                             # channel order carrying KV to inject / capture
        "template": "<str>",                 # agent template id (default: "default")
        "tenant":   "<str>",                 # tenant key (default: "default"); `kvcomm serve`
                                             # with API keys overwrites it with the key's tenant
        "contexts": {"retain": ["<content id>"], "release": ["<content id>"]},
                                             # set by `kvcomm serve`'s context API only (it
                                             # refuses it from clients): pin / unpin and drop
                                             # the base KV of retained contexts (serve.contexts)
        "ticket":   "<str>",                 # set by `kvcomm serve` only (it refuses it from
                                             # clients): the request was planned ahead under this
                                             # ticket (``ServerPlanner.plan_ahead``) and uses that plan
        "computes_head": false,              # with "ticket", set by `kvcomm serve` only: this request
                                             # computes the planned request's head (its prompt is that
                                             # request's first ``head_end`` tokens)
        "shadow": false,                     # set by `kvcomm serve` only: one of the quality guard's
                                             # twins of a sampled request, counted in no metric; with
                                             # "ticket" the reuse twin (served the plan again, learns
                                             # nothing), with "calibrate" the dense twin (learns)
        "calibrate": false,                  # true: reuse nothing, prefill densely and learn
                                             # everything (each shared segment whose content
                                             # has a base becomes an anchor of its slot, up to
                                             # V): calibration traffic that fills the pools
                                             # (server-side planning only, not with "handle")
        "segments": [                        # shared segments, sorted, non-overlapping;
                                             # absent: detected automatically (vllm.detect)
            {"start": 12, "end": 40,         # prompt token span [start, end), end <= prompt length
             "slot": "task",                 # slot name (anchor pool); a known slot when the
                                             # server was started with a slot list
             "id": "<str>"}                  # optional shared content id (default: token hash)
        ]
    }}

Sizes are bounded (``check_sizes``): ``template``, ``tenant``, ``handle`` and every ``id`` at most
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

SLOT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
"""A well-formed slot name (an annotation's ``slot``, a name in the connector's ``slots``)."""
_KEYS = {"handle", "template", "tenant", "segments", "calibrate", "contexts", "ticket", "computes_head", "shadow"}
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
    for key, bound in (("template", MAX_NAME_LENGTH), ("handle", MAX_NAME_LENGTH), ("tenant", MAX_TENANT_LENGTH),
                       ("ticket", MAX_NAME_LENGTH)):
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
    computes_head: bool = False
    """With ``ticket``: this request computes that plan's head, its prompt the head's end's prefix."""
    shadow: bool = False
    """One of the quality guard's twins of a sampled request (``vllm.planning.guard``), counted in no
    metric: with ``ticket`` the reuse twin (served the same plan, it learns nothing), with
    ``calibrate`` the dense twin (it learns, as calibration traffic does)."""


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
        raise KvcommParamsError(f"kv_transfer_params.kvcomm has unknown keys {shown(sorted(unknown))}; allowed: {sorted(_KEYS)}")
    check_sizes(body)
    handle = body.get("handle")
    if handle is not None and (not isinstance(handle, str) or not handle):
        raise KvcommParamsError(f"kv_transfer_params.kvcomm.handle must be a non-empty string, got {shown(handle)}")
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
    if calibrate and handle is not None:
        raise KvcommParamsError("kv_transfer_params.kvcomm.calibrate applies to server-side planning; with a handle the "
                                "caller plans (calibrate there with kvcomm.run_agent(..., calibrate=True))")
    retain, release = _contexts(body.get("contexts", {}))
    ticket, computes_head = body.get("ticket"), body.get("computes_head", False)
    if ticket is not None and (not isinstance(ticket, str) or not ticket or handle is not None or calibrate):
        raise KvcommParamsError(f"kv_transfer_params.kvcomm.ticket must be a non-empty string, without handle or "
                                f"calibrate, got {shown(ticket)}")
    if not isinstance(computes_head, bool) or (computes_head and ticket is None):
        raise KvcommParamsError(f"kv_transfer_params.kvcomm.computes_head must be true or false, and true only with "
                                f"a ticket, got {shown(computes_head)}")
    shadow = body.get("shadow", False)
    if not isinstance(shadow, bool) or (shadow and ((ticket is None and not calibrate) or computes_head)):
        raise KvcommParamsError(f"kv_transfer_params.kvcomm.shadow must be true or false, and true only with a ticket "
                                f"or calibrate and without computes_head, got {shown(shadow)}")
    ahead = {"ticket": ticket, "computes_head": computes_head, "shadow": shadow}
    if "segments" not in body:
        return KvcommParams(handle, template, None, tenant, calibrate, retain, release, **ahead)
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
    return KvcommParams(handle, template, tuple(segments), tenant, calibrate, retain, release, **ahead)


def _contexts(value: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``kvcomm.contexts``: (content ids to retain, content ids to release)."""
    where = "kv_transfer_params.kvcomm.contexts"
    if not isinstance(value, dict) or set(value) - {"retain", "release"}:
        raise KvcommParamsError(f"{where} must be an object with lists 'retain' and/or 'release', got {shown(value)}")
    lists = []
    for key in ("retain", "release"):
        ids = value.get(key, [])
        if not isinstance(ids, list) or len(ids) > MAX_SEGMENTS or not all(
                isinstance(i, str) and 0 < len(i) <= MAX_NAME_LENGTH for i in ids):
            raise KvcommParamsError(f"{where}.{key} must be a list of at most {MAX_SEGMENTS} content ids, got {shown(ids)}")
        lists.append(tuple(ids))
    return lists[0], lists[1]
