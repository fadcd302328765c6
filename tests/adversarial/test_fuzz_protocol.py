"""Property tests (hypothesis) over what decodes and validates request bodies, the stop
matcher and the SSE writer. Bounded and deterministic: a fixed number of examples drawn
from a fixed seed, no example database, so `make test` takes the same seconds every run."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.http.errors import ApiError
from sluice.http.json_body import decode_json_body
from sluice.http.protocol.chat import ROLES, parse_chat_request
from sluice.http.protocol.common import MAX_STOP
from sluice.http.protocol.completions import parse_completion_request
from sluice.http.protocol.fields import INT64_MAX, INT64_MIN
from sluice.http.sse import data_frame, data_frames
from sluice.pipeline.stop_matcher import StopMatcher
from tests.support.openapi import validate

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ------------------------------------------------------------------------ strategies


# Values at the edges of what JSON decodes to: Python's decoder yields unbounded ints and
# inf (from 1e400).
EXTREMES = [INT64_MIN - 1, INT64_MAX + 1, 2**64, 10**30, 1e308, float("inf"), -0.0, "\x00", ""]
extremes = st.sampled_from(EXTREMES)


def json_of(floats: st.SearchStrategy[float]) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.sampled_from([v for v in EXTREMES if not isinstance(v, float)])
        | floats
        | st.text(max_size=20)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
        ),
        max_leaves=20,
    )


json_values = json_of(st.floats(allow_nan=False))

SAMPLING_FIELDS = [
    "max_tokens", "n", "stream", "stream_options", "logprobs", "temperature", "top_p",
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "seed", "min_tokens", "stop_token_ids", "ignore_eos", "stop", "no_stop_trim",
    "skip_special_tokens", "user", "regex", "ebnf", "json_schema",
    "spaces_between_special_tokens", "stop_regex",
]  # fmt: skip
COMPLETION_FIELDS = [*SAMPLING_FIELDS, "prompt", "suffix", "echo", "best_of"]
CHAT_FIELDS = [
    *SAMPLING_FIELDS, "messages", "max_completion_tokens", "top_logprobs",
    "continue_final_message", "metadata", "reasoning_effort", "chat_template_kwargs",
    "separate_reasoning", "stream_reasoning", "functions", "function_call", "tools",
    "tool_choice", "parallel_tool_calls", "store", "response_format", "modalities",
    "service_tier", "audio", "prediction",
]  # fmt: skip

# Values near what each field wants, so that validation gets past the first field.
plausible = (
    json_values
    | st.integers(-3, 200)
    | st.floats(-3, 3)
    | st.sampled_from(["m", "", "text", "json_object", "auto", "high", "\n"])
    | st.lists(st.text(max_size=4), max_size=6)
    | st.lists(st.integers(-2, 70000), max_size=6)
    | st.dictionaries(st.sampled_from(["13", "-1", "x", "50000"]), st.floats(-200, 200))
    | st.fixed_dictionaries({"include_usage": st.booleans()})
    | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])})
    | extremes
    | st.lists(extremes, min_size=1, max_size=3)
    | st.dictionaries(st.sampled_from(["13", "x", "enable_thinking"]), extremes, min_size=1)
)

message_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "refusal", "image_url"])},
    optional={"text": json_values, "refusal": st.text(max_size=8)},
)
functions = st.fixed_dictionaries(
    {"name": st.text(max_size=5), "arguments": st.sampled_from(["{}", "[]", "{", '{"a":1}'])}
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"id": json_values, "function": json_values | functions},
        optional={"type": st.sampled_from(["function", "x"])},
    ),
    max_size=2,
)
hostile_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from([*ROLES, "robot"]) | json_values},
        optional={
            "content": st.text(max_size=10) | st.lists(message_parts, max_size=3) | json_values,
            "name": json_values,
            "tool_call_id": json_values,
            "tool_calls": tool_calls | json_values,
            "reasoning_content": json_values,
            "refusal": st.none(),
        },
    )
    | json_values,
    max_size=4,
)


# Valid bodies: the fuzzers below start from them, and they must parse.
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.sampled_from([-1, 1, 40]),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "seed": st.integers(INT64_MIN, INT64_MAX),
        "stop": st.text(min_size=1, max_size=8)
        | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=MAX_STOP),
        "logit_bias": st.dictionaries(
            st.integers(0, 49151).map(str), st.integers(-100, 100), max_size=4
        ),
        "stream": st.booleans(),
        "user": st.text(max_size=10),
    },
)
valid_prompts = (
    st.text(min_size=1, max_size=20)
    | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4)
    | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
    | st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=3)
)
valid_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user"]), "content": st.text(max_size=20)}
    )
    | st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
            min_size=1, max_size=3)}
    )
    | st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none() | st.text(max_size=20)},
        optional={"refusal": st.none(), "name": st.text(max_size=5)},
    ),
    min_size=1,
    max_size=5,
)  # fmt: skip
valid_completions = st.builds(
    lambda params, prompt, max_tokens, n: {
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "n": n, **params
    },
    sampling, valid_prompts, st.integers(1, 64), st.integers(1, 8),
)  # fmt: skip
valid_chats = st.builds(
    lambda params, messages, max_tokens: {
        "model": "m", "messages": messages, "max_completion_tokens": max_tokens, **params
    },
    sampling, valid_messages, st.none() | st.integers(1, 64),
)  # fmt: skip


def hostile(
    valid: st.SearchStrategy[dict[str, Any]],
    fields: Sequence[str],
    replacements: st.SearchStrategy[Any],
) -> st.SearchStrategy[Any]:
    """Mostly a valid body with a few fields replaced (validation stops at the first bad
    field, so a body of random fields never gets far); else any JSON value or object."""
    mutated = st.builds(
        lambda body, changes: body | changes,
        valid,
        st.dictionaries(st.sampled_from(fields), replacements, max_size=3),
    )
    keys = st.sampled_from(fields) | st.text(max_size=6)
    anything = json_values | st.dictionaries(keys, json_values, max_size=4)
    return st.one_of(mutated, mutated, mutated, anything)


def assert_client_error(error: ApiError) -> None:
    """A 400 in OpenAI's envelope that can be written as JSON."""
    assert error.status == 400
    assert error.type == "invalid_request_error"
    validate("ErrorResponse", orjson.loads(error.json()))


