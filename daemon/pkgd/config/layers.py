"""The value layers below the command line: system tree files and the environment.

Also the merge that records, for every dotted key, which layer set it (`Provenance`), so
``pkgd config show --sources`` and the error lines can name the layer of each value.

System tree (layer 3): ``ROOT/NAME.yaml`` (``--config-dir ROOT``, default ``/etc/pkgd`` when it
exists; ``--config-name NAME``, default ``pkgd``), then ``ROOT/conf.d/*.yaml`` in name order.
Each file is a mapping of sections; it may start with a Hydra-style defaults list choosing
group options (``defaults: [{model: qwen}, {lb: external}]``). ``ROOT/GROUP/OPTION.yaml``
files add options to the groups (see `pkgd.config.compose`).

Environment (layer 4): ``PKGD_<SECTION>__<FIELD>[__<FIELD>]``, case-insensitive, read by
pydantic-settings' `EnvSettingsSource`. List fields take JSON (``["a","b"]``) or one plain
value; ``null`` is None. Below them, vLLM's variables of the same meaning (`VLLM_ENV`:
``VLLM_API_KEY``, one key, as ``--api-key``): a ``PKGD_`` variable of the same key beats its
vLLM twin and the command line beats both, as vLLM's flag beats its variable. A ``PKGD_``
variable that looks like config but names no section (``PKGD_FRONTED__API_KEYS``) or misses
the double underscore (``PKGD_FRONTEND_API_KEYS``) is a configuration error, not a warning: a
typo there would otherwise drop a setting silently (API keys, and with them authentication).
`NON_CONFIG_ENV` lists pkgd's other variables.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import typing
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pkgd.config import schema
from pkgd.config.errors import ConfigError, closest, show_value, without_value

SYSTEM_CONFIG_DIR = "/etc/pkgd"
DEFAULT_CONFIG_NAME = "pkgd"
CONF_D = "conf.d"
ENV_PREFIX = "PKGD_"
ENV_DELIMITER = "__"

#: pkgd's environment variables that are not config keys (read where they act: the CPU kernels
#: and huge pages by the runner). A test keeps this list in step with the sources.
NON_CONFIG_ENV = frozenset({"PKGD_CPU_KERNELS", "PKGD_HUGEPAGES", "PKGD_KERNEL_CACHE"})

#: vLLM's environment variables that set a config key (vLLM's meaning), each a layer of its own
#: (``env:VAR`` in `ComposedConfig.sources`) under the ``PKGD_`` variables.
VLLM_ENV = {
    "VLLM_API_KEY": "frontend.api_keys",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "frontend.allow_runtime_lora_updating",
}


@dataclasses.dataclass(frozen=True)
class FileLayer:
    """One system file: its label (``"system:conf.d/10-port.yaml"``), the values it sets and
    the (group, option) choices of its defaults list (option None = no option)."""

    label: str
    path: Path
    values: dict[str, Any]
    choices: tuple[tuple[str, str | None], ...] = ()


class Provenance:
    """The merged tree plus, for every key a layer set, ``(layer, detail)``.

    ``layer`` is what `ComposedConfig.sources` reports (``packaged``, ``system:<file>``,
    ``env``, ``cli``); ``detail`` is what error lines show (``env PKGD_FRONTEND__PORT``).
    """

    def __init__(self, base: dict[str, Any]) -> None:
        self.data = copy.deepcopy(base)
        self.set_by: dict[str, tuple[str, str]] = {}

    def merge(self, values: Mapping[str, Any], layer: str, details: Mapping[str, str] | None = None) -> None:
        """Deep-merge ``values`` (dicts merge, anything else replaces) and record the layer."""
        for key, value in values.items():
            self._set(self.data, str(key), value, str(key), layer, details or {})

    def _set(self, node: dict, name: str, value: Any, key: str, layer: str, details: Mapping[str, str]) -> None:
        if isinstance(value, dict) and isinstance(node.get(name), dict):
            for k, v in value.items():
                self._set(node[name], str(k), v, f"{key}.{k}", layer, details)
            return
        self._forget(key)
        node[name] = copy.deepcopy(value)
        for path in leaf_paths(value, key):
            self.set_by[path] = (layer, details.get(path, layer))

    def set_path(self, key: str, value: Any, layer: str, detail: str) -> str | None:
        """Set dotted ``key`` (creating sections); returns a problem line or None."""
        *parents, name = key.split(".")
        node = self.data
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parents[: i + 1])
                return (
                    f"{key}: cannot set ({without_value(detail)}): {where} holds the value {show_value(child)}, "
                    "not a section"
                )
            node = child
        self._set(node, name, value, key, layer, {key: detail})
        return None

    def delete_path(self, key: str) -> bool:
        """Delete dotted ``key`` (its value falls back to the field default); False if absent."""
        *parents, name = key.split(".")
        node: Any = self.data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or name not in node:
            return False
        del node[name]
        self._forget(key)
        return True

    def _forget(self, key: str) -> None:
        for path in [p for p in self.set_by if p == key or p.startswith(key + ".")]:
            del self.set_by[path]

    def relabel(self, values: Mapping[str, Any], layer: str) -> None:
        """Attribute the keys ``values`` set (already merged) to ``layer`` instead."""
        for key, value in values.items():
            for path in leaf_paths(value, str(key)):
                if path in self.set_by:
                    self.set_by[path] = (layer, layer)

    def details(self) -> dict[str, str]:
        return {k: d for k, (_, d) in self.set_by.items()}


def leaf_paths(value: Any, key: str) -> Iterator[str]:
    """Dotted paths of the non-mapping values in ``value`` (``key`` itself if a leaf)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaf_paths(v, f"{key}.{k}")
    else:
        yield key


