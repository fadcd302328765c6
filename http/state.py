"""What the HTTP layer knows about the server it fronts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from sluice.events.recorder import Recorder
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.runner import PipelineContext


@dataclass
class ServerState:
    pipeline: PipelineContext
    model_name: str
    model_root: str
    recorder: Recorder | None = None
    chat: ChatSetup | None = None
    started: int = field(default_factory=lambda: int(time.time()))


STATE_KEY = web.AppKey("sluice_state", ServerState)
