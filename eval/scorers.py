"""Scorers for workload replies: ``scorer(reply, reference) -> float`` in ``[0, 1]``.

Every scorer takes the final (decider) reply as generated text and the gold reference of its
input row; none raises on an odd reply (no answer found scores 0.0).

- :func:`choice_letter` -- multiple choice (MMLU): the answer letter, extracted robustly.
- :func:`number` -- numeric answers (GSM8K-style): the number after the last ``Answer:``,
  else the last number in the reply; commas, ``$`` and trailing periods are tolerated.
- :func:`contains` -- the reference string (or any of several) occurs in the reply.
- :func:`exact` -- the reply (or the text after its last ``Answer:``) equals the reference.
- :func:`humaneval_pass` -- the code in the reply passes the HumanEval problem's tests, run in a
  separate Python process with a timeout.

``SCORERS`` maps the names a workload file may use (``"exact"``, ``"contains"``, ``"choice"``,
``"number"``) to these functions.
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Mapping

__all__ = ["extract_choice", "choice_letter", "extract_number", "number", "contains", "exact",
           "extract_code", "humaneval_program", "humaneval_pass", "SCORERS", "get_scorer"]

CHOICE_LETTERS = "ABCD"

# "Answer: B", "The answer is (B)", "**Final answer:** B", "option C", "choice [D]", "I choose D".
_ANSWER_LETTER = re.compile(
    r"(?i:answer|option|choice|choose|pick)\s*(?i:is)?\s*[:：=-]?\s*[*_]*\s*[(\[]?\s*([A-D])\s*[)\]]?(?![\w'])")
# "answer: b" -- a lower-case letter only right after "answer:".
_ANSWER_LOWER = re.compile(r"(?i:answer)\s*[:：]\s*[*_]*\s*[(\[]?\s*([a-d])\s*[)\]]?(?![\w'])")
# "(B)" or "[B]" anywhere.
_PAREN_LETTER = re.compile(r"[(\[]([A-D])[)\]]")
# "B", "B.", "B)", "B:", "B -", "**B**" at the very start (a bare "A " is the article, not a choice).
_LEADING_LETTER = re.compile(r"^\s*[*_]*\s*[(\[]?([A-D])(?:\s*$|[.):\]]|[*_]+|\s+[-–—])")

# "B." / "(B)" / "B)" at the start of a line: several distinct ones mean the choices are listed.
_LISTED_LETTER = re.compile(r"^\s*[(\[]?([A-D])[.):\]]", re.M)

_ANSWER_MARK = re.compile(r"(?i)answer\s*(?:is\b|[:：=])")
_NUMBER = re.compile(r"(?<![\w.])([-−–]?)\s?\$?\s?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\d)")


def extract_choice(reply: str, letters: str = CHOICE_LETTERS) -> str | None:
    """The choice letter a reply commits to, or None.

    In order of trust: the last ``answer/option/choice`` marker followed by a letter ("Answer: B",
    "the answer is (C)", "**Answer:** d"); a single distinct parenthesised letter ("(B)"); a
    letter at the very start ("B.", "B)", "B" alone).  Without an answer marker, a reply that
    lists the choices (several distinct parenthesised letters, or several lines starting "A.",
    "B." ...) counts as no answer.  ``letters`` limits the valid letters.
    """
    if not isinstance(reply, str):
        return None
    valid = set(letters.upper())
    for pattern in (_ANSWER_LETTER, _ANSWER_LOWER):
        found = [m.group(1).upper() for m in pattern.finditer(reply) if m.group(1).upper() in valid]
        if found:
            return found[-1]
    distinct = {m.group(1) for m in _PAREN_LETTER.finditer(reply)} & valid
    listed = {m.group(1) for m in _LISTED_LETTER.finditer(reply)} & valid
    if len(distinct) > 1 or len(listed) > 1:  # the reply lists the choices
        return None
    if len(distinct) == 1:
        return distinct.pop()
    m = _LEADING_LETTER.match(reply)
    if m and m.group(1) in valid:
        return m.group(1)
    return None


def choice_letter(reply: str, ref: object) -> float:
    """1.0 if the letter extracted from ``reply`` (see :func:`extract_choice`) is ``ref``.

    ``ref`` is a letter ("B", case-insensitive) or a 0-based choice index.
    """
    if isinstance(ref, int) and not isinstance(ref, bool):
        ref = CHOICE_LETTERS[ref] if 0 <= ref < len(CHOICE_LETTERS) else None
    if not isinstance(ref, str) or not ref.strip():
        return 0.0
    got = extract_choice(reply)
    return float(got is not None and got == ref.strip().upper())


def _to_float(sign: str, digits: str, frac: str | None) -> float:
    value = float(digits.replace(",", "") + (frac or ""))
    return -value if sign else value


def extract_number(reply: str) -> float | None:
    """The answer number of a reply, or None.

    The first number after the last ``Answer:``/``answer is`` marker if there is one, else the
    last number in the reply.  ``1,234``, ``$5``, ``-3``, ``2.50`` and ``42.`` are read as numbers;
    a comma only groups thousands (``3, 4`` are two numbers).
    """
    if not isinstance(reply, str):
        return None
    marks = list(_ANSWER_MARK.finditer(reply))
    if marks:
        m = _NUMBER.search(reply, marks[-1].end())
        if m:
            return _to_float(*m.groups())
    found = list(_NUMBER.finditer(reply))
    return _to_float(*found[-1].groups()) if found else None


def reference_number(ref: object) -> float | None:
    if isinstance(ref, bool):
        return None
    if isinstance(ref, (int, float)):
        return float(ref)
    if isinstance(ref, str):
        try:
            return float(ref.strip().replace(",", "").replace("$", ""))
        except ValueError:
            return extract_number(ref)
    return None


def number(reply: str, ref: object) -> float:
    """1.0 if the number in ``reply`` (see :func:`extract_number`) equals ``ref``.

    ``ref`` is an int, float or numeric string ("1,234", "$5", "9281.25"); equality tolerates a
    relative error of 1e-6.
    """
    want, got = reference_number(ref), extract_number(reply)
    if want is None or got is None or not math.isfinite(want):
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def _normalize(text: str) -> str:
    return " ".join(text.casefold().split())


def _references(ref: object) -> list[str]:
    if isinstance(ref, (list, tuple)):
        return [str(r) for r in ref if r is not None and str(r).strip()]
    return [str(ref)] if ref is not None and str(ref).strip() else []


def contains(reply: str, ref: object) -> float:
    """1.0 if ``ref`` occurs in ``reply`` (case- and whitespace-insensitive).

    ``ref`` may be a list/tuple of acceptable strings (any one suffices); a number is compared
    as its string.  An empty reference never matches.
    """
    if not isinstance(reply, str):
        return 0.0
    text = _normalize(reply)
    return float(any(_normalize(r) in text for r in _references(ref)))


def _strip_answer(text: str) -> str:
    text = text.strip().strip("*_`").strip()
    while text and text[-1] in ".!;,":
        text = text[:-1].rstrip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"`":
        text = text[1:-1].strip()
    return _normalize(text)


def exact(reply: str, ref: object) -> float:
    """1.0 if ``reply`` equals ``ref`` after normalisation.

    Both sides are case-folded, whitespace-collapsed, stripped of a trailing period and of
    surrounding quotes or markdown emphasis.  The whole reply counts, and so does the rest of the
    line after its last ``Answer:`` marker.  ``ref`` may be a list/tuple of acceptable answers.
    """
    if not isinstance(reply, str):
        return 0.0
    candidates = {_strip_answer(reply)}
    marks = list(re.finditer(r"(?i)answer\s*[:：]", reply))
    if marks:
        rest = reply[marks[-1].end():].strip().splitlines()
        if rest:
            candidates.add(_strip_answer(rest[0]))
    wanted = {_strip_answer(r) for r in _references(ref)}
    return float(bool(candidates & wanted))


# --------------------------------------------------------------------------- HumanEval

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)

# Run before the candidate code in the child process: caps memory and CPU time and disables
# the most destructive os/shutil/subprocess calls (after HumanEval's reliability_guard). This is
# a safety net against accidents, not a sandbox.
_GUARD = r'''
import builtins as _b, os as _os, shutil as _sh, subprocess as _sp
try:
    import resource as _r
    _r.setrlimit(_r.RLIMIT_AS, (2 << 30, 2 << 30))
    _r.setrlimit(_r.RLIMIT_DATA, (2 << 30, 2 << 30))
except Exception:
    pass
for _name in ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork",
              "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod",
              "fchown", "chmod", "chown", "chroot", "lchown", "chdir"):
    if hasattr(_os, _name):
        setattr(_os, _name, None)
_sh.rmtree = _sh.move = _sh.chown = None
_sp.Popen = None
del _b, _os, _sh, _sp, _name
'''


def extract_code(reply: str) -> str:
    """The Python code in a reply.

    The fenced code blocks (```` ```python ```` or bare ```` ``` ````, an unclosed last fence
    included) -- the one that defines a function if any, else the first -- or, without fences,
    the reply itself.
    """
    if not isinstance(reply, str):
        return ""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
    blocks = [b for lang, b in blocks if lang in ("", "python", "py", "python3")] or [b for _, b in blocks]
    if not blocks:
        return reply
    for body in blocks:
        if re.search(r"^\s*def \w+\s*\(", body, re.M):
            return body
    return blocks[0]


def humaneval_program(reply: str, problem: Mapping[str, object]) -> str:
    """The test program for ``reply`` on ``problem``: code, the problem's tests, ``check(entry_point)``.

    If the extracted code defines ``entry_point`` it is appended after the problem's prompt (so
    the prompt's imports and helper functions stay defined and the new definition wins);
    otherwise it is taken as the function body and appended to the prompt (indented by four
    spaces if it is not indented at all).
    """
    prompt, test, entry = str(problem["prompt"]), str(problem["test"]), str(problem["entry_point"])
    code = extract_code(reply)
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        program = prompt.rstrip() + "\n\n\n" + textwrap.dedent(code)
    else:
        body = code.strip("\n")
        lines = [ln for ln in body.splitlines() if ln.strip()]
        if lines and not lines[0][:1].isspace():
            body = textwrap.indent(body, "    ")
        program = prompt + body
    return f"{program}\n\n\n{test}\n\ncheck({entry})\n"


def humaneval_pass(reply: str, problem: Mapping[str, object], timeout: float = 5.0) -> float:
    """1.0 if the code in ``reply`` passes ``problem``'s tests, else 0.0.

    The program from :func:`humaneval_program` runs in a fresh ``python -I`` process, in a
    temporary directory that is removed afterwards, with stdin closed and a wall-clock
    ``timeout`` (seconds); on timeout the whole process group is killed and the score is 0.0.
    """
    if not isinstance(reply, str) or not reply.strip():
        return 0.0
    source = _GUARD + "\n" + humaneval_program(reply, problem)
    with tempfile.TemporaryDirectory(prefix="kvcomm-humaneval-") as tmp:
        path = os.path.join(tmp, "candidate.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(source)
        kwargs: dict = {"start_new_session": True} if os.name == "posix" else {}
        proc = subprocess.Popen([sys.executable, "-I", path], cwd=tmp, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)
        try:
            return float(proc.wait(timeout=timeout) == 0)
        except subprocess.TimeoutExpired:
            return 0.0
        finally:
            if proc.poll() is None:
                try:
                    if os.name == "posix":
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()


SCORERS: Mapping[str, Callable[[str, object], float]] = {
    "exact": exact, "contains": contains, "choice": choice_letter, "number": number}


def get_scorer(name: str) -> Callable[[str, object], float]:
    """The scorer called ``name`` (one of :data:`SCORERS`); ValueError naming the choices otherwise."""
    try:
        return SCORERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown scorer {name!r}; choose one of {', '.join(SCORERS)}") from None