def defaults_tree() -> dict[str, Any]:
    """The tree of field defaults as plain JSON data (the base every layer merges onto)."""
    from pkgd.config.vllm_config import default_config

    return default_config().to_json_dict()


# ---------------------------------------------------------------- system tree (layer 3)


def system_root(config_dir: str | None) -> Path | None:
    """The system tree: ``config_dir`` (which must exist), else /etc/pkgd if it exists."""
    if config_dir is None:
        root = Path(SYSTEM_CONFIG_DIR)
        return root if root.is_dir() else None
    root = Path(config_dir).expanduser()
    if not root.is_dir():
        raise ConfigError([f"--config-dir {config_dir}: no such directory"])
    return root.resolve()


def load_system_layers(root: Path | None, config_name: str | None) -> tuple[list[FileLayer], list[str]]:
    """Read ``ROOT/NAME.yaml`` then ``ROOT/conf.d/*.yaml``; returns (layers, problems)."""
    name = (config_name or DEFAULT_CONFIG_NAME).removesuffix(".yaml")
    if root is None:
        missing = [f"--config-name {config_name}: there is no system config directory"] if config_name else []
        return [], missing
    files: list[Path] = []
    problems: list[str] = []
    main = root / f"{name}.yaml"
    if main.is_file():
        files.append(main)
    elif config_name is not None:
        problems.append(f"--config-name {config_name}: no file {main}")
    files += conf_d_files(root / CONF_D)
    layers = []
    for path in files:
        label = f"system:{path.relative_to(root)}"
        data, bad = load_yaml(path)
        if bad:
            problems += bad
            continue
        choices, bad = _defaults_list(data.pop("defaults", None), path)
        problems += bad
        layers.append(FileLayer(label, path, data, choices))
    return layers, problems


def conf_d_files(conf_d: Path) -> list[Path]:
    """The layer files of a conf.d directory, in name order: ``*.yaml`` that are files (or
    symlinks to files, as a Kubernetes ConfigMap mounts them), hidden names (the ConfigMap's
    ``..data`` and ``..<timestamp>`` entries, editors' ``.swp``) left out."""
    if not conf_d.is_dir():
        return []
    return sorted(p for p in conf_d.iterdir() if p.suffix == ".yaml" and not p.name.startswith(".") and p.is_file())


