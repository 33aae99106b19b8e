"""argparse as every ``pkgd`` command uses it: defaults in the help, no abbreviations, and an
unknown option answered with a did-you-mean and the usage of the command it was given to.

`ArgumentParser` is the class of the top-level parser, so every subparser (``pkgd serve``,
``pkgd bench throughput``) is one too (argparse makes subparsers of their parent's class).

Unknown options: argparse collects what no parser of the chain recognised and reports it
from the *top* parser, with ``pkgd``'s usage. `ArgumentParser.parse_command_line` instead
reports it from the innermost parser that ran, with candidates from that parser's own options
and from the schema's vLLM flags (`pkgd.config.schema.alias_index`), so a new config flag needs
no change here: ``pkgd serve --max-modle-len 8192`` says ``unknown option --max-modle-len;
did you mean --max-model-len?`` under ``usage: pkgd serve …``.
"""

from __future__ import annotations

import argparse
import contextvars
import textwrap
from collections.abc import Sequence
from typing import Any

from pkgd.config.errors import closest

# The parsers a parse_command_line call ran, outermost first (argparse calls each subparser's
# parse_known_args in turn).
_RAN: contextvars.ContextVar[list[argparse.ArgumentParser] | None] = contextvars.ContextVar(
    "pkgd_parsers_ran", default=None
)

_SWITCHES = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._CountAction,
    argparse.BooleanOptionalAction,
)


class HelpFormatter(argparse.HelpFormatter):
    """A description or epilog of several lines is kept as written (examples, tables); one of
    a single line is wrapped to the terminal. ``(default: X)`` follows each argument whose
    default says something: not None, not empty, not a switch's, not already in its help."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)  # keep --flag-names whole

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default in (None, argparse.SUPPRESS)
            or isinstance(action, _SWITCHES)
            or default == []
            or "default" in text.lower()
        ):
            return text
        shown = " ".join(str(v) for v in default) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with ``allow_abbrev=False`` (``--input`` is no
    ``--input-len``: an abbreviation would also shadow config flags taken out before argparse)
    and `HelpFormatter`; see the module docstring for unknown options."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    # typeshed overloads the result on the namespace's type; this forwards both cases unchanged
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> Any:
        ran = _RAN.get()
        if ran is not None:
            ran.append(self)
        return super().parse_known_args(args, namespace)

    def parse_command_line(self, args: Sequence[str]) -> argparse.Namespace:
        """`parse_args`, with unknown arguments reported by the innermost parser that ran
        (exits 2 with its usage, as argparse does)."""
        ran: list[argparse.ArgumentParser] = []
        token = _RAN.set(ran)
        try:
            namespace, extras = self.parse_known_args(list(args))
        finally:
            _RAN.reset(token)
        if extras:
            blamed = ran[-1] if ran else self
            blamed.error(unknown_arguments_message(extras, blamed))
        return namespace


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of ``parser``'s own arguments."""
    return [s for action in parser._actions for s in action.option_strings]  # argparse has no public walk


def unknown_arguments_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The error message for the arguments no parser took, one line per problem: each unknown
    option with the closest known one (the parser's options and every config flag), then
    any stray words."""
    from pkgd.config.schema import alias_index

    candidates = [*option_strings(parser), *alias_index()]
    parts: list[str] = []
    stray: list[str] = []
    after_option = False
    for token in extras:
        if token.startswith("-") and token != "-":
            name = token.partition("=")[0]
            match = closest(name, candidates)
            parts.append(f"unknown option {name}" + (f"; did you mean {match}?" if match else ""))
            after_option = "=" not in token
        elif after_option:
            after_option = False  # most likely the unknown option's value
        else:
            stray.append(token)
    if stray:
        parts.append(f"unexpected argument{'s' if len(stray) > 1 else ''}: {' '.join(stray)}")
    return "\n  ".join(parts)
