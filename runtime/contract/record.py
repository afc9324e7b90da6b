"""Frozen dataclasses that round-trip exactly through JSON, and the errors of reading one.

A record class derives from `JsonRecord`: `to_json()` writes it, `from_json(text)` reads
it back equal (floats keep every bit: JSON's repr round trip). Reading is strict: a value
of the wrong type, a missing field that has no default, or a field this version does
not know (written by a newer one) is refused with a `RecordError` naming the record and
the field. A field that an older version wrote under another name is read through the
class's `renamed` map (old name -> new name). Fields added later take their default
when an older record lacks them.

Validation and coercion are pydantic's (its `TypeAdapter` over plain dataclasses), so
tuples come back as tuples, nested records as records, and `Literal` fields refuse
values outside their set; the records themselves stay plain dataclasses.
"""
from __future__ import annotations

import functools
import json
from typing import Any, ClassVar, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

R = TypeVar("R", bound="JsonRecord")


class RecordError(ValueError):
    """A record that cannot be read; the message names the record and the field."""


class JsonRecord:
    """Mixin for frozen dataclasses exchanged as JSON (module docstring)."""

    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)
    renamed: ClassVar[dict[str, str]] = {}
    """Fields an older version wrote under another name: {old name: current name}."""

    def to_dict(self) -> dict[str, Any]:
        # None is left out: every field that may be None defaults to None, so the record
        # reads back equal, and logs do not carry "val_loss": null on every line.
        return _adapter(type(self)).dump_python(self, mode="json", exclude_none=True)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        if not isinstance(data, dict):
            raise RecordError(f"a {cls.__name__} record must be a JSON object, got {type(data).__name__}")
        data = {cls.renamed.get(key, key): value for key, value in data.items()}
        try:
            # JSON mode: arrays become the tuples the fields declare, ints stay ints.
            return _adapter(cls).validate_json(json.dumps(data))
        except ValidationError as err:
            raise RecordError(_describe(cls.__name__, err)) from None

    @classmethod
    def from_json(cls: type[R], text: str | bytes) -> R:
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RecordError(f"a {cls.__name__} record is not valid JSON ({err})") from None
        return cls.from_dict(data)


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def _describe(name: str, err: ValidationError) -> str:
    """One line per problem: `Record.field: what is wrong`."""
    problems = []
    for item in err.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(record)"
        if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            what = "unknown field (written by a newer version of Planaria?)"
        elif item["type"] == "missing":
            what = "missing (written by an older version of Planaria?)"
        else:
            what = item["msg"]
        problems.append(f"{name}.{field}: {what}")
    return "; ".join(problems)
