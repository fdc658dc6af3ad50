"""The kvcomm connector's settings: vLLM's ``KVTransferConfig.kv_connector_extra_config``, read
once, when the connector is built on each side (``ConnectorConfig.from_vllm``), into one typed,
checked, frozen object that every part of the connector reads.

A key kvcomm does not read is refused (a misspelt setting would otherwise be ignored without a
word), and so is a value of the wrong type or out of range: the engine fails to start with a
``ValueError`` that names the key, the value and what is expected. vLLM puts nothing of its own
in a connector's extra config: its KV offloading settings (``cpu_bytes_to_use``) go there only
when vLLM replaces the connector with its own offloading connector, and under
``MultiConnector`` each child gets the extra config its own entry names.

`kvcomm serve` builds these settings from its flags (``serve.command.engine_settings``);
``transfer_config`` takes them as a dict and builds the ``KVTransferConfig`` that loads the
connector by module path (``CONNECTOR_MODULE``).
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping

from kvcomm.anchors.config import PoolConfig
from kvcomm.integrations.vllm.wire.params import SLOT_NAME, shown
from kvcomm.reuse.scopes import DEFAULT_SCOPE, SCOPES
from kvcomm.services.quality_guard import GuardConfig

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig

CONNECTOR = "KvcommConnector"
CONNECTOR_MODULE = "kvcomm.integrations.vllm.connector"

def transfer_config(engine_id: str | None = None, extra: dict[str, Any] | None = None):
    """The ``KVTransferConfig`` that loads kvcomm's connector (``kv_role="kv_both"``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR, kv_role="kv_both", kv_connector_module_path=CONNECTOR_MODULE,
        engine_id=engine_id, kv_connector_extra_config=dict(extra or {}),
    )


WORKER_SHUTDOWN_S = 60
"""With a ``state_dir``: seconds vLLM's worker process may take to exit (its own teardown, then
the planner's save at exit) before its engine core sends it SIGTERM, 4 s later SIGKILL. vLLM's
default (5 s) is short for a save of a few tenants on a busy machine."""

WORKER_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
"""vLLM's grace period for a worker process at shutdown (see ``WORKER_SHUTDOWN_S``)."""


DEFAULT_MAX_CAPTURE_BYTES = 1 << 30
"""Bytes of captured KV all opted-in requests in flight may hold together (1 GiB: 8,192 positions
of an 8B model in bf16)."""

