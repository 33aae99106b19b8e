"""Compose the five layers into one validated `VllmConfig` — the only place that calls Hydra.

Layers, lowest first (docs/architecture.md, "Configuration"):

1. field defaults of the pydantic models (``default``);
2. the packaged tree ``configs/``: ``pkgd.yaml`` is only a defaults list choosing one option
   per config group (``model: smollm2``), and each option is a small YAML preset
   (``packaged``). Hydra composes this layer through its compose API inside
   ``with initialize_config_dir(...)``: no ``@hydra.main``, no change of directory, no
   ``outputs/``, no global state left behind, so the daemon composes again on SIGHUP;
3. the system tree (``system:<file>``): ``/etc/pkgd`` when it exists, or ``--config-dir DIR``
   (which must exist); ``DIR/NAME.yaml`` (``--config-name NAME``, default ``pkgd``), then
   ``DIR/conf.d/*.yaml`` in name order. A file may start with a defaults list choosing group
   options (``defaults: [{model: qwen}]``); ``DIR/GROUP/OPTION.yaml`` adds options to a group;
4. the environment, ``PKGD_<SECTION>__<FIELD>`` (``env``; see `pkgd.config.layers`), over
   vLLM's ``VLLM_API_KEY`` (``env:VLLM_API_KEY``);
5. the command line (``cli``): vLLM's ``--config FILE`` of flags (`pkgd.config.vllm_yaml`),
   then Hydra overrides, then vLLM-style flags (see `pkgd.config.overrides`).

Group options are presets: wherever an option is chosen (packaged defaults < system files <
command line), its values sit in layer 2, so a value set in the system tree, the environment
or on the command line always beats a preset. Every layer is read before anything is
merged, and every problem of every layer is reported at once (`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pkgd.config import layers, schema
from pkgd.config.errors import ConfigError, did_you_mean, origin_of, validation_problems, without_value
from pkgd.config.overrides import GroupChoice, ValueOp, parse_flags, parse_overrides, unknown_delete
from pkgd.config.vllm_config import ServePlan, VllmConfig

PACKAGED_CONFIG_NAME = "pkgd"
_OPTION_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True)
class ComposeRequest:
    """Everything `compose` reads besides the files: built by the CLI from argv, kept by the
    daemon to compose again on SIGHUP.

    ``config_dir``: the system tree (None = /etc/pkgd if it exists); ``config_name``: its root
    file (None = ``pkgd``; a name given explicitly must exist); ``overrides``: Hydra
    overrides in order; ``flags``: vLLM-style flag tokens in order (applied after the
    overrides; ``pkgd serve MODEL`` appends ``--model MODEL``); ``vllm_config``: vLLM's
    ``--config`` YAML file of flags (applied before the overrides and flags); ``env``: a
    snapshot of the environment, None = ``os.environ`` at compose time.
    """

    config_dir: str | None = None
    config_name: str | None = None
    overrides: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    vllm_config: str | None = None


@dataclasses.dataclass(frozen=True)
class ComposedConfig:
    """A validated tree and where each value came from.

    ``sources``: every leaf's dotted key → ``default``, ``packaged``, ``system:<file>``
    (relative to the system tree), ``env``, ``env:VLLM_API_KEY`` or ``cli``. ``warnings``: lines to log (ignored
    variables, shadowed files, the serve plan's caps). ``choices``: group → chosen option.
    """

    config: VllmConfig
    sources: dict[str, str]
    warnings: tuple[str, ...] = ()
    choices: dict[str, str] = dataclasses.field(default_factory=dict)
    system_dir: str | None = None

    @property
    def plan(self) -> ServePlan:
        return self.config.serve_plan()


def packaged_dir() -> Path:
    """The packaged Hydra tree (``configs/``, package data of ``pkgd``)."""
    return (Path(__file__).resolve().parent.parent / "configs").resolve()


@functools.cache
def packaged_defaults() -> dict[str, str | None]:
    """Group → option of the packaged ``pkgd.yaml`` defaults list (None = no option)."""
    import yaml  # the packaged file is plain YAML; no need for OmegaConf here (``--help``)

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when the wheel has it
    data = yaml.load((packaged_dir() / f"{PACKAGED_CONFIG_NAME}.yaml").read_text(), Loader=loader)
    out: dict[str, str | None] = {}
    for entry in data.get("defaults", []):
        if isinstance(entry, dict):
            out.update(entry)
    return out


@dataclasses.dataclass(frozen=True)
class _Groups:
    options: dict[str, dict[str, Path]]  # group -> option -> file (packaged wins a tie)
    system_root: Path | None
    warnings: tuple[str, ...]

    def in_system(self, group: str, option: str) -> bool:
        root = self.system_root
        return root is not None and self.options[group][option].is_relative_to(root)


def _find_groups(root: Path | None) -> _Groups:
    options: dict[str, dict[str, Path]] = {}
    shadowed: list[str] = []
    for base in (packaged_dir(), root):
        if base is None:
            continue
        for d in sorted(p for p in base.iterdir() if p.is_dir()):
            if d.name == layers.CONF_D or d.name.startswith((".", "_")):
                continue
            for f in sorted(d.glob("*.yaml")):
                if not _OPTION_NAME.match(f.stem):
                    continue
                group = options.setdefault(d.name, {})
                if f.stem in group:
                    shadowed.append(
                        f"system:{d.name}/{f.name} is ignored: the packaged option {d.name}={f.stem} "
                        "has the same name; rename the file to add an option"
                    )
                else:
                    group[f.stem] = f
    return _Groups(options, root, tuple(shadowed))


def compose(request: ComposeRequest) -> ComposedConfig:
    """Compose, merge and validate the five layers.

    Raises:
        ConfigError: with one line per problem (dotted path, bad value, expected, did-you-mean;
            file:line for YAML syntax errors). Nothing is started and no state is kept.
    """
    env = os.environ if request.env is None else request.env
    root = layers.system_root(request.config_dir)
    groups = _find_groups(root)
    files, problems = layers.load_system_layers(root, request.config_name)
    cli_choices, override_ops, bad = parse_overrides(request.overrides, groups.options)
    problems += bad
    flag_ops, bad = parse_flags(request.flags)
    problems += bad
    file_ops: list[ValueOp] = []
    if request.vllm_config is not None:
        from pkgd.config import vllm_yaml

        file_ops, bad = vllm_yaml.load(request.vllm_config)
        problems += bad
    choices = [GroupChoice(g, o, f.label) for f in files for g, o in f.choices] + cli_choices
    problems += _choice_problems(choices, groups)
    final = dict(packaged_defaults())
    final.update((c.group, c.option) for c in choices)
    ops = file_ops + override_ops + flag_ops
    env_values, env_details, warns, bad = layers.read_env(env, _env_references(files, ops, groups, final))
    problems += bad
    if problems:
        raise ConfigError(problems)

    tree = layers.Provenance(layers.defaults_tree())
    warns += list(groups.warnings)
    warns += _merge_presets(tree, groups, final)
    for f in files:
        tree.merge(f.values, f.label)
    for var, (key, value) in layers.read_vllm_env(env).items():
        tree.set_path(key, value, f"env:{var}", f"env {var}")  # a key of a section: no problem
    tree.merge(env_values, "env", env_details)
    problems = _apply(tree, ops)
    data, bad = _resolve(tree) if not problems else ({}, [])
    problems += bad
    if problems:
        raise ConfigError(problems)
    config = _validate(data, tree)
    sources = {key: tree.set_by.get(key, ("default", ""))[0] for key in schema.leaf_keys()}
    warns += config.serve_plan().warnings
    chosen = {g: o for g, o in final.items() if o is not None}
    return ComposedConfig(config, sources, tuple(warns), chosen, str(root) if root else None)


def _env_references(
    files: Iterable[layers.FileLayer], ops: Iterable[ValueOp], groups: _Groups, final: Mapping[str, str | None]
) -> set[str]:
    """The variables ``${oc.env:VAR}`` reads anywhere in the layers composed: the system
    files, the command line and every chosen group option's file (packaged or system)."""
    found = layers.env_references([f.values for f in files] + [op.value for op in ops])
    for group, option in final.items():
        path = groups.options.get(group, {}).get(option or "")
        if path is not None:
            found |= layers.env_references(path.read_text(encoding="utf-8", errors="replace"))
    return found


def _choice_problems(choices: Iterable[GroupChoice], groups: _Groups) -> list[str]:
    problems = []
    for c in choices:
        if c.group not in groups.options:
            hint = did_you_mean(c.group, groups.options)
            problems.append(
                f"{c.group}: unknown config group (set by {c.origin}){hint}; groups: "
                f"{', '.join(sorted(groups.options))}"
            )
        elif c.option is not None and c.option not in groups.options[c.group]:
            names = sorted(groups.options[c.group])
            problems.append(
                f"{c.group}={c.option}: unknown option of group {c.group} (set by {c.origin}); "
                f"options: {', '.join(names)}{did_you_mean(c.option, names)}"
            )
    return problems


def _hydra_overrides(final: Mapping[str, str | None], groups: _Groups) -> list[str]:
    """Hydra overrides choosing ``final`` over the packaged defaults list.

    pkgd treats ``+g=o`` and ``g=o`` alike; Hydra wants ``g=o`` for a group of the defaults
    list (``+`` would be "Multiple values for g") and ``+g=o`` for any other group.
    """
    defaults = packaged_defaults()
    out = []
    for group, option in final.items():
        if group in defaults:
            if option != defaults[group]:
                out.append(f"{group}={option}" if option is not None else f"~{group}")
        elif option is not None:
            out.append(f"+{group}={option}")
    if any(groups.in_system(g, o) for g, o in final.items() if o is not None):
        out.append(f"hydra.searchpath=[{_quote('file://' + str(groups.system_root))}]")
    return out


def _quote(text: str) -> str:
    """A Hydra override grammar single-quoted string."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _merge_presets(tree: layers.Provenance, groups: _Groups, final: Mapping[str, str | None]) -> list[str]:
    """Compose layer 2 with Hydra and merge it into ``tree``; returns warnings."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    system_options = [(g, o) for g, o in final.items() if o is not None and groups.in_system(g, o)]
    problems = [
        p
        for g, o in system_options
        for p in layers.load_yaml(groups.options[g][o], _package(groups.options[g][o], g))[1]
    ]
    if problems:
        raise ConfigError(problems)
    overrides = _hydra_overrides(final, groups)
    searchpath = [o for o in overrides if o.startswith("hydra.searchpath=")]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with initialize_config_dir(config_dir=str(packaged_dir()), version_base=None, job_name="pkgd"):
                presets = OmegaConf.to_container(hydra_compose(PACKAGED_CONFIG_NAME, overrides), resolve=False)
                per_option = {
                    f"system:{g}/{o}.yaml": OmegaConf.to_container(
                        hydra_compose(None, [f"+{g}={o}", *searchpath]), resolve=False
                    )
                    for g, o in system_options
                }
    except (HydraException, OmegaConfBaseException) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ConfigError([f"config groups: {lines[0] if lines else type(e).__name__}"]) from None
    tree.merge(presets, "packaged")  # type: ignore[arg-type]
    for label, values in per_option.items():
        tree.relabel(values, label)  # type: ignore[arg-type]
    return [str(w.message) for w in caught]


_PACKAGE_HEADER = re.compile(r"#\s*@package\s+(\S+)")


def _package(path: Path, group: str) -> str:
    """The dotted section a group option's keys land in, as Hydra places them: the group, or
    what a ``# @package`` line of the file's leading comments says (``_global_`` = the root)."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            break
        if m := _PACKAGE_HEADER.match(line):
            parts = m.group(1).split(".")
            head = {"_global_": [], "_group_": group.split("/")}.get(parts[0], parts[:1])
            return ".".join([*head, *parts[1:]])
    return group.replace("/", ".")


def _apply(tree: layers.Provenance, ops: Iterable[ValueOp]) -> list[str]:
    problems = []
    for op in ops:
        if op.delete:
            if not tree.delete_path(op.key) and op.key not in schema.leaves() and op.key not in schema.sections():
                problems.append(unknown_delete(op.key))
        elif problem := tree.set_path(op.key, op.value, "cli", op.origin):
            problems.append(problem)
    return problems


def _resolve(tree: layers.Provenance) -> tuple[dict[str, Any], list[str]]:
    """Resolve ``${...}`` interpolations (OmegaConf) over the merged tree; (data, problems)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(tree.data), resolve=True), []  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "")
        origin = without_value(origin_of(key, tree.details()) or "") if key else None
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        return {}, [f"{key or 'config'}: cannot resolve{f' (set by {origin})' if origin else ''}: {message}"]


def _validate(data: dict[str, Any], tree: layers.Provenance) -> VllmConfig:
    from pydantic import ValidationError

    try:
        return VllmConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(validation_problems(e, tree.details())) from None
