"""SGLang's native ``POST /generate``: the decoded JSON body → a validated request.

The body is SGLang's ``GenerateReqInput``: ``text`` or ``input_ids`` (one prompt or a
batch), ``sampling_params`` with SGLang's names (``max_new_tokens``,
``min_new_tokens``, ``sampling_seed``, …), and the logprob options. The fields SGLang's
gateway (SMG) adds when it forwards a request (``model``, ``log_metrics``, ``no_logs``,
``background``, ``return_bytes``, ``return_entropy``) are read too: their defaults are
what Sluice does; any other value is refused, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.params import SamplingParams
from sluice.http.protocol.common import (
    read_sampling,
    read_stop,
    refuse_decoding_options,
    refuse_priority,
)
from sluice.http.protocol.completions import MAX_CHOICES, MAX_LOGPROBS, MAX_N, Prompt
from sluice.http.protocol.fields import Fields, type_error
from sluice.http.protocol.structured import read_completion_constraint

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
UNKNOWN_MODEL = "unknown"
"""The ``model`` SMG sends on a ``/generate`` that named none: any worker serves it."""

# Top-level switches whose SGLang default is the only behaviour Sluice has.
_DEFAULT_ONLY = {
    "log_metrics": True,
    "no_logs": False,
    "background": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_hidden_states": False,
}


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """``prompts``: one entry per prompt; ``batch``: the body gave a list of prompts (or
    ``n > 1``), so the answer is a list of outputs rather than one object."""

    prompts: tuple[Prompt, ...]
    batch: bool
    sampling: SamplingParams
    n: int
    stop: tuple[str, ...]
    no_stop_trim: bool
    skip_special_tokens: bool
    rid: str | None
    stream: bool
    model: str | None
    return_logprob: bool
    # First prompt position whose logprob is returned; None: no prompt logprobs (-1).
    logprob_start_len: int | None
    top_logprobs_num: int
    return_text_in_logprobs: bool


def parse_generate_request(body: object) -> GenerateRequest:
    """Validate a decoded ``/generate`` body; raise a 400 ``ApiError`` naming the field."""
    fields = Fields.of_body(body)
    prompts, batch = _read_prompts(fields)
    params = fields.object("sampling_params") or Fields({}, "sampling_params")
    max_new_tokens = params.integer("max_new_tokens", DEFAULT_MAX_NEW_TOKENS, minimum=0)
    n = params.integer("n", 1, minimum=1, maximum=MAX_N)
    if n * len(prompts) > MAX_CHOICES:
        raise params.error(
            "n", f"n × the number of prompts must be at most {MAX_CHOICES}, got {n} × "
            f"{len(prompts)}"
        )  # fmt: skip
    return_logprob = fields.boolean("return_logprob", False)
    start = fields.integer("logprob_start_len", -1, minimum=-1)
    top_logprobs_num = fields.integer("top_logprobs_num", 0, minimum=0, maximum=MAX_LOGPROBS)
    if fields.take("token_ids_logprob") is not None:
        raise fields.error("token_ids_logprob", "token_ids_logprob is not supported")
    text_in_logprobs = fields.boolean("return_text_in_logprobs", False)
    if not return_logprob:  # each shapes logprobs that would not be returned
        for name, asked in (("logprob_start_len", start != -1),
                            ("top_logprobs_num", top_logprobs_num != 0),
                            ("return_text_in_logprobs", text_in_logprobs)):  # fmt: skip
            if asked:
                raise fields.error(name, f"{name} needs return_logprob: true")
    logprob_start_len = start if return_logprob and start >= 0 else None
    sampling = read_sampling(
        params,
        max_tokens=max_new_tokens,
        logprobs=top_logprobs_num if return_logprob else None,
        prompt_logprobs=top_logprobs_num if logprob_start_len is not None else None,
        constraint=read_completion_constraint(params),
        max_tokens_name="max_new_tokens",
        min_tokens_name="min_new_tokens",
        seed_name="sampling_seed",
    )
    stop = read_stop(params)
    no_stop_trim = params.boolean("no_stop_trim", False)
    skip_special_tokens = params.boolean("skip_special_tokens", True)
    refuse_decoding_options(params)
    params.finish()
    for name, default in _DEFAULT_ONLY.items():
        if fields.boolean(name, default) != default:
            raise fields.error(name, f"{name}={str(not default).lower()} is not supported")
    request = GenerateRequest(
        prompts=prompts,
        batch=batch or n > 1,
        sampling=sampling,
        n=n,
        stop=stop,
        no_stop_trim=no_stop_trim,
        skip_special_tokens=skip_special_tokens,
        rid=fields.string("rid"),
        stream=fields.boolean("stream", False),
        model=fields.string("model"),
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=text_in_logprobs,
    )
    refuse_priority(fields)
    fields.finish()
    return request


def _read_prompts(fields: Fields) -> tuple[tuple[Prompt, ...], bool]:
    """``text`` (a string or a list of them) or ``input_ids`` (a list of ids or a list of
    such lists): exactly one of them. The flag says whether it was a batch."""
    text, ids = fields.take("text"), fields.take("input_ids")
    if (text is None) == (ids is None):
        # Both given: ``input_ids`` is the one that came on top of the usual ``text``.
        extra = "text" if text is None else "input_ids"
        raise fields.error(extra, "Either text or input_ids must be given, and not both.")
    prompts: list[Prompt]
    if text is not None:
        if isinstance(text, str):
            prompts, batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, batch = list(text), True
        else:
            raise type_error(fields.param("text"), "a string or an array of strings", text)
    else:
        if not isinstance(ids, list) or not ids:
            raise type_error(
                fields.param("input_ids"), "an array of token ids or of arrays of them", ids
            )
        batch = all(isinstance(item, list) for item in ids)
        prompts = [_token_ids(fields, item) for item in ids] if batch else [_token_ids(fields, ids)]
    if any(len(prompt) == 0 for prompt in prompts):
        raise fields.error("text" if text is not None else "input_ids", "Prompt cannot be empty")
    return tuple(prompts), batch


def _token_ids(fields: Fields, items: object) -> tuple[int, ...]:
    if not isinstance(items, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items
    ):
        raise fields.error("input_ids", "input_ids must be token ids (integers of at least 0)")
    return tuple(items)
