"""The engine boundary as bytes: what a front end and its engine worker processes
(``--dp-size``) send each other over one Unix socket per worker.

A frame is a 4-byte big-endian length and a JSON object (orjson) with the protocol
version ``v`` and its kind ``t``. Front end → worker: ``config`` (first: the engine
config, which the worker loads its model by), ``submit`` (the sequence specs of one
request), ``cancel``, ``flush``, ``stop``. Worker → front end: ``hello`` (once,
when its model is loaded: what the model says of itself), ``events`` (one per engine
step: every sequence's events of that step, and the engine's stats after it),
``flushed``. Engine events use the recordings' codec (``events.codec``), so a frame's
events are exactly what a recording holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

import orjson
import torch

from sluice.engine.attention import AttentionLayout
from sluice.engine.interface import EngineStats
from sluice.engine.model_facts import ModelFacts
from sluice.engine.params import Constraint, SamplingParams, SequenceSpec
from sluice.events.codec import event_from_dict, event_to_dict
from sluice.events.types import EngineEvent, PromptProcessed, SequenceFinished, TokenSampled

VERSION = 1
HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20  # a submit of 4 096 long prompts stays far below


class WireError(Exception):
    """A frame that is not this protocol's (another version, or garbage)."""


def frame(kind: str, **body: Any) -> bytes:
    payload = orjson.dumps({"v": VERSION, "t": kind, **body})
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next frame's message; ``IncompleteReadError`` when the peer closed."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return parse(await reader.readexactly(size))


def parse(payload: bytes) -> dict[str, Any]:
    """A frame's body (without its length prefix), checked for version and kind."""
    try:
        message = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"not a frame: {exc}") from None
    if not isinstance(message, dict) or message.get("v") != VERSION or "t" not in message:
        raise WireError(f"not a version {VERSION} frame")
    return message


# ---------------------------------------------------------------------------- specs


def spec_to_dict(spec: SequenceSpec) -> dict[str, Any]:
    sampling = dataclasses.asdict(spec.sampling)
    sampling["stop_token_ids"] = sorted(spec.sampling.stop_token_ids)
    return {
        "request_id": spec.request_id,
        "choice_index": spec.choice_index,
        "prompt_ids": list(spec.prompt_ids),
        "sampling": sampling,
    }


def spec_from_dict(data: dict[str, Any]) -> SequenceSpec:
    s = dict(data["sampling"])
    constraint = s.pop("constraint")
    sampling = SamplingParams(
        **{
            **s,
            "logit_bias": tuple((int(t), float(b)) for t, b in s["logit_bias"]),
            "stop_token_ids": frozenset(s["stop_token_ids"]),
            "constraint": None if constraint is None else Constraint(**constraint),
        }
    )
    return SequenceSpec(
        data["request_id"], data["choice_index"], tuple(data["prompt_ids"]), sampling
    )


def submit_frame(specs: Sequence[SequenceSpec]) -> bytes:
    return frame("submit", specs=[spec_to_dict(s) for s in specs])


# --------------------------------------------------------------------------- events


def events_frame(events: Sequence[EngineEvent], stats: EngineStats, received: int = 0) -> bytes:
    """A step's events and the engine's stats after it; ``received``: the sequences the
    worker has taken from ``submit`` frames since it started (what ``stats`` counts)."""
    counters = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    counters.pop("workers")  # a worker is one engine
    return frame("events", events=[event_to_dict(e) for e in events], stats=counters,
                 received=received)  # fmt: skip


def events_of(message: dict[str, Any]) -> tuple[list[EngineEvent], EngineStats]:
    events: list[EngineEvent] = []
    for data in message["events"]:
        event = event_from_dict(data)
        if not isinstance(event, PromptProcessed | TokenSampled | SequenceFinished):
            raise WireError(f"a worker sent a {type(event).__name__}, not an engine event")
        events.append(event)
    return events, stats_from_dict(message["stats"])


def received_of(message: dict[str, Any]) -> int:
    """An ``events`` frame's count of the sequences its worker had received."""
    return int(message.get("received", 0))


def stats_from_dict(data: dict[str, Any]) -> EngineStats:
    known = {f.name for f in dataclasses.fields(EngineStats)} - {"workers"}
    return EngineStats(**{k: v for k, v in data.items() if k in known})


# ---------------------------------------------------------------------------- hello


def facts_to_dict(facts: ModelFacts) -> dict[str, Any]:
    layout = facts.layout
    additive = layout.additive_dtype
    return {
        "architecture": facts.architecture,
        "context_length": facts.context_length,
        "eos_token_ids": sorted(facts.eos_token_ids),
        "bos_token_id": facts.bos_token_id,
        "adds_bos": facts.adds_bos,
        "layout": {
            "layer_types": list(layout.layer_types),
            "sliding_window": layout.sliding_window,
            "additive_dtype": None if additive is None else str(additive).removeprefix("torch."),
        },
        "quantization": facts.quantization,
    }


def facts_from_dict(data: dict[str, Any]) -> ModelFacts:
    layout = data["layout"]
    additive = layout["additive_dtype"]
    return ModelFacts(
        architecture=data["architecture"],
        context_length=data["context_length"],
        eos_token_ids=frozenset(data["eos_token_ids"]),
        bos_token_id=data["bos_token_id"],
        adds_bos=data["adds_bos"],
        layout=AttentionLayout(
            tuple(layout["layer_types"]),
            layout["sliding_window"],
            None if additive is None else getattr(torch, additive),
        ),
        quantization=data["quantization"],
    )
