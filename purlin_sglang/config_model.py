"""The base of purlin's typed configuration models: strict, frozen, and failing with PurlinConfigError.

pydantic reports a bad key or value with its own ``ValidationError``; every model here turns it
into a :class:`~purlin_sglang.errors.PurlinConfigError` whose message names the key, says what is
accepted, and suggests the known key closest to a misspelt one. That holds for the constructor
(``PurlinConfig(timout_s=3)``), for assignment to a field of a frozen model, and for the
``from_dict`` / ``from_yaml`` readers, which call :func:`explain` with the file they read.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import PurlinConfigError


class _ConfigModelType(type(BaseModel)):  # type: ignore[misc]
    """Constructing a model (``Model(...)``) raises PurlinConfigError for a bad key or value.

    Here rather than in ``__init__``: pydantic calls an overridden ``__init__`` for nested models
    too, and would wrap the error of a nested section inside its own."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as e:
            raise PurlinConfigError(explain(e, cls.__name__, cls)) from None


class ConfigModel(BaseModel, metaclass=_ConfigModelType):
    """A frozen pydantic model that forbids unknown keys; a bad key or value raises PurlinConfigError."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise PurlinConfigError(explain(e, type(self).__name__, type(self))) from None


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The model that holds the last key of ``loc`` (nested sections are models too)."""
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field is not None else None
        if not isinstance(ann, type) or not issubclass(ann, BaseModel):
            break
        model = ann
    return model


def unknown_key(source: str, key: str, known: list[str]) -> str:
    """The message for an unknown key: the closest known key when one is close, then every known key."""
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{source}: unknown key '{key}' ({hint}known keys: {', '.join(known)})"


def explain(e: ValidationError, source: str, root: type[BaseModel]) -> str:
    """One line per bad key of ``e`` (raised by ``root`` or a model nested in it), joined with '; '."""
    lines = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(unknown_key(source, key, list(_model_at(root, err["loc"]).model_fields)))
        elif err["type"] == "frozen_instance":
            fix = (f"config.replace({key}=...) returns a changed copy" if root.__name__ == "PurlinConfig"
                   else f"build a new {root.__name__}(...)")
            lines.append(f"{source}: key '{key}' cannot be set: {root.__name__} is frozen; {fix}")
        else:
            lines.append(f"{source}: key '{key}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)
