"""The base of every wire model: strict on what a server accepts, lenient on what a client
reads, so that a newer server never breaks an older SDK.

* A server validates requests strictly: an unknown field is the client's mistake (a typo in
  a network policy must not pass silently) and answers 400.
* A client validates answers with :data:`ANSWER` as the validation context
  (``Model.model_validate(data, context=ANSWER)``): fields it does not know, at any depth,
  are dropped instead of refused. Enumerations that can grow (tiers, states, event types,
  layer kinds) are plain strings in answer models for the same reason; the server checks
  them where it receives them.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator
from pydantic.functional_validators import ModelWrapValidatorHandler

from dsec.errors import InvalidRequest

__all__ = ["ANSWER", "WireModel", "validated"]

ANSWER: dict[str, Any] = {"dsec.answer": True}
"""Validation context of a client reading a server's answer (unknown fields ignored)."""


class WireModel(BaseModel):
    """A request or answer of the dsec API (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _drop_newer_fields(
        cls, data: Any, handler: ModelWrapValidatorHandler[Any], info: ValidationInfo
    ) -> Any:
        if info.context is not None and isinstance(data, dict) and info.context.get("dsec.answer"):
            fields = cls.model_fields
            known = set(fields) | {f.alias for f in fields.values() if f.alias}
            if not known.issuperset(data):
                data = {k: v for k, v in data.items() if k in known}
        return handler(data)


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], **fields: Any) -> M:
    """``model(**fields)``, a refusal raised as ``InvalidRequest`` (400) naming each field
    and why: how code that builds a request from its own arguments (the SDK, the E2B layer)
    refuses bad input as the API would."""
    try:
        return model(**fields)
    except ValidationError as exc:
        errors = [
            {"loc": [str(p) for p in e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors()
        ]
        first = errors[0]
        raise InvalidRequest(f"{'.'.join(first['loc'])}: {first['msg']}", errors=errors) from None
