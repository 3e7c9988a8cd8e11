"""Building a config: YAML files (with `base`), `key=value` overrides, the run form's values;
validation errors worded for the user."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from stepgrpo.config._section import ConfigError
from stepgrpo.config.training import expand_preset
from stepgrpo.config.whole import Config
from stepgrpo.paths import SHIPPED_CONFIGS


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config (or the defaults), apply `key=value` overrides, validate.

    A config file may name a `base` config (a path relative to it) whose sections it overrides
    field by field. Override values are parsed as YAML (`optim.lr=1e-4`, `optim.train_steps=[0,1]`,
    `completion.method=null`). Raises `ConfigError` naming every bad field.
    """
    data = _read_config_file(config_file(path)) if path is not None else {}
    allow_plugins(data)  # the user's own file: the plug-ins it names may be imported
    return validate_config(apply_overrides(data, overrides))


def config_from(
    config: Config | Mapping[str, Any] | None = None,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """The config a flow runs with: the typed `config` (the Prefect run form, or what the CLI
    resolved) or the YAML file at `path` (or the defaults), with `key=value` overrides applied."""
    if config is not None and path is not None:
        raise ConfigError(
            "both a config and config_path were given: fill in the config (the run form), or name a YAML file "
            "in config_path, not both"
        )
    if config is None:
        return load_config(path, overrides)
    data = config.model_dump(mode="json") if isinstance(config, Config) else dict(config)
    allow_plugins(data)  # what the caller passed (the run form, the CLI's resolved config), never a stored run's
    return validate_config(apply_overrides(data, overrides))


def user_set(config: Any, overrides: Sequence[str] = ()) -> set[str]:
    """The `section.field` keys the user set themselves: in their own config files (a shipped recipe,
    or a shipped base under their file, is not theirs), in a mapping they passed, and in overrides.
    A typed `Config` tells none. What `Config.notes` speaks to."""
    keys: set[str] = set()
    if isinstance(config, str | Path):
        path: Path | None = config_file(config)
        seen: set[Path] = set()
        while path is not None and path.is_file() and path.resolve() not in seen:
            seen.add(path.resolve())
            if SHIPPED_CONFIGS.resolve() in path.resolve().parents:
                break  # a shipped recipe and what it stands on
            loaded = load_yaml(path.read_text(), str(path)) or {}
            if not isinstance(loaded, Mapping):
                break
            keys |= _section_keys(loaded)
            base = loaded.get(BASE_KEY)
            path = path.parent / base if isinstance(base, str) else None
    elif isinstance(config, Mapping):
        keys |= _section_keys(config)
    keys |= {item.partition("=")[0].strip() for item in overrides or ()}
    return keys


def _section_keys(data: Mapping[str, Any]) -> set[str]:
    return {f"{s}.{k}" for s, sec in data.items() if isinstance(sec, Mapping) for k in sec}


PLUGIN_SECTIONS = ("reward", "credit")  # the sections whose names may be plug-in references


def allow_plugins(data: Mapping[str, Any]) -> None:
    """Let the plug-in references that the user's own config `data` names be imported
    (`stepgrpo_core.registry.allow`). Never called with a config read from a run directory."""
    from stepgrpo_core.registry import allow, references_in

    allow(*references_in([data.get(s) for s in PLUGIN_SECTIONS if isinstance(data, Mapping)]))


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the config mapping `data` with `key=value` overrides (YAML values) applied."""
    out = copy.deepcopy(dict(data))
    for item in overrides or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-4")
        value = load_yaml(raw, f"--set {key.strip()}") if raw.strip() else None
        if key.strip().split(".")[0] in PLUGIN_SECTIONS:
            allow_plugins({key.strip().split(".")[0]: value})  # an override is the user's own input
        if key.strip() == "optim.preset" and value is not None:  # the preset's fields, then later --sets
            optim = out.get("optim") if isinstance(out.get("optim"), dict) else {}
            out["optim"] = {**optim, **expand_preset({}, value, f"--set {item}")}
        _set_dotted(out, key.strip(), value)
    return out


MAX_YAML_VALUES = 100_000  # values a config may expand to, its aliases followed


def load_yaml(text: str, where: str) -> Any:
    """YAML text as data (safe types only), refused when its aliases expand beyond
    `MAX_YAML_VALUES` values or refer to themselves: a few hundred bytes of nested aliases (a
    "billion laughs") would otherwise expand to billions of values in every walk of the config."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None:
        sizes: dict[int, int] = {}
        open_: set[int] = set()

        def size(n: yaml.Node) -> int:
            if id(n) in sizes:
                return sizes[id(n)]
            if id(n) in open_:
                raise ConfigError(f"{where}: a YAML alias refers to the value it is part of; write the values out")
            open_.add(id(n))
            if isinstance(n, yaml.MappingNode):
                total = 1 + sum(size(k) + size(v) for k, v in n.value)
            elif isinstance(n, yaml.SequenceNode):
                total = 1 + sum(size(v) for v in n.value)
            else:
                total = 1
            open_.discard(id(n))
            sizes[id(n)] = min(total, MAX_YAML_VALUES + 1)
            return sizes[id(n)]

        if size(node) > MAX_YAML_VALUES:
            raise ConfigError(
                f"{where}: its YAML aliases expand to more than {MAX_YAML_VALUES} values (nested anchors, a "
                '"billion laughs"); a config needs no such thing: write the values out'
            )
    return yaml.safe_load(text)


BASE_KEY = "base"  # a config file may start from another one: `base: shapes_outcome.yaml`


def config_file(path: str | Path) -> Path:
    """A config file given as a path, or as the name of a shipped config (`shapes_outcome`: the
    shipped `configs/shapes_outcome.yaml`, `stepgrpo.paths`), when no such file is in the working directory."""
    given = Path(path)
    if given.is_file():
        return given
    if given.parent == Path("configs") and (SHIPPED_CONFIGS / given.name).is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist here (a checkout's path); the shipped recipe is "
            f"`--config {given.stem}` (`stepgrpo config list` names them all)"
        )
    if given.parent != Path(".") or given.suffix in (".yaml", ".yml"):
        return given
    shipped = SHIPPED_CONFIGS / f"{given.name}.yaml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"config {str(path)!r} is neither a file nor a shipped config; the shipped ones: {names}")


# The shipped recipe a newcomer starts from, and why (docs/bench/frontier/README.md: the most held-out
# reward per forward + backward pass on the shipped model, level with shapes_nft).
START_HERE = ("shapes_awm", "the most held-out reward per unit of compute on the shipped model (tied with shapes_nft)")


def shipped_recipes() -> list[tuple[str, str]]:
    """The shipped recipes: `(name, the first sentence of its header comment)`, by name (the
    sentence whole, over as many comment lines as it takes)."""
    out = []
    for path in sorted(SHIPPED_CONFIGS.glob("*.yaml")):
        words: list[str] = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            text = line.lstrip("#").strip()
            if not text and words:
                break  # the end of the first paragraph
            words.append(text)
        paragraph = " ".join(w for w in words if w)
        end = paragraph.find(". ")
        out.append((path.stem, paragraph if end < 0 else paragraph[: end + 1]))
    return out


def _read_config_file(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config as a mapping, with its `base` file (relative to it) merged underneath."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config file {str(path)!r} is its own base (through {' -> '.join(p.name for p in seen)})")
    try:
        loaded = load_yaml(path.read_text(), f"config file {str(path)!r}") or {}
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f", line {where.line + 1}" if where is not None else ""
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{line}: {getattr(err, 'problem', err)}"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    if isinstance(loaded.get("optim"), Mapping):
        loaded["optim"] = expand_preset(loaded["optim"], loaded["optim"].get("preset"), str(path))
    base = loaded.pop(BASE_KEY, None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"{path}: `base` must be the path of another config file, relative to this one")
    return _merge(_read_config_file(path.parent / base, (*seen, path.resolve())), loaded)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`, section by section (a section's free-form `options` are replaced whole)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) and k != "options" else v
    return out


def validate_config(data: Mapping[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err)) from None


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p!r} is not a section")
    node[parts[-1]] = value


def _fields_at(loc: Sequence[Any]) -> list[str]:
    """Allowed field names of the model that holds the location `loc` (minus its last part)."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        where = ".".join(loc) or "config"
        if e["type"] == "extra_forbidden":
            allowed = _fields_at(loc)
            lines.append(f"{where}: unknown field; allowed: {', '.join(allowed)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" + (f" (got {e['input']!r})" if _short(e.get("input")) else ""))
    return "invalid config:\n  " + "\n  ".join(lines)


def _short(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) and len(repr(value)) < 60
