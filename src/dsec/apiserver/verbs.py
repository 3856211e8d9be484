"""The routes of the verb table (:data:`dsec.contract.edge.VERBS`), generated: one per row.

Each route parses its path parameters and its query (``GET``) or JSON body (other methods;
a row's ``query`` fields from the query all the same) into the verb's request model once (a
malformed request: 400 before the edge), calls the edge method the row names (``call``:
several rows may call one), reads the
trajectory headers of a ``sequenced`` verb into an :class:`~dsec.contract.verbs.Envelope`,
checks that the edge has the verb's ability (422 ``capability_not_supported`` otherwise;
for a sandbox verb only after the sandbox was found, so another key's is ``not_found``), and
answers the edge's answer model (with the headers the row reads from it). Every route asks
for a key (the router's dependency); a node-wide verb that answers every key alike
(``owned=False``) is called without it. The OpenAPI schema documents each as a hand-written
route would: summary, description, parameters, body schema, answer schema, errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError, create_model

from dsec.apiserver.departed import unless_departed
from dsec.apiserver.deps import (
    ERROR_RESPONSES,
    CreateKey,
    Edge,
    Owner,
    Seq,
    acting_owner,
    current_owner,
)
from dsec.apiserver.schemas import IMAGE_REF_PATTERN, JOB_PATTERN, SANDBOX_ID_PATTERN
from dsec.contract.edge import VERBS, EdgeAPI
from dsec.contract.verbs import NO_ENVELOPE, Envelope, Verb
from dsec.errors import CapabilityNotSupported
from dsec.models import BUILD_ID_PATTERN, SandboxRef
from dsec.wire import WireModel

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(current_owner)], responses=ERROR_RESPONSES)

_PATH_PARAMS: dict[str, Any] = {
    "sandbox_id": Path(pattern=SANDBOX_ID_PATTERN, description="sb-<node>-<random>"),
    "job": Path(pattern=JOB_PATTERN, description="the job id given at creation"),
    "action": Path(description="pause | resume | kill"),
    "name": Path(
        pattern=IMAGE_REF_PATTERN,
        description="name[:tag], sha256:<hex>, or a pulled reference (host:port/repo:tag)",
    ),
    "build_id": Path(min_length=1, max_length=64, pattern=BUILD_ID_PATTERN),
}
"""How each path parameter a verb may name is checked (a new one is added here)."""


def _body_model(verb: Verb) -> type[BaseModel]:
    """The request model without its path and query parameters: what the JSON body holds
    (strict as every request: an unknown field is refused). The request model's own
    validators run when the route builds the request from it. A verb whose every field is
    in the body: the request model itself (its schema keeps its name), as does a row's
    ``body_model``."""
    if verb.body_model is not None:
        return verb.body_model
    if not verb.path_params and not verb.query_fields:
        return verb.request
    fields: dict[str, Any] = {
        name: (f.annotation, f)
        for name, f in verb.request.model_fields.items()
        if name in verb.body_fields
    }
    model: type[BaseModel] = create_model(
        f"{verb.request.__name__}Body", __base__=WireModel, __doc__=verb.request.__doc__, **fields
    )
    return model


def _parameters(verb: Verb) -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter(
            name,
            kw,
            annotation=Annotated[verb.request.model_fields[name].annotation, _PATH_PARAMS[name]],
        )
        for name in verb.path_params
    ]
    for name in verb.query_fields:
        f = verb.request.model_fields[name]
        default = (
            inspect.Parameter.empty if f.is_required() else f.get_default(call_default_factory=True)
        )
        params.append(
            inspect.Parameter(
                name,
                kw,
                annotation=Annotated[  # the field's constraints (bounds, lengths) kept
                    f.annotation,
                    *f.metadata,
                    Query(description=f.description, json_schema_extra=f.json_schema_extra),
                ],
                default=default,
            )
        )
    if verb.body is not None:
        f = verb.request.model_fields[verb.body]
        kind = verb.body_type if verb.body_type is not None else f.annotation
        params.append(inspect.Parameter("body", kw, annotation=Annotated[kind, Body()]))
    elif verb.body_fields:
        body = _body_model(verb)
        # a verb about a path's object may leave out a body of defaults; otherwise the body
        # is the request and is required
        optional = bool(verb.path_params) and all(
            not verb.request.model_fields[n].is_required() for n in verb.body_fields
        )
        params.append(
            inspect.Parameter(
                "body",
                kw,
                annotation=Annotated[body | None if optional else body, Body()],
                default=None if optional else inspect.Parameter.empty,
            )
        )
    if verb.operator_may or verb.undo is not None:
        params.append(inspect.Parameter("request", kw, annotation=Request))
    if verb.headers is not None:
        params.append(inspect.Parameter("response", kw, annotation=Response))
    params.append(inspect.Parameter("edge", kw, annotation=Edge))
    params.append(inspect.Parameter("owner", kw, annotation=Owner))
    if verb.sequenced:
        params.append(inspect.Parameter("seq", kw, annotation=Seq))
    if verb.keyed:
        params.append(inspect.Parameter("key", kw, annotation=CreateKey))
    return params


def _parse(verb: Verb, values: dict[str, Any]) -> BaseModel:
    body = values.pop("body", None)
    if isinstance(body, verb.request):  # the body was the whole request, checked already
        return body
    data = {n: values[n] for n in (*verb.path_params, *verb.query_fields)}
    if verb.body is not None:
        data[verb.body] = body
    elif isinstance(body, BaseModel):
        data.update(body.model_dump(exclude_unset=True))
    try:
        return verb.request.model_validate(data)
    except ValidationError as e:  # what the request model's own validators refuse: a 400
        raise RequestValidationError(e.errors()) from None


def _endpoint(verb: Verb) -> Callable[..., Awaitable[Any]]:
    async def endpoint(**values: Any) -> Any:
        edge: EdgeAPI = values.pop("edge")
        owner: str = values.pop("owner")
        seq: Envelope | None = values.pop("seq", None)
        key: Envelope = values.pop("key", None) or NO_ENVELOPE
        request: Request | None = values.pop("request", None)
        response: Response | None = values.pop("response", None)
        req = _parse(verb, values)
        if request is not None and verb.operator_may:  # its request has ``system``
            owner = acting_owner(request, owner, getattr(req, "system", False), verb.operator_may)
        # an edge is an EdgeAPI (the dependency's type); an optional ability is checked
        if verb.ability is not EdgeAPI and not isinstance(edge, verb.ability):
            # another key's sandbox: not found (an edge that cannot look sandboxes up, a
            # stand-in for one ability, says what it lacks)
            if isinstance(req, SandboxRef) and isinstance(edge, EdgeAPI):
                await edge.get_sandbox(SandboxRef(sandbox_id=req.sandbox_id), owner)
            raise CapabilityNotSupported(f"this server's edge cannot {verb.call}")
        call = getattr(edge, verb.call)
        if verb.sequenced:
            answer = await call(req, owner, seq or NO_ENVELOPE)
        elif verb.undo is not None and request is not None:
            undo = verb.undo
            made = call(req, owner, key) if verb.keyed else call(req, owner)
            answer = await unless_departed(
                request, made, lambda answer: undo(edge, answer, owner, key)
            )
        elif verb.keyed:
            answer = await call(req, owner, key)
        else:
            answer = await (call(req, owner) if verb.owned else call(req))
        headers = verb.headers(answer) if verb.headers is not None else {}
        if verb.answer is None:
            return Response(status_code=verb.status, headers=headers)
        if response is not None:
            response.headers.update(headers)
        return answer

    endpoint.__name__ = endpoint.__qualname__ = verb.name
    endpoint.__doc__ = verb.description or None
    endpoint.__signature__ = inspect.Signature(_parameters(verb))  # type: ignore[attr-defined]
    return endpoint


for _verb in VERBS:
    router.add_api_route(
        "/v1" + _verb.path,
        _endpoint(_verb),
        methods=[_verb.method],
        status_code=_verb.status,
        response_model=_verb.answer,
        response_model_exclude_unset=_verb.sparse,
        response_class=Response if _verb.answer is None else JSONResponse,
        summary=_verb.summary,
        description=_verb.description or None,
        tags=[_verb.tag],
        name=_verb.route_name or _verb.name,
    )