WHERE = "kv_connector_extra_config"
"""How error messages name the settings: vLLM's name for them."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Every setting of the kvcomm connector, checked when built (``ValueError`` naming the key).

    plan: plan annotated requests in the worker (server-side planning, ``vllm.planning.worker_plans``);
        default False.
    strict: a refusal fails the engine's start instead of leaving the connector off
        (``vllm.connector.refusals``); default False.
    reuse_scope: one of ``kvcomm.reuse.scopes.SCOPES``; default ``DEFAULT_SCOPE``.
    gamma: the anchor pools' admission entropy factor, a finite number >= 0 (``PoolConfig.gamma``,
        default 1.0).
    max_anchors: anchors per pool (V), an integer >= 1 (``PoolConfig.max_anchors``, default 20).
    max_tenant_bytes: bytes of reuse state one tenant may hold, all tensor-parallel ranks
        together; a positive integer, or None (default) for no cap.
    max_total_bytes: bytes of reuse state all tenants may hold, all ranks together; a positive
        integer, or None (default): the worker sets it from the memory vLLM leaves free
        (``refusals.device_memory_budget``).
    max_capture_bytes: bytes of captured KV the opted-in requests in flight may hold together,
        a positive integer; default ``DEFAULT_MAX_CAPTURE_BYTES`` (1 GiB).
    slots: the slot names annotations may use (each a name like ``task``: letters, digits,
        ``_ . -``); None (default): any well-formed name. Given as a non-empty list.
    guard: the quality guard (``vllm.planning.guard``), given as ``{"budget": nats, "fraction": share}``;
        None (default): no guard.
    state_dir: the folder the planner's state is restored from at start and saved to
        (``vllm.planning.planner_state``); None (default): nothing kept across restarts.
    save_interval_s: seconds between saves of ``state_dir``, a positive finite number; default 60.
    """

    plan: bool = False
    strict: bool = False
    reuse_scope: str = DEFAULT_SCOPE
    gamma: float = PoolConfig.gamma
    max_anchors: int = PoolConfig.max_anchors
    max_tenant_bytes: int | None = None
    max_total_bytes: int | None = None
    max_capture_bytes: int = DEFAULT_MAX_CAPTURE_BYTES
    slots: frozenset[str] | None = None
    guard: GuardConfig | None = None
    state_dir: str | None = None
    save_interval_s: float = 60.0

    @classmethod
    def from_vllm(cls, vllm_config: "VllmConfig") -> "ConnectorConfig":
        """The settings of ``vllm_config.kv_transfer_config`` (``from_transfer``)."""
        if vllm_config.kv_transfer_config is None:
            raise ValueError("the kvcomm connector needs vLLM's kv_transfer_config; it has none")
        return cls.from_transfer(vllm_config.kv_transfer_config)

    @classmethod
    def from_transfer(cls, transfer: "KVTransferConfig") -> "ConnectorConfig":
        """The settings of ``transfer.kv_connector_extra_config`` (``from_extra``)."""
        return cls.from_extra(transfer.kv_connector_extra_config)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """The settings of an extra-config mapping (None or empty: every default); a key that
        is not a field is refused, naming the closest field when one is close."""
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            raise ValueError(f"{WHERE} must be an object of kvcomm's settings, got {shown(extra)}")
        known = [f.name for f in fields(cls)]
        unknown = [key for key in extra if key not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), known, n=1)
                hints.append(f"{shown(key)}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"{WHERE} has settings the kvcomm connector does not read: {', '.join(hints)}; "
                             f"it reads {', '.join(known)}")
        return cls(**extra)

    def __post_init__(self) -> None:
        _check_bool("plan", self.plan)
        _check_bool("strict", self.strict)
        if not isinstance(self.reuse_scope, str) or self.reuse_scope not in SCOPES:
            raise ValueError(f"{WHERE} reuse_scope: unknown reuse scope {shown(self.reuse_scope)}; "
                             f"valid: {', '.join(SCOPES)}")
        if not _number(self.gamma) or not self.gamma >= 0:
            _refuse("gamma", self.gamma, "a finite number >= 0 (the admission entropy factor)")
        object.__setattr__(self, "gamma", float(self.gamma))
        if not _integer(self.max_anchors) or self.max_anchors < 1:
            _refuse("max_anchors", self.max_anchors, "an integer >= 1 (anchors per pool)")
        for name in ("max_tenant_bytes", "max_total_bytes"):
            value = getattr(self, name)
            if value is not None and (not _integer(value) or value <= 0):
                _refuse(name, value, "a positive number of bytes (an integer), or null for the default")
        if not _integer(self.max_capture_bytes) or self.max_capture_bytes <= 0:
            _refuse("max_capture_bytes", self.max_capture_bytes, "a positive number of bytes (an integer)")
        object.__setattr__(self, "slots", _slots(self.slots))
        object.__setattr__(self, "guard", _guard(self.guard))
        if self.state_dir is not None:
            if not isinstance(self.state_dir, (str, os.PathLike)) or not os.fspath(self.state_dir):
                _refuse("state_dir", self.state_dir, "a folder path (leave it out to keep no state)")
            object.__setattr__(self, "state_dir", os.fspath(self.state_dir))
        if not _number(self.save_interval_s) or not self.save_interval_s > 0:
            _refuse("save_interval_s", self.save_interval_s, "a positive, finite number of seconds")
        object.__setattr__(self, "save_interval_s", float(self.save_interval_s))


def _refuse(name: str, value: Any, expected: str):
    raise ValueError(f"{WHERE} {name} must be {expected}, got {shown(value)}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _refuse(name, value, "true or false")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _slots(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    expected = "a non-empty list of slot names like 'task' (letters, digits, _ . -), or null for any"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)) or not value:
        _refuse("slots", value, expected)
    if not all(isinstance(name, str) and SLOT_NAME.match(name) for name in value):
        _refuse("slots", value, expected)
    return frozenset(value)


def _guard(value: Any) -> GuardConfig | None:
    if value is None or isinstance(value, GuardConfig):
        return value
    return guard_config(value)


GUARD_KEYS = ("budget", "fraction")


def guard_config(value: Any) -> GuardConfig | None:
    """The guard's settings from ``kv_connector_extra_config["guard"]`` (None: no guard); raises
    ValueError, saying what to change, for anything else than ``{"budget": B[, "fraction": F]}``
    with B >= 0 nats and F in [0, 1]."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - set(GUARD_KEYS) or "budget" not in value or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
        raise ValueError(f"kv_connector_extra_config guard must be an object {{\"budget\": nats, \"fraction\": share}} "
                         f"(fraction optional, default {GuardConfig.fraction}), got {str(value)[:200]}")
    try:
        return GuardConfig(budget=float(value["budget"]), fraction=float(value.get("fraction", GuardConfig.fraction)))
    except ValueError as error:
        raise ValueError(f"kv_connector_extra_config guard {str(value)[:200]}: {error}") from None
