"""The skip policy (``support/skip_policy.py``) on a throwaway test folder, run by a real pytest
in a subprocess: skips stay skips on a developer machine and are failures in CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT_PARENT = Path(__file__).resolve().parent

CASES = '''
import pytest

@pytest.fixture
def needs_missing():
    pytest.importorskip("kvcomm_no_such_package")

def test_passes():
    assert True

def test_skips_in_its_body():
    pytest.skip("no GPU here")

def test_skips_in_a_fixture(needs_missing):
    pass

@pytest.mark.xfail(reason="known bug")
def test_expected_failure():
    assert False

@pytest.mark.skipif(True, reason="marked")
def test_skipif():
    pass
'''
SKIPPED_MODULE = 'import pytest\npytest.importorskip("kvcomm_no_such_package")\n\ndef test_never_collected():\n    pass\n'


def _run(folder: Path, **env: str) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "KVCOMM_NO_SKIPS")}
    clean["PYTHONPATH"] = os.pathsep.join([str(SUPPORT_PARENT), clean.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "support.skip_policy", "-p", "no:cacheprovider", "-q", "-rA",
         "-c", str(folder / "pytest.ini"), "--rootdir", str(folder), str(folder)],
        capture_output=True, text=True, timeout=120, env={**clean, **env}, cwd=folder,
    )
    return result.returncode, result.stdout + result.stderr


def _counts(output: str) -> dict[str, int]:
    summary = output.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|xfailed|errors?)", summary)}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_skipped_module.py").write_text(SKIPPED_MODULE)
    return tmp_path


def test_skips_stay_skips_without_the_flags(folder):
    code, output = _run(folder)
    assert code == 0, output
    assert _counts(output) == {"passed": 1, "skipped": 4, "xfailed": 1}, output


FLAGS = [{"CI": "true"}, {"CI": "1"}, {"KVCOMM_NO_SKIPS": "1"}]


@pytest.mark.parametrize("env", FLAGS, ids=["CI=true", "CI=1", "KVCOMM_NO_SKIPS=1"])
def test_every_skip_is_a_failure_in_ci(folder, env):
    (folder / "test_skipped_module.py").unlink()
    code, output = _run(folder, **env)
    assert code == 1, output
    assert _counts(output) == {"passed": 1, "failed": 2, "errors": 2}, output  # setup-time skips: errors
    for reason in ("no GPU here", "kvcomm_no_such_package", "marked", "known bug"):
        assert reason in output, (reason, output)
    assert output.count("skips are failures here") >= 4


@pytest.mark.parametrize("env", FLAGS[:1] + FLAGS[2:], ids=["CI=true", "KVCOMM_NO_SKIPS=1"])
def test_a_skipped_module_is_a_collection_error_in_ci(folder, env):
    (folder / "test_cases.py").unlink()
    code, output = _run(folder, **env)
    assert code == 2 and _counts(output) == {"error": 1}, output  # pytest stops at a collection error
    assert "test_skipped_module.py was skipped, and skips are failures here" in output
    assert "kvcomm_no_such_package" in output


def test_ci_false_keeps_skips(folder):
    code, output = _run(folder, CI="false")
    assert code == 0 and "skipped" in _counts(output), output
