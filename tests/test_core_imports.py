"""The core (``kvcomm.*`` and ``kvcomm.anchors.*``, i.e. every module except those under
``kvcomm.integrations``, ``kvcomm.eval`` and ``kvcomm.cli``) imports no model framework: transformers, vLLM
and AutoGen / AG2 are the integrations' business. Checked in a fresh interpreter, where
nothing else has imported them yet."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

FORBIDDEN = ("transformers", "vllm", "autogen", "autogen_core", "autogen_agentchat", "autogen_ext", "sentence_transformers")
"""Top-level packages the core must not import (``autogen`` is AG2's import name)."""
NOT_CORE = ("kvcomm.integrations", "kvcomm.eval", "kvcomm.cli")
CORE_ROOTS = ("kvcomm", "kvcomm.anchors")
"""Installed from separate folders (``kvcomm/``, ``anchors/``), so each is walked on its own."""

_PROBE = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    not_core, forbidden, roots = (json.loads(a) for a in sys.argv[1:4])
    def walk(name):  # like pkgutil.walk_packages, without importing the packages left out
        yield name
        for info in pkgutil.iter_modules(importlib.import_module(name).__path__, name + "."):
            if info.name in not_core:
                continue
            if info.ispkg:
                yield from walk(info.name)
            else:
                yield info.name
    names = sorted({m for root in roots for m in walk(root)})
    culprits = {}
    for name in names:
        before = set(sys.modules)
        importlib.import_module(name)
        new = {m.split(".")[0] for m in set(sys.modules) - before}
        hit = sorted(new & set(forbidden))
        if hit:
            culprits[name] = hit
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(forbidden))
    print(json.dumps({"modules": names, "culprits": culprits, "loaded": loaded}))
""")


def _probe() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(NOT_CORE), json.dumps(FORBIDDEN), json.dumps(CORE_ROOTS)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"importing the core failed:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_core_imports_no_model_framework():
    found = _probe()
    modules = found["modules"]
    # The walk really saw the core (both source folders), and nothing outside it.
    assert {"kvcomm.reuse.engine", "kvcomm.core.rope", "kvcomm.reuse.runner", "kvcomm.anchors", "kvcomm.anchors.pool"} <= set(modules)
    assert len(modules) >= 20 and not any(m.startswith(NOT_CORE) for m in modules)
    assert not found["loaded"], (
        f"importing the core loaded {found['loaded']}; first importer of each, per module: {found['culprits']}. "
        "Import model frameworks inside kvcomm.integrations (or lazily, inside the function that needs them).")
