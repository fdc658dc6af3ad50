"""The docs stay short, their links resolve and their Python snippets run.

README.md is at most 150 lines and ``kvcomm eval --help`` at most 50 (at 80 columns: issue 38's
"docs a user reads"); every relative link in README.md and docs/ (measurement pages included)
names a file that exists. Links to other sites, mail addresses and in-page anchors (``#...``)
are not checked; a link's own ``#anchor`` is dropped before the file is looked up.

docs/architecture.md's file table names every source file of the package (``kvcomm/``,
``anchors/``, ``integrations/``, ``eval/``; ``__init__.py`` aside): a row's first cell names its
folders, its second the files in them, by name or by a path from the folder or its parent.

Every ```` ```python ```` block of README.md and docs/ runs as written, in a fresh Python
process on the embedded model, in an empty folder holding only ``pipeline.json`` (the file the
README's example reads: the bundled ``chain`` pipeline cut to one row and 8-token replies),
unless the line before it says why it cannot: ``<!-- docs-test: skip: REASON -->`` (a server it
needs, a GPU, a fragment). Such a snippet is only compiled (valid Python), its reason is in
the page beside it, and a marker without a reason fails: none is left out silently (and no
test is skipped, which CI counts as a failure: ``support/skip_policy.py``).

One word per idea (architecture.md's glossary): the names retired when the computed head became
the *preamble* (issue 51; "head" now means only a KV head) appear in no Python file of the
repository and in no current doc (``docs/*.md`` but the dated ``decisions.md``; measurement pages
keep their words): ``RETIRED_NAMES``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
EVAL_HELP_MAX_LINES = 50

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_SNIPPET = re.compile(r"(?:^<!-- docs-test: skip:?(?P<reason>[^\n]*?)-->\n)?^```python\n(?P<code>.*?)^```", re.S | re.M)
SNIPPET_TIMEOUT_S = 900


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


def python_snippets() -> list[tuple[str, str, str | None]]:
    """(id "file:line", code, skip reason or None) for every ```python block of README.md and docs/."""
    out = []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        for found in _SNIPPET.finditer(text):
            line = text.count("\n", 0, found.start("code"))
            # a marker without a reason gives "": a failure below
            reason = found.group("reason").strip() if found.group(0).startswith("<!--") else None
            out.append((f"{path.relative_to(ROOT)}:{line}", found.group("code"), reason))
    return out


def _snippet_folder(tmp_path: Path) -> Path:
    spec = json.loads(resources.files("kvcomm").joinpath("data", "demo_pipeline.json").read_text(encoding="utf-8"))
    spec["inputs"] = spec["inputs"][:1]
    spec.pop("max_new_tokens", None)
    spec["max_tokens"] = 8
    (tmp_path / "pipeline.json").write_text(json.dumps(spec), encoding="utf-8")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("where, code, reason", python_snippets(), ids=[s[0] for s in python_snippets()])
def test_python_snippets_in_the_docs_run(where, code, reason, tmp_path):
    if reason is not None:  # cannot run here: it must say why, and still be valid Python
        assert reason, f"{where}: a docs-test skip marker must say why the snippet cannot run here"
        compile(code, where, "exec")
        return
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, "-c", code], cwd=_snippet_folder(tmp_path), env=env, capture_output=True,
                          text=True, timeout=SNIPPET_TIMEOUT_S)
    assert done.returncode == 0, f"{where} failed:\n{done.stderr[-3000:]}"


def test_every_snippet_runs_or_says_why_not():
    """The snippets are found (the README's is one) and each skip names its reason."""
    snippets = python_snippets()
    assert any(where.startswith("README.md:") and reason is None for where, _, reason in snippets)
    assert len(snippets) >= 6
    assert all(reason is None or reason for _, _, reason in snippets), [w for w, _, r in snippets if r == ""]


def test_the_snippet_finder_sees_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(1)\n```\n\n<!-- docs-test: skip: needs a GPU -->\n```python\nx\n```\n"
                    "<!-- docs-test: skip -->\n```python\ny\n```\n```bash\nls\n```\n")
    text = page.read_text()
    found = [(m.group("code"), m.group("reason").strip() if m.group(0).startswith("<!--") else None)
             for m in _SNIPPET.finditer(text)]
    assert found == [("print(1)\n", None), ("x\n", "needs a GPU"), ("y\n", "")]


