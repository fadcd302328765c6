"""The tokenize stage: prompts to token ids, checked against the model's limits.

It runs before any byte of a response is sent, so every problem it finds is a
plain HTTP 400, never an SSE error.
"""

from __future__ import annotations

from typing import Any

import anyio

from sluice.engine.params import SequenceSpec
from sluice.pipeline.errors import InvalidRequest

from .job import PROMPT_NAMES, FieldNames, GenerationJob
from .prompt_bounds import refuse_unfit, token_reach

# Tokenizing a long prompt takes milliseconds: do it off the event loop.
INLINE_CHARS = 4096


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text))


async def tokenize_prompts(
    tokenizer: Any, job: GenerationJob, context_length: int
) -> list[tuple[int, ...]]:
    """Token ids of each prompt of the job (text prompts tokenized, ids checked), once
    the job's own token ids (``logit_bias``, ``stop_token_ids``) are checked too: an id
    past the vocabulary would index past the logits inside the engine's step. A long
    text that cannot fit the context is refused before it is tokenized
    (``prompt_bounds``): megabytes of it would cost seconds and a gigabyte."""
    vocab = len(tokenizer)
    _check_sampling_ids(job, vocab)
    out: list[tuple[int, ...]] = []
    for prompt in job.prompts:
        if prompt.ids is not None:
            ids = prompt.ids
            bad = next((i for i in ids if i >= vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"Token id {bad} is out of vocabulary (the vocabulary has {vocab} tokens).",
                    param=job.names.prompt,
                )
        else:
            text = prompt.text or ""
            if len(text) > INLINE_CHARS:
                # A scan of the vocabulary the first time, cached after.
                reach = await anyio.to_thread.run_sync(token_reach, tokenizer)
                if reach is not None:
                    refuse_unfit(text, reach, context_length, job.names.prompt)
                ids = await anyio.to_thread.run_sync(_encode, tokenizer, text)
            else:
                ids = _encode(tokenizer, text)
        if not ids:
            raise InvalidRequest("Prompt cannot be empty", param=job.names.prompt)
        out.append(ids)
    return out


def _check_sampling_ids(job: GenerationJob, vocab: int) -> None:
    sampling, names = job.sampling, job.names
    for name, ids in (
        ("logit_bias", [token for token, _ in sampling.logit_bias]),
        ("stop_token_ids", sampling.stop_token_ids),
    ):
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"Token id {bad} in {name} is out of vocabulary (the vocabulary has {vocab} "
                "tokens).",
                param=names.sampling(name),
            )


def check_context(
    prompt_ids: tuple[int, ...],
    max_tokens: int,
    context_length: int,
    names: FieldNames = PROMPT_NAMES,
) -> None:
    """SGLang's context checks, with its messages and the token counts; each blames the
    field the client can change (``names``)."""
    n = len(prompt_ids)
    if n >= context_length:
        raise InvalidRequest(
            f"The input ({n} tokens) is longer than the model's context length "
            f"({context_length} tokens).",
            param=names.prompt,
            code="context_length_exceeded",
        )
    if n + max_tokens > context_length:
        raise InvalidRequest(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {n + max_tokens} tokens: "
            f"{n} tokens from the input messages and {max_tokens} tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion to "
            "fit within the limit.",
            param=names.max_tokens,
            code="context_length_exceeded",
        )


def sequence_specs(
    job: GenerationJob, prompt_ids: list[tuple[int, ...]], context_length: int
) -> list[SequenceSpec]:
    """n sequences per prompt; choice index = prompt_index × n + j (OpenAI's order)."""
    specs: list[SequenceSpec] = []
    for p, ids in enumerate(prompt_ids):
        check_context(ids, job.sampling.max_tokens, context_length, job.names)
        for j in range(job.n):
            specs.append(
                SequenceSpec(job.request_id, p * job.n + j, ids, job.sampling, job.routing_key)
            )
    return specs


def encode_segments(
    tokenizer: Any, segments: list[tuple[str, bool]], *, add_bos: bool = False
) -> tuple[int, ...]:
    """Token ids of a rendered chat prompt. Template markup is tokenized normally (its
    ``<|im_start|>`` is the control token); message text with special tokens split, so
    a user typing ``<|im_end|>`` gets the seven text tokens, never the control token."""
    ids: list[int] = []
    if add_bos and tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
    for text, is_template in segments:
        if text:
            ids.extend(
                tokenizer.encode(
                    text, add_special_tokens=False, split_special_tokens=not is_template
                )
            )
    return tuple(ids)
