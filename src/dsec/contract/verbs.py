"""A verb of the edge, declared once: what the HTTP route, the cluster forwarder and the
SDK's transport call are generated from.

A table verb takes one request model and returns one answer model::

    async def set_ttl(self, req: SetTTLRequest, owner: str) -> SandboxInfo

and its :class:`Verb` row (in :data:`dsec.contract.edge.VERBS`) says the rest: the HTTP
method and path, the status of a success, the ability protocol that declares it, and, by
the request model's base, whether it is **sandbox-scoped** (:class:`~dsec.models.SandboxRef`:
``sandbox_id`` is a path parameter, a cluster routes the call to the node the id names) or
**node-wide**. From a row:

* the apiserver mounts the route (:mod:`dsec.apiserver.verbs`): path parameters and, for a
  ``GET``, query parameters or, otherwise, a JSON body (and the row's :attr:`Verb.query`
  fields in the query), parsed into the request model once (a malformed one is a 400
  before the edge); an edge without the ability answers 422
  ``capability_not_supported`` (a sandbox-scoped verb checks the sandbox first: another
  key's is ``not_found``, as everywhere);
* a cluster relays the call to the sandbox's node (:mod:`dsec.cluster.edge`), within the
  call's own time budget plus a margin when the row reads one from the request (``timeout``);
* the SDK sends it (:meth:`dsec.sdk._http.HttpClient.call`) and reads the answer model.

A row may also name the body's model (``body_model``: a body kept under its name), the
route's (``route_name``: the ``operationId`` it had before its row) and the answer's headers
(``headers``: read from the answer model).

A verb that changes the sandbox's trajectory (``sequenced``) also takes the request's
:class:`Envelope`: the ``X-Dsec-Seq`` and ``Idempotency-Key`` headers, parsed once. A
node-wide verb that answers every key alike (``owned=False``: ``node_info``,
``capabilities``) is declared ``(req)`` without the owner; its route asks for a key all the
same, as every ``/v1`` route does.

A row names the edge method it calls (:attr:`Verb.call`, by default its own name), so several
rows may call one method: ``display_act`` is nine routes, ``POST .../display/move``,
``.../click`` and so on, each taking one kind of action as its body (:attr:`Verb.body_type`)
and the screen in its query (:attr:`Verb.query`).

Verbs whose request or answer is not one JSON document (raw uploads and downloads, streams
of events, TCP connections) keep routes of their own; they are declared on the ability
protocols all the same.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, TypeAdapter

from dsec.models import SandboxRef

__all__ = [
    "IDEMPOTENCY_KEY_PATTERN",
    "NO_ENVELOPE",
    "REPLAYED_HEADER",
    "Envelope",
    "HttpMethod",
    "Verb",
    "VerbTable",
]

HttpMethod = Literal["GET", "POST", "PUT", "PATCH", "DELETE"]


@dataclass(frozen=True)
class Envelope:
    """The trajectory headers of one state-changing call (both optional; see
    :mod:`dsec.contract.edge` on the trajectory log)."""

    seq: int | None = None
    idem_key: str | None = None


NO_ENVELOPE = Envelope()

IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,256}$"
"""An ``Idempotency-Key``: 1-256 printable ASCII characters, no space."""

REPLAYED_HEADER = "X-Dsec-Replayed"
"""Answer header, ``1`` when the edge answered a sequenced call from the trajectory log
(nothing ran)."""

_PATH_PARAM = re.compile(r"\{([a-z_]+)(?::path)?\}")
"""A path parameter: ``{name}``, or ``{name:path}`` for one whose value may hold ``/``
(an image reference such as ``127.0.0.1:5000/team/app:1``)."""


@dataclass(frozen=True)
class Verb:
    """One row of the verb table. ``path`` is under ``/v1``; its ``{name}`` parameters are
    fields of ``request``. ``ability``: the protocol that declares the method (``EdgeAPI``
    for the verbs every edge has). ``owned``: whether the method takes the caller's owner
    id (``False``: a node-wide answer, the same for every key). ``undo(edge, answer,
    owner, env)``: what takes back an answer whose client left before reading it (a
    creation's sandbox is killed; the route runs such a verb under
    :func:`dsec.apiserver.departed.unless_departed`). ``keyed``: the call takes an
    ``Idempotency-Key`` (no sequence number: a creation, whose sandbox does not exist yet),
    passed to the method and to ``undo`` as the :class:`Envelope` ``env``."""

    name: str
    request: type[BaseModel]
    answer: Any
    method: HttpMethod
    path: str
    ability: type
    summary: str
    description: str = ""
    status: int = 200
    sequenced: bool = False
    tag: str = "sandboxes"
    body: str | None = None
    """The request field whose value is the whole JSON body (not wrapped in an object of
    the request's fields): a body kept as it was before the verb had a request model."""
    sparse: bool = False
    """The answer leaves out the fields the edge did not set (``GET .../network`` of a
    sandbox without a network is ``{"enabled": false}``)."""
    operator_may: str = ""
    """What the request's ``system`` field lets the operator's key do to system images
    (``"remove"``, ``"publish"``): with ``system`` true the call acts as the system
    (:data:`dsec.models.SYSTEM_OWNER`), and any other key is refused (``PermissionDenied``)."""
    owned: bool = True
    undo: Callable[[Any, Any, str, Envelope], Awaitable[None]] | None = None
    keyed: bool = False
    body_model: type[BaseModel] | None = None
    """The model of the JSON body when one exists already (its fields are exactly the
    request's body fields): the body is parsed as it and documented under its name (exec's
    body is an :class:`~dsec.models.ExecRequest`, as the body of ``.../exec/stream``).
    Otherwise the body's model is generated from the request's fields."""
    route_name: str | None = None
    """The route's name (the OpenAPI ``operationId`` is made of it) when it is not the
    verb's: a route keeps the name it had before its row (exec's ``exec_command``), and
    clients generated from the document keep their method names."""
    headers: Callable[[Any], dict[str, str]] | None = None
    """The answer's HTTP headers, read from the answer (exec: ``X-Dsec-Replayed: 1`` on an
    answer from the trajectory log)."""
    timeout: Callable[[Any], float | None] | None = None
    """The call's own time budget in seconds, read from its request (exec: its command's
    ``timeout_s``): a relay of the call (the cluster's) waits that long plus its margin
    instead of its default call timeout. None: the call has no budget of its own."""
    call: str = ""
    """The edge method the row calls (by default the row's name; the method is declared on
    ``ability`` with ``request``). Several rows may call one method: ``display_act`` has a
    row per kind of action (``display_move``, ``display_click``...), each its own route."""
    query: tuple[str, ...] = ()
    """Request fields that travel in the query of a verb with a body (``POST``), not in the
    body: the display actions' ``?screen=``. (A ``GET`` or ``DELETE`` verb's fields all
    travel in the query.)"""
    body_type: Any = None
    """What the :attr:`body` field takes on this row's route, when that is narrower than the
    field's own type: one member of a union (``display_move``'s body is a ``Move``, not any
    ``DisplayAction``). The route documents and accepts that type; the request model still
    checks the whole request."""
    _answers: TypeAdapter[Any] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.call:
            object.__setattr__(self, "call", self.name)
        params = self.path_params
        unknown = set(params) - set(self.request.model_fields)
        if unknown:
            raise ValueError(f"verb {self.name}: path parameters {unknown} not in the request")
        if self.sandbox_scoped and "sandbox_id" not in self.path_params:
            raise ValueError(f"verb {self.name}: a sandbox verb's path names {{sandbox_id}}")
        if self.query and (
            self.in_query or not set(self.query) <= set(self.request.model_fields) - set(params)
        ):
            raise ValueError(
                f"verb {self.name}: query names request fields outside the path of a verb "
                "with a body"
            )
        if self.body is not None and (self.in_query or self.body_fields != (self.body,)):
            raise ValueError(f"verb {self.name}: a body field must be a body's only field")
        if self.body_type is not None and self.body is None:
            raise ValueError(f"verb {self.name}: body_type narrows a body field")
        if self.operator_may and "system" not in self.request.model_fields:
            raise ValueError(f"verb {self.name}: operator_may needs a system field")
        if self.body_model is not None and (
            self.in_query
            or self.body is not None
            or set(self.body_model.model_fields) != set(self.body_fields)
        ):
            raise ValueError(f"verb {self.name}: a body model holds the body fields, no more")
        if self.keyed and self.sequenced:
            raise ValueError(f"verb {self.name}: keyed (a creation) or sequenced, not both")
        if not self.owned and (self.sandbox_scoped or self.sequenced or self.keyed or self.undo):
            raise ValueError(f"verb {self.name}: a verb about a sandbox is told its owner")
        object.__setattr__(
            self, "_answers", TypeAdapter(self.answer) if self.answer is not None else None
        )

    @property
    def sandbox_scoped(self) -> bool:
        """Whether the call concerns one sandbox (routed by its id)."""
        return issubclass(self.request, SandboxRef)

    @property
    def path_params(self) -> tuple[str, ...]:
        return tuple(_PATH_PARAM.findall(self.path))

    @property
    def template(self) -> str:
        """The path as documented (OpenAPI): ``{name}`` for every parameter."""
        return _PATH_PARAM.sub(lambda m: "{" + m.group(1) + "}", self.path)

    @property
    def in_query(self) -> bool:
        """Whether the request's fields all travel in the query (``GET``, ``DELETE``: no
        body)."""
        return self.method in ("GET", "DELETE")

    @property
    def query_fields(self) -> tuple[str, ...]:
        """The request's fields that travel in the query: all but the path's of a ``GET``
        or ``DELETE``, the :attr:`query` fields of a verb with a body."""
        if not self.in_query:
            return self.query
        params = set(self.path_params)
        return tuple(f for f in self.request.model_fields if f not in params)

    @property
    def body_fields(self) -> tuple[str, ...]:
        """The request's fields that travel in the JSON body (none for a ``GET``)."""
        if self.in_query:
            return ()
        outside = {*self.path_params, *self.query}
        return tuple(f for f in self.request.model_fields if f not in outside)

    def url(self, req: BaseModel) -> str:
        """The request's path, under ``/v1``."""
        values = {p: quote(str(getattr(req, p)), safe=":") for p in self.path_params}
        return "/v1" + _PATH_PARAM.sub(lambda m: values[m.group(1)], self.path)

    def params(self, req: BaseModel) -> dict[str, Any]:
        """The request's query fields, as JSON values (unset defaults left out: the
        server's defaults apply)."""
        fields = set(self.query_fields)
        return req.model_dump(mode="json", include=fields, exclude_unset=True) if fields else {}

    def wire(self, req: BaseModel) -> Any:
        """The request's JSON body: its body fields, as JSON values (unset defaults left
        out), or a :attr:`body` verb's body field alone, whole; None for a verb without a
        body."""
        if self.in_query:
            return None
        if self.body is not None:
            return req.model_dump(mode="json", include={self.body})[self.body]
        return req.model_dump(mode="json", include=set(self.body_fields), exclude_unset=True)

    def read_answer(self, data: Any, context: dict[str, Any] | None = None) -> Any:
        """The answer model of a JSON answer (None for a verb that answers nothing)."""
        if self._answers is None:
            return None
        return self._answers.validate_python(data, context=context)


class VerbTable:
    """The verb rows by name (each name once)."""

    def __init__(self, *verbs: Verb) -> None:
        self._verbs: dict[str, Verb] = {}
        for v in verbs:
            if v.name in self._verbs:
                raise ValueError(f"verb {v.name} declared twice")
            self._verbs[v.name] = v

    def __getitem__(self, name: str) -> Verb:
        return self._verbs[name]

    def __iter__(self) -> Any:
        return iter(self._verbs.values())

    def __contains__(self, name: object) -> bool:
        return name in self._verbs

    def names(self) -> frozenset[str]:
        return frozenset(self._verbs)

    def calls(self) -> frozenset[str]:
        """The edge methods the rows call (a method several rows call is named once)."""
        return frozenset(v.call for v in self._verbs.values())
