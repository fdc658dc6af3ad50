"""The local deployment's bad input (``serve.replicas``): refused with what to fix, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcomm.integrations.serve.replicas import POLICIES, Replicas, router_binary


@pytest.mark.parametrize("options, message", [
    ({"count": 0}, "count must be >= 1"),
    ({"policy": "prefix"}, "policy must be one of"),
    ({"health_interval_s": 0}, "health_interval_s must be >= 1"),
])
def test_bad_options_are_refused(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        Replicas(tmp_path, **options)
    assert not list(tmp_path.glob("*.log"))


def test_the_command_refuses_bad_flags_and_starts_nothing(tmp_path):
    for flags, message in ((["--replicas", "0"], "--replicas must be >= 1"), (["--policy", "prefix"], "invalid choice")):
        done = subprocess.run([sys.executable, "-m", "kvcomm.integrations.serve.replicas", *flags, "--logs", str(tmp_path / "logs")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "logs").exists()


def test_the_router_is_the_installed_extra_and_knows_the_policies():
    """vllm-router (the ``replicas`` extra) is installed and offers every policy the deployment accepts."""
    help_text = subprocess.run([router_binary(), "--help"], capture_output=True, text=True, timeout=60).stdout
    for policy in POLICIES:
        assert policy in help_text
    for flag in ("--health-check-interval-secs", "--health-failure-threshold", "--worker-urls", "--prometheus-port"):
        assert flag in help_text
