"""The help of every command: defaults shown, no markup or internal wording; mistyped flags
answered with a did-you-mean under the usage of the command they were given to."""

import argparse
from pathlib import Path

import pytest

from pkgd.cli.keys import keys_markdown
from pkgd.cli.main import available_subcommands, build_parser, main
from pkgd.cli.parser import ArgumentParser, unknown_arguments_message

REPO = Path(__file__).resolve().parents[2]
COMMANDS = sorted(available_subcommands())


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:  # argparse exposes no public walk over its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def _all_parsers():
    for name in COMMANDS:
        parser, _ = build_parser(name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        yield from _parsers(sub)


SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction, argparse._VersionAction)


@pytest.mark.parametrize("parser", list(_all_parsers()), ids=lambda p: p.prog)
def test_help_shows_defaults_without_markup(parser):
    text = parser.format_help()
    assert "``" not in text and "the seeds'" not in text and "DESIGN.md" not in text
    for action in parser._actions:
        if isinstance(action, (*SWITCHES, argparse._SubParsersAction)) or action.default in (
            None,
            [],
            argparse.SUPPRESS,
        ):
            continue
        shown = parser._get_formatter()._get_help_string(action) if action.help else ""
        assert "default" in shown.lower(), (
            f"{parser.prog} {action.option_strings or action.dest}: its help does not show its default "
            f"{action.default!r}"
        )


def test_every_parser_refuses_abbreviations():
    for parser in _all_parsers():
        assert parser.allow_abbrev is False, parser.prog


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (
            ["serve", "--max-modle-len", "8192"],
            "usage: pkgd serve",
            "unknown option --max-modle-len; did you mean --max-model-len?",
        ),
        (["--max-modle-len=8192"], "usage: pkgd serve", "did you mean --max-model-len?"),
        (
            ["bench", "throughput", "--input", "5"],
            "usage: pkgd bench throughput",
            "unknown option --input; did you mean --input-len?",
        ),
        (["config", "show", "--sourcs"], "usage: pkgd config show", "unknown option --sourcs; did you mean --sources?"),
        (
            ["config", "show", "--tensor-paralel-size", "2"],
            "usage: pkgd config show",
            "did you mean --tensor-parallel-size?",
        ),
        (["run-batch", "-i", "a", "-o", "b", "--no-progres"], "usage: pkgd run-batch", "did you mean --no-progress?"),
    ],
)
def test_mistyped_flags_get_a_hint_and_the_commands_usage(capsys, argv, usage, hint):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(usage) and hint in err, err


def test_unknown_arguments_message_skips_an_unknown_options_value():
    parser = ArgumentParser(prog="x")
    parser.add_argument("--sources", action="store_true")
    assert unknown_arguments_message(["--sourcs", "--max-modle-len", "8", "extra"], parser) == (
        "unknown option --sourcs; did you mean --sources?\n"
        "  unknown option --max-modle-len; did you mean --max-model-len?\n"
        "  unexpected argument: extra"
    )
    assert unknown_arguments_message(["--zzzzzz"], parser) == "unknown option --zzzzzz"


def test_configuration_reference_in_docs_is_current():
    doc = REPO / "docs" / "configuration.md"
    assert doc.read_text() == keys_markdown(), "regenerate: pkgd config keys --format markdown > docs/configuration.md"


@pytest.mark.parametrize(
    ("topic", "shown", "not_shown"),
    [
        ("max-model-len", "model.max_model_len", "scheduler.max_num_seqs"),  # a vLLM flag's words
        ("--max-num-seqs", "scheduler.max_num_seqs", "model.max_model_len"),
        ("ModelConfig", "model.source", "parallel.tp:"),  # vLLM's group name: pkgd's section
        ("parallel.tp", "--tensor-parallel-size", "model.source"),
        ("listgroup", "supervisor:", "model.source"),
    ],
)
def test_help_topic_as_vllm_serve_help_equals(capsys, topic, shown, not_shown):
    """`vllm serve --help=TOPIC` lines work: a section, a key, or the keys a word names."""
    assert main(["serve", f"--help={topic}"]) == 0
    out = capsys.readouterr().out
    assert shown in out and not_shown not in out


def test_help_all_is_the_usual_help_then_every_key(capsys):
    assert main(["serve", "--help=all"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pkgd serve")
    assert "model.source" in out and "logging.level" in out and "supervisor.drain_timeout" in out


def test_help_topic_that_matches_nothing_exits_2_with_a_did_you_mean(capsys):
    assert main(["serve", "--help=listgrup"]) == 2
    err = capsys.readouterr().err
    assert "--help=listgrup: no section, key or flag matches; did you mean listgroup?" in err


def test_help_with_an_empty_topic_is_the_usual_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help="])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: pkgd serve")
