"""Reading a job's configuration: a YAML file of sections, then `section.key=value`
overrides, into a checked `Config` (`planaria.runtime.config.sections`).

Values of overrides are parsed as YAML; a key of a sub-section, such as
`logging.wandb.mode`, is `section.sub.key=value`. Unknown keys and values of the wrong
type are refused with a message naming the key and the fix (a close match suggested);
the checks across keys run last (`planaria.runtime.config.validation`). With
`model.init_from`, the model keys left out are taken from the Hugging Face checkpoint's
config.json (`planaria.runtime.config.hf_config`).

Keys that moved to another section (`MOVED`: `parallel.timeout_s` is `comm.timeout_s`
now, ...) are still read where they were, for one release, with a warning that names
the new key.
"""
from __future__ import annotations

import difflib
import typing
import warnings
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from planaria.runtime.config.hf_config import derive_model_config
from planaria.runtime.config.sections import Config, ConfigError
from planaria.runtime.config.validation import check_config

SECTIONS = {f.name: f.default_factory for f in fields(Config)}
CHOICE_HINTS = {
    ("data", "dtype"): "use uint16 or uint32 for a headerless .bin, or leave it empty (a prepared corpus's "
                       "header says it)",
}
"""What to say of a closed set's choices where their names alone do not say enough."""
MOVED = {
    ("parallel", "backend"): ("comm", "backend"),
    ("parallel", "timeout_s"): ("comm", "timeout_s"),
    ("parallel", "heartbeat_timeout_s"): ("comm", "heartbeat_timeout_s"),
    ("parallel", "connect_timeout_s"): ("comm", "connect_timeout_s"),
    ("parallel", "fault_tolerance"): ("fault_tolerance", "f"),
    ("parallel", "audit_every"): ("audit", "every"),
    ("parallel", "audit_repair"): ("audit", "repair"),
}
"""Keys of an earlier release -> where they are now: read for one more release, with a warning."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found; give a YAML file such as configs/tiny.yaml")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); "
                              "give a YAML file such as configs/tiny.yaml") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections {sorted(SECTIONS)}")
    _move_old_keys(raw)  # before the overrides: an override of either name wins over the file
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(raw)
    if cfg.model.init_from:
        cfg = replace(cfg, model=derive_model_config(cfg.model, set(raw.get("model") or {})))
    return check_config(cfg)


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or key.count(".") not in (1, 2) or "" in key.split("."):
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=10 "
                          "(a sub-section's key: section.sub.key=value, e.g. logging.wandb.mode=offline)")
    section, *path, name = key.split(".")
    if not path and (section, name) in MOVED:
        section, name = _moved(section, name)
    if not isinstance(raw.setdefault(section, {}), dict):
        raise ConfigError(f"config section {section!r} must be a mapping")
    target = raw[section]
    for part in path:  # a sub-section (`logging.wandb`)
        if not isinstance(target.setdefault(part, {}), dict):
            raise ConfigError(f"override {item!r}: {section}.{part} is {target[part]!r}, not a sub-section "
                              "of keys")
        target = target[part]
    try:
        target[name] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)}); "
                          "quote it for the shell, e.g. 'parallel.layout=[[4],[2,2]]'") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's complaint on one line, with its line and column (1-based) where it has them."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _move_old_keys(raw: dict) -> None:
    """Keys of `MOVED` that a config file gives where they were: moved, with a warning
    naming the new key; given both ways in one file, refused."""
    for (section, key), (new_section, new_key) in MOVED.items():
        old = raw.get(section)
        if not isinstance(old, dict) or key not in old:
            continue
        target = raw.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # _build refuses the section
        if new_key in target:
            raise ConfigError(f"{section}.{key} and {new_section}.{new_key} are one setting, given twice; "
                              f"keep {new_section}.{new_key}")
        _moved(section, key)
        target[new_key] = old.pop(key)


def _moved(section: str, key: str) -> tuple[str, str]:
    """Where a key of `MOVED` is now, with the warning that says so."""
    new_section, new_key = MOVED[(section, key)]
    warnings.warn(f"config key {section}.{key} is now {new_section}.{new_key}; the old name is read "
                  "until the next release", FutureWarning, stacklevel=4)
    return new_section, new_key


def _build(raw: dict) -> Config:
    sections = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {name!r}{_suggest(name, SECTIONS)}; "
                              f"sections are {sorted(SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"config section {name!r} must be a mapping of keys to values")
        sections[name] = _build_section(name, SECTIONS[name], value)
    return replace(Config(), **sections)


def _build_section(section: str, factory, values: dict):
    """A section's dataclass from its mapping; a key whose default is itself a dataclass is
    a sub-section (`logging.wandb`), built the same way under its dotted name."""
    default = factory()
    known = {f.name: f for f in fields(default)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown config key {section}.{key}{_suggest(key, known)}; "
                              f"keys of {section!r} are {sorted(known)}")
    hints = typing.get_type_hints(type(default))
    coerced = {}
    for key, value in values.items():
        sub = getattr(default, key)
        if is_dataclass(sub):
            if not isinstance(value, dict):
                raise ConfigError(f"{section}.{key} must be a mapping of its keys {sorted(f.name for f in fields(sub))}"
                                  f", got {value!r}")
            coerced[key] = _build_section(f"{section}.{key}", type(sub), value)
        else:
            coerced[key] = _coerce(section, key, value, sub, hints[key])
    return replace(default, **coerced)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "a list", dict: "a mapping"}


def _coerce(section: str, key: str, value, default, hint=None):
    """Check `value` against the key's type: its default's, or for a key that defaults to
    None, the declared one (`float | None`: a number or nothing). YAML reads 1e-2 as a
    string, so a float key takes a string that parses as one."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{section}.{key} {value!r} is unknown{_suggest(str(value), choices)}; "
                              + CHOICE_HINTS.get((section, key), f"use one of {', '.join(map(repr, choices))}"))
        return value
    expected = type(default)
    if default is None:
        if value is None:
            return None
        expected = next(t for t in typing.get_args(hint) if t is not type(None))
        expected = typing.get_origin(expected) or expected
    if expected is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    ok = (isinstance(value, (int, float)) if expected is float else isinstance(value, expected))
    if not ok or (isinstance(value, bool) and expected is not bool):
        raise ConfigError(f"{section}.{key} must be {_TYPE_NAMES.get(expected, expected.__name__)}, "
                          f"got {value!r}")
    return float(value) if expected is float else value


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
