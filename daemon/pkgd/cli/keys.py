"""The configuration key reference, read from the schema: ``pkgd config keys [SECTION]``, the
common flags of ``pkgd --help`` and ``docs/configuration.md``.

Every text here comes from `pkgd.config.schema` (key, type, default, vLLM flags, reload
class, description) and the packaged config groups; nothing is listed twice by hand. The
Markdown form is checked in as ``docs/configuration.md``; a test fails when it drifts.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from pkgd.config.errors import ConfigError, did_you_mean

# The flags `pkgd --help` and `pkgd serve --help` show, with the word standing for their
# value: what a first deployment changes. Everything else about them comes from the schema.
COMMON_FLAGS = (
    ("model.source", "SOURCE"),
    ("model.max_model_len", "N"),
    ("model.dtype", "DTYPE"),
    ("frontend.host", "HOST"),
    ("frontend.port", "PORT"),
    ("frontend.api_keys", "KEY"),
    ("frontend.served_model_names", "NAME"),
    ("frontend.api_server_count", "N"),
    ("parallel.tp", "N"),
    ("parallel.dp", "N"),
    ("scheduler.max_num_seqs", "N"),
    ("cache.kv_cache_memory_bytes", "BYTES"),
    ("logging.level", "LEVEL"),
)

SETTING_A_KEY = (
    "Set a key as KEY=VALUE on the command line (reset it with ~KEY), with its vLLM flag, or as "
    "PKGD_SECTION__FIELD=VALUE in the environment; `pkgd config show --sources` shows the result "
    "and the layer of each value."
)


def default_text(value: Any) -> str:
    """A default as the reference prints it: ``null``, ``true``, ``[a, b]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def env_name(key: str) -> str:
    """The environment variable of a dotted key (``frontend.port`` -> ``PKGD_FRONTEND__PORT``)."""
    return "PKGD_" + key.replace(".", "__").upper()


def flag_text(alias: str) -> str:
    """``--data-parallel-external-lb=external`` -> ``--data-parallel-external-lb (sets external)``."""
    flag, eq, const = alias.partition("=")
    return f"{flag} (sets {const})" if eq else flag


def select_leaves(selector: str | None) -> list[Any]:
    """The leaves of the section or key ``selector`` (all for None), in schema order.

    Raises:
        ConfigError: ``selector`` names no section or key (with a did-you-mean).
    """
    from pkgd.config import schema

    leaves = list(schema.leaves().values())
    if not selector:
        return leaves
    chosen = [leaf for leaf in leaves if leaf.key == selector or leaf.key.startswith(selector + ".")]
    if not chosen:
        names = [*schema.sections(), *schema.leaves()]
        top = ", ".join(s for s in schema.sections() if "." not in s)
        raise ConfigError([f"{selector}: no such section or key{did_you_mean(selector, names)} (sections: {top})"])
    return chosen


def by_section(leaves: Iterable[Any]) -> dict[str, list[Any]]:
    """Leaves grouped by their section, sections in order of first appearance (a section's
    fields declared after a subsection still land under one heading)."""
    groups: dict[str, list[Any]] = {}
    for leaf in leaves:
        groups.setdefault(leaf.section, []).append(leaf)
    return groups


