"""The parse-fold stage: where reasoning and tool-call parsers split a choice's text
into content, reasoning and tool calls.

No parser is configured yet, so content deltas pass through unchanged; the stage
exists so that every projection already reads the stream it will read then.
"""

from __future__ import annotations

from sluice.events.types import LifecycleEvent


class ParseFoldStage:
    def feed(self, events: list[LifecycleEvent]) -> list[LifecycleEvent]:
        return events
