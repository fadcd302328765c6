"""The one error type of the HTTP edge and its OpenAI envelope."""

from __future__ import annotations

from typing import Any

import orjson

from sluice.events.types import ErrorInfo

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """Any failure that reaches a client: a status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers or {}

    @classmethod
    def bad_request(
        cls, message: str, param: str | None = None, code: str | None = None
    ) -> ApiError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> ApiError:
        return cls(info.status, info.message, param=info.param, code=info.code, type=info.type)

    def to_info(self) -> ErrorInfo:
        return ErrorInfo(self.message, self.type, self.code, self.param, self.status)

    def body(self) -> dict[str, Any]:
        return error_body(self.to_info())

    def json(self) -> bytes:
        return orjson.dumps(self.body())


def error_body(info: ErrorInfo) -> dict[str, Any]:
    return {
        "error": {
            "message": info.message,
            "type": info.type,
            "param": info.param,
            "code": info.code,
        }
    }
