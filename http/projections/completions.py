"""The completions projection: lifecycle events → ``text_completion`` chunks, and the
unary response as the fold of the very same chunks.

``CompletionStream.project(batch)`` turns one engine step's worth of events into
chunks (one per choice that changed, a choice's finish merged into its last text);
``fold_chunks`` accumulates chunks exactly as a client would, so the unary body is
by construction what the stream adds up to.
"""

from __future__ import annotations

from typing import Any

from sluice.events.types import Delta, TextLogprob, Usage

from .base import ChoiceCounts, Chunk, ChunkProjection, fold


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _top_map(entry: TextLogprob) -> dict[str, float] | None:
    """OpenAI's ``{token: logprob}`` of the alternatives plus the chosen token."""
    if entry.top is None:
        return None
    top: dict[str, float] = {}
    for text, logprob, _ in entry.top:
        top.setdefault(text, logprob)  # best first: a duplicate text keeps its best
    if entry.logprob is not None:
        top.setdefault(entry.token, entry.logprob)
    return top


class CompletionStream(ChunkProjection):
    object_name = "text_completion"

    def usage_body(self, usage: Usage) -> dict[str, Any]:
        return usage_body(usage)

    def new_part(self, index: int) -> dict[str, Any]:
        part: dict[str, Any] = {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
        }
        if self.want_logprobs:
            part["logprobs"] = {
                "tokens": [],
                "token_logprobs": [],
                "top_logprobs": [],
                "text_offset": [],
            }
        return part

    def add_delta(self, part: dict[str, Any], delta: Delta, counts: ChoiceCounts) -> None:
        base = counts.chars_sent
        if self.want_logprobs and delta.logprobs is not None:
            lp = part["logprobs"]
            offsets = delta.token_offsets or (0,) * len(delta.logprobs)
            for item, offset in zip(delta.logprobs, offsets, strict=True):
                lp["tokens"].append(item.token)
                lp["token_logprobs"].append(item.logprob)
                lp["top_logprobs"].append(_top_map(item))
                lp["text_offset"].append(base + offset)
        part["text"] += delta.text


def _new_choice(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
        "matched_stop": None,
    }


def _merge(acc: dict[str, Any], part: dict[str, Any]) -> None:
    acc["text"] += part["text"]
    if part["logprobs"] is not None:
        if acc["logprobs"] is None:
            acc["logprobs"] = {k: [] for k in part["logprobs"]}
        for key, values in part["logprobs"].items():
            acc["logprobs"][key].extend(values)


def fold_chunks(chunks: list[Chunk], usage: Usage | None) -> dict[str, Any]:
    """The unary ``text_completion``: the stream's chunks accumulated per choice."""
    return fold(
        chunks,
        object_name="text_completion",
        new_choice=_new_choice,
        merge=_merge,
        usage=usage_body(usage) if usage is not None else None,
    )


def select_best_of(
    body: dict[str, Any], *, n: int, best_of: int, keep_logprobs: bool
) -> dict[str, Any]:
    """Keep, per prompt, the ``n`` of ``best_of`` candidates with the highest cumulative
    logprob, re-indexed in OpenAI's order (prompt_index × n + j)."""
    candidates = body["choices"]
    chosen: list[dict[str, Any]] = []
    for p in range(len(candidates) // best_of):
        group = candidates[p * best_of : (p + 1) * best_of]
        ranked = sorted(
            group,
            key=lambda c: sum(lp for lp in c["logprobs"]["token_logprobs"] if lp is not None),
            reverse=True,
        )
        for j, choice in enumerate(ranked[:n]):
            choice = {**choice, "index": p * n + j}
            if not keep_logprobs:
                choice["logprobs"] = None
            chosen.append(choice)
    return {**body, "choices": chosen}
