"""Plain HTTP for the tests that talk to routes no SDK covers (SGLang's native API,
the gateway's own endpoints): the standard library only, every status returned."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)


def _request(method: str, url: str, body: Any) -> urllib.request.Request:
    data = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    return urllib.request.Request(url, data=data, method=method, headers=headers)


def call(method: str, url: str, body: Any = None, timeout: float = 120) -> Reply:
    try:
        with urllib.request.urlopen(_request(method, url, body), timeout=timeout) as response:
            return Reply(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as error:
        return Reply(error.code, dict(error.headers), error.read())


def get(url: str, timeout: float = 120) -> Reply:
    return call("GET", url, timeout=timeout)


def post(url: str, body: Any = None, timeout: float = 120) -> Reply:
    return call("POST", url, body if body is not None else {}, timeout)


def sse_data(url: str, body: Any, timeout: float = 120) -> Iterator[str]:
    """The ``data:`` payloads of a POSTed SSE stream, as they arrive."""
    with urllib.request.urlopen(_request("POST", url, body), timeout=timeout) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data: "):
                yield line[len("data: ") :]
