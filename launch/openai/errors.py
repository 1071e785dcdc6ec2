"""One map from exceptions to HTTP errors for every route, by exception type.

A bad request is a ValueError: pydantic's validation errors, a `FieldError` raised where the
field is known (its `param` names it), the engine's prompt checks. Statuses: 400 for those,
401 `AuthenticationError`, 404 `UnknownModelError`, 409 `RebalanceError` (a move every rank
refused together: nothing changed, the old placement serves), 503 `EngineUnavailableError`
(loading, draining, dead), the framework's own `HTTPException` its status (404 no such route,
405 no such method, 400 a body that is not UTF-8), 500 anything else (a worker failure, a NaN
logprob: launch.strict_json's NonFiniteError, a sample ended by non-finite logits:
launch.generation's SampleFailedError). Never decided by a message's words.
Bodies are OpenAI's {"error": {"message", "type", "param", "code"}}: `code` is a string or
null as in OpenAI's API (never the HTTP status), chosen in the same table: "invalid_api_key"
(401), "model_not_found" (404), "context_length_exceeded" for a prompt, or a prompt and its
budget, past the context (`ContextLengthExceeded`), "rebalance_refused" (409), else null.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from launch.openai.render import ExactJSONResponse
from moe_runtime.engine.async_engine import EngineUnavailableError
from moe_runtime.engine.balancer import RebalanceError


class FieldError(ValueError):
    """A bad value of the request field `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(FieldError):
    """The prompt (`param` the prompt's field), or the prompt and the token budget (`param`
    the budget's field), do not fit the context."""


class UnknownModelError(FieldError):
    def __init__(self, model: str) -> None:
        super().__init__("model", f"model {model!r} does not exist")


class AuthenticationError(Exception):
    """A missing or wrong API key."""


# (type, HTTP status, OpenAI error type, OpenAI error code); the first matching row wins.
# The types and codes are OpenAI's where it has the case (its 404 for a model is an
# invalid_request_error coded model_not_found), so clients that key on them see the same.
_STATUS_BY_TYPE = (
    (AuthenticationError, 401, "authentication_error", "invalid_api_key"),
    (UnknownModelError, 404, "invalid_request_error", "model_not_found"),
    (ContextLengthExceeded, 400, "invalid_request_error", "context_length_exceeded"),
    (RequestValidationError, 400, "invalid_request_error", None),
    (ValueError, 400, "invalid_request_error", None),
    # A rank's own failure while staging (out of memory, say) votes the move down on every
    # rank: the engine is whole and serving, the state change refused (a retry may pass). A
    # move that broke the ranks (a failed collective) raises another type: a 500, the engine
    # rebuilding. openai's client raises its ConflictError for a 409.
    (RebalanceError, 409, "conflict_error", "rebalance_refused"),
    (EngineUnavailableError, 503, "unavailable", None),
    (Exception, 500, "internal_error", None),  # a worker failure
)


def error_status(exc: Exception) -> tuple[int, str, str | None]:
    """(HTTP status, OpenAI error type, OpenAI error code or None) of an exception."""
    if isinstance(exc, HTTPException):  # raised before any route ran: its status is the answer
        status = exc.status_code
        return status, "not_found_error" if status == 404 else "invalid_request_error", None
    return next(row[1:] for row in _STATUS_BY_TYPE if isinstance(exc, row[0]))


def error_body(exc: Exception) -> dict:
    status, kind, code = error_status(exc)
    if isinstance(exc, HTTPException):
        message, param = str(exc.detail), None
    elif isinstance(exc, RequestValidationError):
        message, param = describe_validation(exc.errors())
    elif status == 500:
        message, param = f"{type(exc).__name__}: {exc}", None
    else:
        message, param = str(exc), exc.param if isinstance(exc, FieldError) else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: Exception) -> JSONResponse:
    """The error's body and status; an engine that will serve again soon (rebuilding, stalled)
    says when in Retry-After (whole seconds), which clients such as openai's honour."""
    headers = None
    if isinstance(exc, EngineUnavailableError) and exc.retry_after_s is not None:
        headers = {"Retry-After": str(math.ceil(exc.retry_after_s))}
    return ExactJSONResponse(error_body(exc), status_code=error_status(exc)[0], headers=headers)


async def answer(response: Awaitable[Response]) -> Response:
    """The awaited response, or the error response for what it raised."""
    try:
        return await response
    except Exception as exc:
        return error_response(exc)


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """(message naming the field, param) from pydantic/FastAPI validation errors."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None
    if isinstance(first.get("input"), bytes):  # FastAPI parses JSON content types only
        return "the body must be JSON, sent with content-type: application/json", None
    messages, param = [], None
    for err in errors[:3]:
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        param = param or (loc[0] if loc else "body")
        detail = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        messages.append(f"{'.'.join(loc) or 'body'}: {detail}")
    return "; ".join(messages), param