PACKAGE_FOLDERS = ("kvcomm", "anchors", "integrations", "eval")
"""The source folders of the package (``pyproject.toml``'s ``package-dir``)."""


def file_table_names(text: str) -> set[str]:
    """Repository paths the folder/file table of ``text`` names: for a row ``| `a/b/`, `c/` | ...
    `x.py` ... `d/y.py` ... |``, each backticked name joined to each folder of the row (``c/``
    is a sibling of ``a/b/``) and to that folder's parent."""
    named = set()
    for line in text.splitlines():
        cells = line.split("|")
        if not line.startswith("| `") or len(cells) < 4:
            continue
        folders = re.findall(r"`([^`]+/)`", cells[1])
        if not folders:
            continue
        first = Path(folders[0])
        resolved = [first] + [Path(f) if "/" in f.rstrip("/") else first.parent / f for f in folders[1:]]
        for folder in resolved:
            for name in re.findall(r"`([^`\s]+)`", cells[2]):
                named.update({(folder / name).as_posix(), (folder.parent / name).as_posix()})
    return named


def unnamed_sources(text: str) -> list[str]:
    """Source files of the package that the file table of ``text`` does not name."""
    sources = sorted(p.relative_to(ROOT).as_posix() for top in PACKAGE_FOLDERS for p in (ROOT / top).rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts)
    assert len(sources) > 100, "the scan found too few source files"
    named = file_table_names(text)
    return [path for path in sources if path not in named]


def test_the_architecture_file_table_names_every_source_file():
    missing = unnamed_sources((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert not missing, "docs/architecture.md's file table does not name: " + ", ".join(missing)


@pytest.mark.parametrize("name, path", [
    ("`segment_ids.py` (client segment ids bound to their content), ", "integrations/vllm/planning/segment_ids.py"),
    ("`strategies/context.py`, ", "kvcomm/reuse/strategies/context.py"),
    ("`local/summary.py`", "integrations/local/summary.py"),
])
def test_the_file_table_check_sees_a_missing_file(name, path):
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert name in text
    assert unnamed_sources(text.replace(name, "")) == [path]


RETIRED_NAMES = re.compile(r"\b(computed_head|head_end|head_tokens|computes_heads|HeadRequests|HEAD_COMPUTED"
                           r"|HEAD_MIN_REUSE|_learn_head|check_head|fill_head|head_before)\b")
"""Names of the computed head, now the preamble (``ReusePlan.preamble_length``, ``preamble_end``,
``Provenance.preamble_tokens``, ``Executor.computes_preambles``, ``serve/preambles.py``...).
``computes_head`` is not among them: ``vllm.wire.params`` still names it, as a key clients once
sent, in the error that refuses it."""


def retired_names(root: Path) -> list[str]:
    """``path:line: name`` for every retired name in the Python files of ``root``'s source, test,
    benchmark and example folders (this file aside: it spells them) and in its current docs."""
    files = [p for top in PACKAGE_FOLDERS + ("tests", "benchmarks", "examples") for p in (root / top).rglob("*.py")
             if p.resolve() != Path(__file__).resolve()]
    files += [p for p in (root / "docs").glob("*.md") if p.name != "decisions.md"]
    found = []
    for path in sorted(files):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{path.relative_to(root).as_posix()}:{number}: {m.group(1)}" for m in RETIRED_NAMES.finditer(line)]
    return found


def test_no_source_or_current_doc_uses_a_retired_name():
    assert not retired_names(ROOT), "retired names (use the preamble's): " + "; ".join(retired_names(ROOT)[:20])


def test_the_retired_name_check_sees_one(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "decisions.md").write_text("history keeps `head_end`\n")
    (tmp_path / "docs" / "serving.md").write_text("a `preamble_end`, one KV `head_dim`\n")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "mod.py").write_text("x = 1\nplan.computed_head + p.head_tokens\n")
    assert retired_names(tmp_path) == ["eval/mod.py:2: computed_head", "eval/mod.py:2: head_tokens"]