def keys_text(selector: str | None = None, width: int | None = None, *, leaves: Sequence[Any] | None = None) -> str:
    """The reference as ``pkgd config keys`` prints it: per key its type, default, flags,
    reload class and description; of ``leaves`` when given, else of ``selector``."""
    from pkgd.config import schema

    width = width or min(shutil.get_terminal_size((100, 24)).columns, 120)
    lines = textwrap.wrap(SETTING_A_KEY, width=width)
    if not selector and leaves is None:
        lines += ["", groups_text()]
    for section, leaves in by_section(select_leaves(selector) if leaves is None else leaves).items():
        lines += ["", f"{section}: {schema.sections().get(section, '')}"]
        for leaf in leaves:
            head = f"  {leaf.key}: {leaf.type_label} = {default_text(leaf.default)}"
            if leaf.aliases:
                head += "   " + ", ".join(flag_text(a) for a in leaf.aliases)
            lines.append(head)
            body = f"{leaf.description} [reload: {leaf.reload.value}]"
            lines += textwrap.wrap(body, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def help_topic_text(topic: str) -> str:
    """What ``pkgd serve --help=TOPIC`` prints, as vLLM's ``--help=`` does: ``all`` every key;
    ``listgroup`` the sections; a section or key (``model``, ``parallel.tp``; vLLM's group
    names ``ModelConfig``, ``CacheConfig`` … name pkgd's sections) its keys; any other word
    the keys whose name or vLLM flag contains it (``max-model-len``, ``--max-num-seqs``).

    Raises:
        ValueError: nothing matches ``topic`` (with a did-you-mean).
    """
    from pkgd.config import schema

    if topic == "all":
        return keys_text()
    if topic == "listgroup":
        return "sections (pkgd serve --help=SECTION):\n" + "\n".join(
            f"  {name}: {text}" for name, text in schema.sections().items() if "." not in name
        )
    section = topic.lower().removesuffix("config").removesuffix("args")
    for selector in (topic, section):
        if selector in schema.sections() or selector in schema.leaves():
            return keys_text(selector)
    word = topic.lstrip("-").replace("-", "_").lower()
    found = [
        leaf
        for leaf in schema.leaves().values()
        if word and (word in leaf.key.lower() or any(word in a.lstrip("-").replace("-", "_") for a in leaf.aliases))
    ]
    if not found:
        names = ["all", "listgroup", *schema.sections(), *schema.leaves()]
        raise ValueError(
            f"--help={topic}: no section, key or flag matches{did_you_mean(topic, names)} (try --help=listgroup)"
        )
    return keys_text(leaves=found)


def groups_text() -> str:
    """The config groups and their options, from the packaged tree."""
    lines = ["config groups (GROUP=OPTION, e.g. +model=qwen; the packaged default is marked *):"]
    for group, options, default in _groups():
        lines.append(f"  {group}: {', '.join(f'{n}*' if n == default else n for n in options)}")
    return "\n".join(lines)


def _groups() -> list[tuple[str, list[str], str | None]]:
    from pkgd.config.compose import packaged_defaults, packaged_dir

    defaults = packaged_defaults()
    out = []
    for d in sorted(p for p in packaged_dir().iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        out.append((d.name, sorted(f.stem for f in d.glob("*.yaml")), defaults.get(d.name)))
    return out


def common_flags_text(flags: Sequence[tuple[str, str]] = COMMON_FLAGS) -> str:
    """The common vLLM flags, one line each: flag and value, the key it sets, its default."""
    from pkgd.config import schema

    leaves = schema.leaves()
    lines = [
        "common flags (each sets the config key shown, here with its default; every key, with",
        "its flags and meaning: pkgd config keys [SECTION]):",
    ]
    for key, metavar in flags:
        leaf = leaves[key]
        flag = leaf.aliases[0].partition("=")[0]
        head = flag if leaf.is_bool else f"{flag} {metavar}"
        lines.append(f"  {head:<29} {key} = {default_text(leaf.default)}")
    return "\n".join(lines)


def keys_markdown() -> str:
    """``docs/configuration.md``: the whole reference as Markdown tables, one per section."""
    from pkgd.config import schema

    out = [
        "# Configuration reference",
        "",
        "Generated from the configuration schema by `pkgd config keys --format markdown`;",
        "edit the field descriptions in `daemon/pkgd/config/`, not this file (a test checks it).",
        "",
        SETTING_A_KEY.replace("KEY=VALUE", "`KEY=VALUE`")
        .replace("~KEY", "`~KEY`")
        .replace("PKGD_SECTION__FIELD=VALUE", "`PKGD_SECTION__FIELD=VALUE`"),
        "",
        "The reload column says what a SIGHUP reload does when the key changes: `live` applies it",
        "in place, `api` starts a new generation of API servers on the held socket while the old",
        "one drains, `engine` starts new engine cores (and API servers) the same way, `restart`",
        "needs the daemon restarted (docs/operations.md).",
        "",
        "## Config groups",
        "",
        "Choose one option per group (`+GROUP=OPTION`, or a defaults list in a YAML file).",
        "",
        "| group | options | packaged default |",
        "|---|---|---|",
    ]
    out += [
        f"| `{g}` | {', '.join(f'`{o}`' for o in opts)} | {f'`{d}`' if d else 'none'} |" for g, opts, d in _groups()
    ]
    for section, leaves in by_section(schema.leaves().values()).items():
        out += [
            "",
            f"## {section}",
            "",
            schema.sections().get(section, ""),
            "",
            "| key | type | default | vLLM flag | environment | reload | description |",
            "|---|---|---|---|---|---|---|",
        ]
        for leaf in leaves:
            flags = "<br>".join(f"`{flag_text(a)}`" for a in leaf.aliases)
            out.append(
                " | ".join(
                    [
                        f"| `{leaf.key}`",
                        _cell(leaf.type_label),
                        f"`{_cell(default_text(leaf.default))}`",
                        flags,
                        f"`{env_name(leaf.key)}`",
                        leaf.reload.value,
                        _cell(leaf.description) + " |",
                    ]
                )
            )
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
