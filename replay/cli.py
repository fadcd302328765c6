"""``replay FILE…``: re-run recorded sessions through the pipeline, no model needed.

Each recording's engine events stand in for the engine; the request body goes
through the same route code as a live request. The run passes when the response
bytes and status, and every lifecycle event, are identical to the recording.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from sluice.engine.loader import ModelLoadError, load_tokenizer, resolve_model
from sluice.events.recorder import MemoryRecorder, Recording
from sluice.http.errors import ApiError
from sluice.http.output import BufferOutput
from sluice.http.routes import chat, completions, native, responses
from sluice.http.state import ServerState
from sluice.logging import configure_logging
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.chat_template import TemplateConfigError
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts

from .backend import ReplayEngine


@dataclass(frozen=True)
class ReplayResult:
    path: Path
    status: int
    output: bytes
    matches: bool
    detail: str


ROUTES = {
    completions.ROUTE: completions.run_completion,
    chat.ROUTE: chat.run_chat,
    responses.ROUTE: responses.run_responses,
    native.ROUTE: native.run_generate,
}


async def replay_recording(
    recording: Recording, tokenizer: Any, texts: TokenTexts, chat_setup: ChatSetup | None = None
) -> tuple[int, bytes]:
    """Re-run one recording; returns the status and bytes the route produced."""
    replayed = await rerun(recording, tokenizer, texts, chat_setup)
    return replayed.status, replayed.output


async def rerun(
    recording: Recording, tokenizer: Any, texts: TokenTexts, chat_setup: ChatSetup | None = None
) -> Recording:
    """Re-run one recording; returns what the re-run recorded (status, bytes, lifecycle
    events).

    A recording made with chat flags (template, parsers) replays with those flags."""
    if recording.server:
        chat_setup = ChatSetup.for_tokenizer(
            recording.server.get("chat_template"),
            tokenizer,
            tool_call_parser=recording.server.get("tool_call_parser"),
            reasoning_parser=recording.server.get("reasoning_parser"),
        )
    engine = ReplayEngine(
        {recording.request_id: recording.engine_batches}, recording.context_length
    )
    pipeline = PipelineContext(engine, tokenizer, texts, recording.context_length)
    recorder = MemoryRecorder()
    state = ServerState(pipeline, recording.model_name, recorder, chat=chat_setup)
    output = BufferOutput()
    run = ROUTES.get(recording.route)
    if run is None:
        raise ValueError(f"replay does not know route {recording.route!r}")
    # Responses stamps completed_at from a clock: the recorded reading stands in for it.
    extra = responses.replay_options(recording) if run is responses.run_responses else {}
    try:
        await run(
            state,
            recording.body,
            output,
            request_id=recording.request_id,
            created=recording.created,
            **extra,
        )
    except ApiError as exc:
        if not recorder.saved:  # refused before the request's scope: nothing recorded
            return dataclasses.replace(
                recording, engine_batches=[], lifecycle_events=[], output=exc.json(),
                status=exc.status, clock=[],
            )  # fmt: skip
    (replayed,) = recorder.saved
    return replayed


def check(
    path: Path, tokenizer: Any, texts: TokenTexts, chat_setup: ChatSetup | None
) -> ReplayResult:
    recording = Recording.from_jsonl(path.read_bytes())
    replayed = anyio.run(rerun, recording, tokenizer, texts, chat_setup)
    status, output = replayed.status, replayed.output
    if status != recording.status:
        return ReplayResult(
            path, status, output, False, f"status {status} != recorded {recording.status}"
        )
    if output != recording.output:
        at = next(
            (i for i, (a, b) in enumerate(zip(output, recording.output, strict=False)) if a != b),
            min(len(output), len(recording.output)),
        )
        return ReplayResult(path, status, output, False, f"output differs from byte {at}")
    if replayed.lifecycle_events != recording.lifecycle_events:
        at = next(
            (i for i, (a, b) in enumerate(zip(replayed.lifecycle_events,
                                              recording.lifecycle_events, strict=False)) if a != b),
            min(len(replayed.lifecycle_events), len(recording.lifecycle_events)),
        )  # fmt: skip
        return ReplayResult(path, status, output, False, f"lifecycle event {at} differs")
    return ReplayResult(path, status, output, True, "identical")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replay", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="recordings (JSONL) or folders of them")
    parser.add_argument("--model-path", help="the model whose tokenizer the recording used")
    parser.add_argument("--chat-template", help="as the server's flag, for chat recordings")
    parser.add_argument("--print", action="store_true", help="print each replayed response")
    args = parser.parse_args(argv)
    configure_logging("console", "warning")
    try:
        tokenizer = load_tokenizer(resolve_model(args.model_path).folder)
        chat_setup = ChatSetup.for_tokenizer(args.chat_template, tokenizer)
    except (ModelLoadError, TemplateConfigError) as exc:
        print(f"replay: error: {exc}", file=sys.stderr)
        return 2
    texts = TokenTexts(tokenizer)
    paths = [p for f in args.files for p in (sorted(f.glob("*.jsonl")) if f.is_dir() else [f])]
    failed = 0
    for path in paths:
        result = check(path, tokenizer, texts, chat_setup)
        failed += not result.matches
        print(f"{'ok  ' if result.matches else 'FAIL'} {path}: {result.detail}")
        if args.print:
            print(result.output.decode("utf-8"))
    print(f"{len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