# ------------------------------------------------------- decoding and validating bodies


EDGE_VALUES: list[Any] = [
    *EXTREMES, None, True, False, 0, -1, 1, 2**31, 1.5, float("-inf"), float("nan"), "x", "1",
    [], [None], [1], [-1], ["a"], [""], [[1]], [[]], {}, {"a": 1}, {"13": 2**64},
    {"x": float("inf")}, {"type": "text"}, {"include_usage": 2**64}, {"": None},
    [{"role": "user", "content": 2**64}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"arguments": "{}"}}]}],
    [{"role": "tool", "content": "x"}], [{"role": "function", "content": None}],
]  # fmt: skip


@pytest.mark.parametrize(
    ("parse", "base", "fields"),
    [
        (parse_completion_request, {"model": "m", "prompt": "x"}, COMPLETION_FIELDS),
        (parse_chat_request, {"model": "m", "messages": [{"role": "user", "content": "x"}]},
         CHAT_FIELDS),
    ],
)  # fmt: skip
def test_edge_values_of_every_field(
    parse: Callable[[object], object], base: dict[str, Any], fields: list[str]
) -> None:
    """Every field × every edge value, exhaustively: hypothesis draws too few of them."""
    for field in fields:
        for value in EDGE_VALUES:
            try:
                parse(base | {field: value})
            except ApiError as error:
                assert_client_error(error)


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
@settings(FUZZ, max_examples=20)
@given(body=valid_completions, value=plausible)
def test_any_value_of_a_completion_field_parses_or_is_a_400(
    field: str, body: dict[str, Any], value: Any
) -> None:
    """Every field gets its share of hostile values: random mutations reach few of them."""
    try:
        parse_completion_request(body | {field: value})
    except ApiError as error:
        assert_client_error(error)


@pytest.mark.parametrize("field", CHAT_FIELDS)
@settings(FUZZ, max_examples=20)
@given(body=valid_chats, value=plausible | hostile_messages)
def test_any_value_of_a_chat_field_parses_or_is_a_400(
    field: str, body: dict[str, Any], value: Any
) -> None:
    try:
        parse_chat_request(body | {field: value})
    except ApiError as error:
        assert_client_error(error)


