"""vLLM's own reading of the arguments `kvcomm serve` passes it (``read_vllm_args``), so kvcomm
and vLLM agree on them by construction: the API keys above all (``accepted_keys``).

vLLM's parser accepts ``--api-key K1 K2``, ``--api-key=K``, ``--api_key K`` and abbreviations
such as ``--api-ke K``; given the option twice it keeps only the last occurrence (with a
"duplicate keys" warning), so ``--api-key A --api-key B`` served B alone while kvcomm, reading
the flags itself, accepted A too. Here the keys are what vLLM's parser returns, and an option
given more than once is refused before the server starts, with the form that says what was meant.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


class VllmArgsError(ValueError):
    """Arguments vLLM would refuse or read otherwise than the user meant; the message is one line."""


def _counting(action: argparse.Action) -> list[int]:
    """Make ``action`` (an instance in our own parser) count how often it is given."""
    calls = [0]
    base = type(action)

    class Counting(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):
            calls[0] += 1
            super().__call__(parser, namespace, values, option_string)

    action.__class__ = Counting
    return calls


def read_vllm_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` (vLLM's server arguments, without the program name) as vLLM's own parser reads
    them. Raises ``VllmArgsError`` with a one-line message (not vLLM's whole usage) for an
    argument vLLM does not know, a bad value, or ``--api-key`` given more than once."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="kvcomm serve"))

    def refuse(message: str) -> None:
        raise VllmArgsError(f"{message} (kvcomm serve passes the flags it does not know to vLLM's server; "
                            "`kvcomm serve --help` lists kvcomm's, `vllm serve --help` vLLM's)")

    parser.error = refuse  # type: ignore[method-assign]
    given = _counting(next(a for a in parser._actions if a.dest == "api_key"))
    args = parser.parse_args(argv)
    if given[0] > 1:
        raise VllmArgsError(f"--api-key is given {given[0]} times and vLLM keeps only the last one; give every key "
                            "after one flag: --api-key KEY1 KEY2 ...")
    return args


def accepted_keys(args: Any, environ: dict | None = None) -> list[str]:
    """The API keys vLLM accepts for ``args`` (``read_vllm_args``), by vLLM's own rule: the
    ``--api-key`` values, else ``$VLLM_API_KEY``; empty values are no key."""
    environ = os.environ if environ is None else environ
    return [k for k in (getattr(args, "api_key", None) or [environ.get("VLLM_API_KEY")]) if k]
