"""The detokenize stage: engine token events → lifecycle events with text.

Per choice: incremental UTF-8-safe decoding, stop strings held back until they can
no longer match, logprobs turned into the API's token texts and released together
with their text. A stop string ends the choice here (and the pipeline cancels its
sequence in the engine); the engine's own finish (EOS, stop ids, length, a cancel) ends it
otherwise. When every choice has finished, the request is ``Completed`` (``Incomplete``
when a choice stopped at its token limit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.events.types import (
    REQUEST,
    UNNUMBERED,
    ChoiceFinished,
    Completed,
    Delta,
    EngineEvent,
    ErrorInfo,
    Failed,
    FinishReason,
    Incomplete,
    InProgress,
    LifecycleEvent,
    PromptProcessed,
    SequenceFinished,
    TextLogprob,
    TokenLogprob,
    TokenSampled,
    Usage,
)

from .detokenizer import IncrementalDetokenizer
from .job import GenerationJob
from .stop_matcher import StopMatcher
from .token_text import TokenTexts


@dataclass(slots=True)
class _Choice:
    detok: IncrementalDetokenizer
    stops: StopMatcher
    prompt_ids: tuple[int, ...]
    prompt_text: str | None
    produced: int = 0  # chars decoded so far
    released: int = 0  # chars handed on (past the stop matcher)
    tokens: int = 0  # completion tokens seen
    unreleased_tokens: int = 0
    unreleased_ids: list[int] = field(default_factory=list)
    pending: list[tuple[int, TextLogprob]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False


class DetokenizeStage:
    """Folds one request's engine events into lifecycle events (not thread-safe)."""

    def __init__(
        self,
        job: GenerationJob,
        prompt_ids: list[tuple[int, ...]],
        tokenizer: Any,
        texts: TokenTexts,
        *,
        cancel_choice: Callable[[int], None],
    ) -> None:
        self.job = job
        self.texts = texts
        self.tokenizer = tokenizer
        self._cancel_choice = cancel_choice
        self._choices: list[_Choice] = []
        self._cut_short = False  # a choice finished on its token limit
        for p, ids in enumerate(prompt_ids):
            for _ in range(job.n):
                self._choices.append(
                    _Choice(
                        detok=IncrementalDetokenizer(
                            tokenizer, skip_special_tokens=job.skip_special_tokens, prompt_ids=ids
                        ),
                        stops=StopMatcher(job.stop, no_stop_trim=job.no_stop_trim),
                        prompt_ids=ids,
                        prompt_text=job.prompts[p].text,
                    )
                )
        self._open = len(self._choices)
        self.done = False

    def feed(self, events: list[EngineEvent]) -> list[LifecycleEvent]:
        out: list[LifecycleEvent] = []
        for i, event in enumerate(events):
            if self.done:
                break
            choice = self._choices[event.choice_index]
            if choice.finished:
                continue
            if isinstance(event, TokenSampled):
                # The engine reports a matched stop id right after the token, in the same
                # batch; like SGLang, that token's text is trimmed unless no_stop_trim.
                after = events[i + 1] if i + 1 < len(events) else None
                trim = (
                    not self.job.no_stop_trim
                    and isinstance(after, SequenceFinished)
                    and after.choice_index == event.choice_index
                    and after.reason == "stop"
                    and after.matched_token == event.token_id
                )
                self._on_token(event, choice, out, trim=trim)
            elif isinstance(event, PromptProcessed):
                self._on_prompt(event, choice, out)
            elif isinstance(event, SequenceFinished):
                self._on_finished(event, choice, out)
        return out

    # ----------------------------------------------------------------- handlers

    def _on_prompt(
        self, event: PromptProcessed, choice: _Choice, out: list[LifecycleEvent]
    ) -> None:
        choice.prompt_tokens = event.prompt_tokens
        choice.cached_tokens = event.cached_tokens
        rid, index = self.job.request_id, event.choice_index
        out.append(InProgress(rid, index, UNNUMBERED, event.prompt_tokens, event.cached_tokens))
        if self.job.echo:
            out.append(self._echo_delta(event, choice))

    def _echo_delta(self, event: PromptProcessed, choice: _Choice) -> Delta:
        ids = choice.prompt_ids
        entries: tuple[TextLogprob, ...] | None = None
        offsets: tuple[int, ...] | None = None
        if choice.prompt_text is not None:
            text = choice.prompt_text
        else:
            text = self.tokenizer.decode(
                list(ids), skip_special_tokens=self.job.skip_special_tokens
            )
        if self.job.show_logprobs and event.prompt_logprobs is not None:
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
            pos, starts = 0, []
            for token in ids:
                starts.append(pos)
                pos += len(detok.push(token))
            entries = tuple(
                self._text_logprob(token, lp)
                for token, lp in zip(ids, event.prompt_logprobs, strict=True)
            )
            offsets = tuple(min(s, len(text)) for s in starts)
        return Delta(
            self.job.request_id,
            event.choice_index,
            UNNUMBERED,
            text,
            token_count=0,
            logprobs=entries,
            is_prompt=True,
            token_offsets=offsets,
        )

    def _on_token(
        self, event: TokenSampled, choice: _Choice, out: list[LifecycleEvent], *, trim: bool
    ) -> None:
        choice.tokens += 1
        choice.unreleased_tokens += 1
        if self.job.show_token_ids:
            choice.unreleased_ids.append(event.token_id)
        piece = "" if trim else choice.detok.push(event.token_id)
        if self.job.show_logprobs:
            choice.pending.append(
                (choice.produced, self._text_logprob(event.token_id, event.logprob))
            )
        choice.produced += len(piece)
        if not piece:
            return
        result = choice.stops.feed(piece)
        self._release(event.choice_index, choice, result.text, out)
        if result.matched is not None:
            self._finish(event.choice_index, choice, "stop", result.matched, out)
            self._cancel_choice(event.choice_index)

    def _on_finished(
        self, event: SequenceFinished, choice: _Choice, out: list[LifecycleEvent]
    ) -> None:
        if event.error is not None:
            self._fail(ErrorInfo(event.error, "server_error", None, None, 500), out)
            return
        tail = choice.detok.flush()
        choice.produced += len(tail)
        result = choice.stops.feed(tail) if tail else None
        if result is not None and result.matched is not None:
            self._release(event.choice_index, choice, result.text, out, final=True)
            self._finish(event.choice_index, choice, "stop", result.matched, out)
            return
        text = (result.text if result else "") + choice.stops.flush()
        self._release(event.choice_index, choice, text, out, final=True)
        if choice.stops.matched is not None:  # a match held back until the end was final
            self._finish(event.choice_index, choice, "stop", choice.stops.matched, out)
            return
        # An abort without an error is a cancel: ``/abort_request``, or a client that left.
        reason: FinishReason = event.reason
        self._finish(event.choice_index, choice, reason, event.matched_token, out)

    # ------------------------------------------------------------------ helpers

    def _release(
        self,
        index: int,
        choice: _Choice,
        text: str,
        out: list[LifecycleEvent],
        *,
        final: bool = False,
    ) -> None:
        start = choice.released
        choice.released += len(text)
        entries: tuple[TextLogprob, ...] | None = None
        offsets: tuple[int, ...] | None = None
        if self.job.show_logprobs:
            # A token's logprob goes out with the text it starts; at the end every token
            # that starts before the (possibly stop-trimmed) end of the text goes out.
            limit = choice.released
            due = [(o, e) for o, e in choice.pending if o < limit or (final and o <= limit)]
            choice.pending = [] if final else choice.pending[len(due) :]
            entries = tuple(e for _, e in due)
            offsets = tuple(max(o - start, 0) for o, _ in due)
        if not text and not entries:
            return
        ids: tuple[int, ...] | None = None
        if self.job.show_token_ids:
            ids = tuple(choice.unreleased_ids)
            choice.unreleased_ids.clear()
        out.append(
            Delta(
                self.job.request_id,
                index,
                UNNUMBERED,
                text,
                token_count=choice.unreleased_tokens,
                logprobs=entries,
                token_offsets=offsets,
                token_ids=ids,
            )
        )
        choice.unreleased_tokens = 0

    def _finish(
        self,
        index: int,
        choice: _Choice,
        reason: FinishReason,
        matched: int | str | None,
        out: list[LifecycleEvent],
    ) -> None:
        choice.finished = True
        if choice.unreleased_ids:  # ids whose text was held back, trimmed or empty (EOS)
            ids, choice.unreleased_ids = tuple(choice.unreleased_ids), []
            count, choice.unreleased_tokens = choice.unreleased_tokens, 0
            out.append(Delta(self.job.request_id, index, UNNUMBERED, "", count, token_ids=ids))
        usage = Usage(choice.prompt_tokens, choice.tokens, choice.cached_tokens)
        out.append(ChoiceFinished(self.job.request_id, index, UNNUMBERED, reason, matched, usage))
        self._open -= 1
        self._cut_short = self._cut_short or reason == "length"
        if self._open == 0:
            self.done = True
            rid, usage = self.job.request_id, self.usage()
            if self._cut_short:
                out.append(Incomplete(rid, REQUEST, UNNUMBERED, usage, "length"))
            else:
                out.append(Completed(rid, REQUEST, UNNUMBERED, usage))

    def _fail(self, error: ErrorInfo, out: list[LifecycleEvent]) -> None:
        self.done = True
        out.append(Failed(self.job.request_id, REQUEST, UNNUMBERED, error))

    def usage(self) -> Usage:
        """Prompt (and cached) tokens count once per prompt, completions per choice."""
        firsts = self._choices[:: self.job.n]
        return Usage(
            prompt_tokens=sum(c.prompt_tokens for c in firsts),
            completion_tokens=sum(c.tokens for c in self._choices),
            cached_tokens=sum(c.cached_tokens for c in firsts),
        )

    def _text_logprob(self, token: int, lp: TokenLogprob | None) -> TextLogprob:
        texts = self.texts
        top = None
        if lp is not None:
            top = tuple((texts.text(t), v, texts.bytes(t)) for t, v in lp.top)
        ids = self.job.show_token_ids
        return TextLogprob(
            token=texts.text(token),
            logprob=None if lp is None else lp.logprob,
            bytes=texts.bytes(token),
            top=top,
            token_id=token if ids else None,
            top_ids=tuple(t for t, _ in lp.top) if ids and lp is not None else None,
        )