@FUZZ
@given(hostile(valid_completions, COMPLETION_FIELDS, plausible))
def test_any_completion_body_parses_or_is_a_400(body: Any) -> None:
    try:
        parse_completion_request(body)
    except ApiError as error:
        assert_client_error(error)


@FUZZ
@given(hostile(valid_chats, CHAT_FIELDS, plausible | hostile_messages))
def test_any_chat_body_parses_or_is_a_400(body: Any) -> None:
    try:
        parse_chat_request(body)
    except ApiError as error:
        assert_client_error(error)


@FUZZ
@given(valid_completions)
def test_valid_completion_requests_parse(body: dict[str, Any]) -> None:
    request = parse_completion_request(body)
    assert request.n == body["n"] and request.sampling.max_tokens == body["max_tokens"]
    prompt = body["prompt"]
    batch = isinstance(prompt, list) and isinstance(prompt[0], list | str)
    assert len(request.prompts) == (len(prompt) if batch else 1)


@FUZZ
@given(valid_chats)
def test_valid_chat_requests_parse(body: dict[str, Any]) -> None:
    request = parse_chat_request(body)
    assert len(request.messages) == len(body["messages"])
    assert request.max_tokens == body["max_completion_tokens"]


@FUZZ
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_decode_or_are_a_400(raw: bytes) -> None:
    try:
        body = decode_json_body(raw)
    except ApiError as error:
        assert_client_error(error)
    else:
        assert isinstance(body, dict)


@settings(FUZZ, max_examples=150)  # bigger trees: fewer of them for the same time
@given(
    st.dictionaries(
        st.text(max_size=8), json_of(st.floats(allow_nan=False, allow_infinity=False)), max_size=6
    )
)
def test_json_objects_round_trip_unless_refused(value: dict[str, Any]) -> None:
    """What is refused is exactly what the server cannot carry: integers beyond int64."""
    raw = json.dumps(value).encode()
    try:
        decoded = decode_json_body(raw)
    except ApiError as error:
        assert_client_error(error)
        assert error.param is not None and "64-bit" in error.message
    else:
        assert decoded == value


# ------------------------------------------------------------------------ stop matcher


def expected_release(text: str, stops: Sequence[str], no_stop_trim: bool) -> str:
    """The earliest match in the whole text wins, the longest one at that position."""
    for i in range(len(text)):
        found = [s for s in stops if text.startswith(s, i)]
        if found:
            stop = max(found, key=len)
            return text[: i + len(stop)] if no_stop_trim else text[:i]
    return text


@st.composite
def chunked(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


small_text = st.text(alphabet="abc\n", max_size=30)


@FUZZ
@given(
    small_text.flatmap(lambda text: st.tuples(st.just(text), chunked(text))),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=MAX_STOP),
    st.booleans(),
)
def test_stop_matcher_releases_the_truncation_however_chunked(
    text_and_chunks: tuple[str, list[str]], stops: list[str], no_stop_trim: bool
) -> None:
    text, chunks = text_and_chunks
    matcher = StopMatcher(stops, no_stop_trim=no_stop_trim)
    released = "".join(matcher.feed(chunk).text for chunk in chunks) + matcher.flush()
    assert released == expected_release(text, stops, no_stop_trim)
    if not no_stop_trim:
        assert not any(stop in released for stop in stops)


# -------------------------------------------------------------------------- SSE writer

# What projections put in chunks: orjson writes 64-bit integers and finite floats.
sse_scalars = (
    st.none()
    | st.booleans()
    | st.integers(INT64_MIN, INT64_MAX)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
    | st.sampled_from(["\n", "\r\n", "\n\ndata: [DONE]\n\n", "\r", "\u2028", ":"])
)
sse_payloads = st.recursive(
    sse_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(FUZZ, max_examples=150)
@given(st.lists(sse_payloads, max_size=6))
def test_sse_frames_parse_back(payloads: list[Any]) -> None:
    raw = data_frames(payloads)
    assert raw == b"".join(data_frame(p) for p in payloads)
    frames = raw.split(b"\n\n")
    assert frames.pop() == b""  # every frame ends with a blank line
    assert len(frames) == len(payloads)
    for frame, payload in zip(frames, payloads, strict=True):
        assert frame.startswith(b"data: ")
        assert b"\n" not in frame and b"\r" not in frame
        assert orjson.loads(frame[len(b"data: ") :]) == payload