def load_yaml(path: Path, package: str = "") -> tuple[dict[str, Any], list[str]]:
    """Load a YAML mapping (interpolations kept as text) as OmegaConf and Hydra do; returns
    (data, problems). A problem names file:line:column; a plain scalar that YAML 1.1 reads
    otherwise than YAML 1.2 (``1:30``, ``0755``, ``no``) is one too, named by its dotted path
    under ``package`` (`pkgd.config.yaml_scalars`).
    """
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from pkgd.config.yaml_scalars import ambiguous_scalars

    try:
        cfg = OmegaConf.load(path)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        return {}, [f"{where}: YAML syntax error: {e.problem or e.context}"]
    except yaml.YAMLError as e:
        return {}, [f"{path}: YAML error: {e}"]
    except OSError as e:
        return {}, [f"{path}: cannot read: {e.strerror}"]
    except UnicodeDecodeError as e:
        return {}, [
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save the file as UTF-8"
        ]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "")
        return {}, [f"{path}: {key + ': ' if key else ''}{str(e).splitlines()[0]}"]
    if not isinstance(cfg, DictConfig):
        return {}, [f"{path}: expected a mapping of sections (model:, parallel:, …), got a list"]
    problems = ambiguous_scalars(path.read_text(encoding="utf-8"), str(path), package)
    if problems:
        return {}, problems
    data = OmegaConf.to_container(cfg, resolve=False)
    return typing.cast(dict, data), []


def _defaults_list(entries: Any, path: Path) -> tuple[tuple[tuple[str, str | None], ...], list[str]]:
    if entries is None:
        return (), []
    if not isinstance(entries, list):
        return (), [f"{path}: defaults: expected a list of 'GROUP: OPTION' entries"]
    choices, problems = [], []
    for entry in entries:
        if entry == "_self_":
            continue
        if isinstance(entry, dict) and len(entry) == 1:
            ((group, option),) = entry.items()
            group = str(group).removeprefix("override ").strip()
            if option is None or isinstance(option, str):
                choices.append((group, option))
                continue
        problems.append(f"{path}: defaults entry {show_value(entry)}: expected 'GROUP: OPTION' (e.g. 'model: qwen')")
    return tuple(choices), problems


# ---------------------------------------------------------------- environment (layer 4)


_ENV_REFERENCE = re.compile(r"""\$\{\s*oc\.env\s*:\s*['"]?([^\s,'"}]+)""")


