"""What the HTTP layer knows about the server it fronts, and the server's phases."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
from aiohttp import web

from sluice.engine.model_facts import ModelFacts
from sluice.events.recorder import Recorder
from sluice.http.admission import RETRY_AFTER_S, Admission, shutting_down
from sluice.http.errors import ApiError
from sluice.http.metrics import Metrics
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.runner import PipelineContext

ABORT_GRACE_S = 5.0
"""After the drain timeout: how long aborted requests get to send their last frame."""


class ActiveRequests:
    """The generation requests in flight, by request id (SGLang's ``rid``), so that
    ``/abort_request`` can reach them and a ``rid`` is never in use twice."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    @contextmanager
    def track(self, request_id: str) -> Iterator[None]:
        if request_id in self.ids:
            raise ApiError.bad_request(f"Duplicate request id {request_id!r}", "rid")
        self.ids.add(request_id)
        try:
            yield
        finally:
            self.ids.discard(request_id)


@dataclass
class ServerState:
    pipeline: PipelineContext
    model_name: str
    recorder: Recorder | None = None
    chat: ChatSetup | None = None
    # What the served model says of itself (``/v1/models``); None without a model (replay).
    facts: ModelFacts | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    admission: Admission = field(default_factory=Admission)
    metrics: Metrics = field(default_factory=Metrics)
    active: ActiveRequests = field(default_factory=ActiveRequests)
    # The resolved server settings (``/server_info``): flags as the CLI settled them.
    settings: dict[str, object] = field(default_factory=dict)


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class Lifecycle:
    """Loading (503) → ready → draining (503). The app exists, and listens, before the
    model is loaded; handlers reach the state through ``state`` once it is.

    ``metrics`` is the registry of the whole server; the state records into it once ready.
    """

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.phase = Phase.LOADING
        self.loaded: ServerState | None = None

    @classmethod
    def serving(cls, state: ServerState) -> Lifecycle:
        """Ready at once (tests, replay)."""
        lifecycle = cls(state.metrics)
        lifecycle.ready(state)
        return lifecycle

    def ready(self, state: ServerState) -> None:
        state.metrics = self.metrics  # one registry per server
        self.loaded = state
        self.phase = Phase.READY

    @property
    def state(self) -> ServerState:
        if self.loaded is None:
            raise self.unavailable()
        return self.loaded

    def check_ready(self) -> None:
        if self.phase is not Phase.READY:
            raise self.unavailable()

    def unavailable(self) -> ApiError:
        if self.phase is Phase.DRAINING:
            return shutting_down()
        return ApiError(
            503,
            "The model is loading. Retry shortly.",
            code="model_loading",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests (503); let queued and running ones finish for ``grace_s``
        seconds, then end the rest: 503, or a stream's final error event."""
        self.phase = Phase.DRAINING
        if self.loaded is None:
            return
        admission = self.loaded.admission
        admission.close()
        with anyio.move_on_after(grace_s):
            await admission.wait_idle()
        admission.abort()
        with anyio.move_on_after(ABORT_GRACE_S):
            await admission.wait_idle()


LIFECYCLE_KEY = web.AppKey("sluice_lifecycle", Lifecycle)
