"""The docs stay short and their links resolve.

README.md is at most 150 lines and ``kvcomm eval --help`` at most 50 (at 80 columns: issue 38's
"docs a user reads"); every relative link in README.md and docs/ (measurement pages included)
names a file that exists. Links to other sites, mail addresses and in-page anchors (``#...``)
are not checked; a link's own ``#anchor`` is dropped before the file is looked up.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
EVAL_HELP_MAX_LINES = 50

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(path: Path) -> list[str]:
    """Targets of the inline markdown links of ``path`` outside code, without their #anchor."""
    text = _CODE.sub("", path.read_text(encoding="utf-8"))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # another site, mailto:, or an anchor in this page
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_is_at_most_150_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_eval_help_is_at_most_50_lines(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal width
    from kvcomm.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert lines and lines[0].startswith("usage: kvcomm eval")
    assert len(lines) <= EVAL_HELP_MAX_LINES, (
        f"`kvcomm eval --help` prints {len(lines)} lines; shorten eval/cli_eval.py's help, explain in docs/evaluation.md")


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(path):
    missing = [t for t in relative_links(path) if t and not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_the_link_check_sees_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[here](gone.md#x), [web](https://example.org), [anchor](#a), `[code](nope.md)`\n")
    assert relative_links(page) == ["gone.md"]
