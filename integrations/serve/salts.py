"""vLLM ``cache_salt`` values the server gives requests: its prefix cache is partitioned by them,
so approximate KV (a tenant's opted-in requests) never serves a plain request, and no client can
name a partition that is not its own."""

from __future__ import annotations

import hashlib


def salt_of(tenant: str, reuse: bool) -> str:
    """vLLM ``cache_salt`` for a tenant's requests (``reuse``: requests that opted into kvcomm)."""
    digest = hashlib.sha256(b"kvcomm-salt\0" + tenant.encode("utf-8")).hexdigest()[:32]
    return f"kvcomm-{digest}" + ("-reuse" if reuse else "")


def client_salt(salt: str) -> str:
    """A plain request's own ``cache_salt`` as vLLM gets it: the same client salt maps to the same
    value (clients keep their own cache partitions), and never to a ``salt_of`` value."""
    return "client-" + hashlib.sha256(b"kvcomm-client-salt\0" + salt.encode("utf-8")).hexdigest()[:32]
