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

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator
from pydantic.functional_validators import ModelWrapValidatorHandler

__all__ = ["ANSWER", "WireModel"]

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