def env_references(value: Any) -> set[str]:
    """The variables that ``${oc.env:VAR}`` interpolations in ``value`` (a text, or nested
    lists and mappings of them) read."""
    if isinstance(value, str):
        return set(_ENV_REFERENCE.findall(value))
    if isinstance(value, Mapping):
        return env_references(list(value.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*(env_references(v) for v in value))
    return set()


def read_env(
    env: Mapping[str, str], referenced: Collection[str] = ()
) -> tuple[dict[str, Any], dict[str, str], list[str], list[str]]:
    """Read ``PKGD_SECTION__FIELD`` variables from ``env``.

    Returns ``(values, details, warnings, problems)``: the nested values (strings, or decoded
    JSON for list fields), dotted key → ``"env VAR"``, warnings for ``PKGD_`` variables that
    are neither config nor pkgd's (`NON_CONFIG_ENV`), and problems: one per undecodable
    value and per variable that looks like config but is misspelt (see module docstring).
    A variable in ``referenced`` (read by a ``${oc.env:VAR}`` of the config, or of a config
    variable's value) is neither: the config uses it on purpose.
    """
    mine = {k: v for k, v in env.items() if k.upper().startswith(ENV_PREFIX) and k.upper() not in NON_CONFIG_ENV}
    if not mine:
        return {}, {}, [], []
    from pydantic_settings import SettingsError

    sections = schema.children("")
    details: dict[str, str] = {}
    warnings: list[str] = []
    problems: list[str] = []
    is_config = {var: var[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)[0] in sections for var in mine}
    referenced = {*referenced, *env_references([v for var, v in mine.items() if is_config[var]])}
    for var in mine:
        parts = var[len(ENV_PREFIX) :].lower().split(ENV_DELIMITER)
        if is_config[var]:
            details[".".join(parts)] = f"env {var}"
            continue
        if var in referenced:
            continue
        problem = _misspelt_env(var, parts, sections)
        if problem:
            problems.append(problem)
        else:
            warnings.append(
                f"{var}: ignored, not a pkgd setting (config variables are {ENV_PREFIX}<SECTION>{ENV_DELIMITER}<FIELD>)"
            )
    config_vars = {k: v for k, v in mine.items() if is_config[k]}
    try:
        values = _env_source_class()(config_vars)()
    except SettingsError:
        for var, value in config_vars.items():
            try:
                _env_source_class()({var: value})()
            except SettingsError:
                problems.append(f"{var}: bad value {show_value(value)} (env); expected JSON for this section or list")
        return {}, details, warnings, problems
    return (values if not problems else {}), details, warnings, problems


def read_vllm_env(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The `VLLM_ENV` variables set in ``env``: variable → (dotted key, value). An empty one
    counts as unset, as in vLLM (``VLLM_API_KEY=`` turns no authentication on)."""
    return {var: (key, env[var]) for var, key in VLLM_ENV.items() if env.get(var)}


def _misspelt_env(var: str, parts: list[str], sections: Sequence[str]) -> str | None:
    """The problem line for a variable that looks like config without naming a section:
    ``PKGD_X__…`` with an unknown or misspelt section, or ``PKGD_SECTION_FIELD`` (one
    underscore) with a known or nearly known section; None for anything else."""
    if len(parts) > 1:
        match = closest(parts[0], sections)
        hint = f"; did you mean {_env_name(match, parts[1:])}?" if match else f"; sections: {', '.join(sections)}"
        return f"{var}: {parts[0]!r} is not a config section (env){hint}"
    words = parts[0].split("_")
    for i in range(1, len(words)):
        head, rest = "_".join(words[:i]), "_".join(words[i:])
        section = head if head in sections else closest(head, sections)
        if section is None:
            continue
        fields = schema.children(section)
        field_name = rest if rest in fields else closest(rest, fields)
        suggestion = (
            _env_name(section, [field_name]) if field_name else f"{ENV_PREFIX}{section.upper()}{ENV_DELIMITER}<FIELD>"
        )
        return (
            f"{var}: not a config variable (env; sections and fields are separated by {ENV_DELIMITER!r}); did "
            f"you mean {suggestion}?"
        )
    return None


def _env_name(section: str, parts: list[str]) -> str:
    return ENV_PREFIX + ENV_DELIMITER.join([section, *parts]).upper()


def _is_list_field(field: Any) -> bool:
    ann = getattr(field, "annotation", None)
    return typing.get_origin(ann) is list or any(typing.get_origin(a) is list for a in typing.get_args(ann))


@functools.cache
def _env_source_class() -> type:
    """Built on first use: pydantic-settings is imported only when PKGD_ variables exist."""
    from pydantic_settings import EnvSettingsSource
    from pydantic_settings.sources.utils import parse_env_vars

    class EnvSource(EnvSettingsSource):
        """pydantic-settings' env source over a snapshot; a list field also takes one plain value."""

        def __init__(self, snapshot: Mapping[str, str]) -> None:
            from pkgd.config.vllm_config import VllmConfig

            self._snapshot = snapshot
            super().__init__(
                VllmConfig,  # type: ignore[arg-type]  # only its fields are read
                case_sensitive=False,
                env_prefix=ENV_PREFIX,
                env_nested_delimiter=ENV_DELIMITER,
                env_parse_none_str="null",
            )

        def _load_env_vars(self) -> Mapping[str, str | None]:  # the hook DotEnvSettingsSource uses too
            return parse_env_vars(self._snapshot, False, False, self.env_parse_none_str)

        def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
            try:
                return super().decode_complex_value(field_name, field, value)
            except ValueError:
                if _is_list_field(field) and isinstance(value, str) and not value.lstrip().startswith("["):
                    return [value]
                raise

    return EnvSource
