"""A small typed toolkit for parsing decoded JSON request bodies, shared by the endpoints.

Each endpoint reads its body through a :class:`Fields` reader. Every read consumes a
key, checks its JSON type strictly (a boolean is not an integer, a string is not a
number, NaN and infinities are refused), checks its range and maps ``null`` to the
default, the way OpenAI's nullable fields mean it; :meth:`Fields.finish` then refuses
whatever key no read consumed, so the set of known fields is exactly the set read.
Every failure is a 400 :class:`ApiError` whose ``param`` names the field (dotted inside
nested objects, e.g. ``stream_options.include_usage``).
"""

from __future__ import annotations

import math
from typing import overload

from sluice.http.errors import ApiError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
"""The bounds of an integer field that names none of its own: counts, limits and token
ids all become 32- or 64-bit tensors inside the engine's step, where a value past them
would fail the whole batch, so the edge refuses it naming the field."""
_MAX_SHOWN = 40


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def type_error(param: str, expected: str, value: object) -> ApiError:
    """``'<param>' must be <expected>, got <JSON type>``."""
    return ApiError.bad_request(f"'{param}' must be {expected}, got {json_type(value)}", param)


def check_integer(
    param: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` as an int within the bounds; a bound not given is 32 bits' (``INT32_MIN``).
    An integral float (``2.0``) counts, as SGLang's (pydantic's) validation accepts it;
    ``2.5`` does not."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise type_error(param, "an integer", value)
    _check_range(param, value, minimum, maximum, exclusive_minimum=False)
    _check_range(
        param,
        value,
        INT32_MIN if minimum is None else None,
        INT32_MAX if maximum is None else None,
        exclusive_minimum=False,
    )
    return value


def check_number(
    param: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> float:
    """``value`` (an int or a finite float) as a float within the bounds."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise type_error(param, "a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError.bad_request(f"'{param}' must be a finite number, got {value}", param)
    # Compare before converting: a huge JSON integer would overflow float().
    _check_range(param, value, minimum, maximum, exclusive_minimum=exclusive_minimum)
    return float(value)


def _check_range(
    param: str,
    value: float,
    minimum: float | None,
    maximum: float | None,
    *,
    exclusive_minimum: bool,
) -> None:
    too_low = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    too_high = maximum is not None and value > maximum
    if not (too_low or too_high):
        return
    if minimum is not None and maximum is not None and not exclusive_minimum:
        bounds = f"between {minimum} and {maximum}"
    else:
        parts = []
        if minimum is not None:
            parts.append(f"{'greater than' if exclusive_minimum else 'at least'} {minimum}")
        if maximum is not None:
            parts.append(f"at most {maximum}")
        bounds = " and ".join(parts)
    raise ApiError.bad_request(f"{param} must be {bounds}, got {show(value)}", param)


def show(value: object) -> str:
    """A client-supplied value, cut short: error messages must not echo megabytes."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


class Fields:
    """A consuming, strictly typed reader over one JSON object of a request body.

    ``null`` reads as absent. ``prefix`` is the dotted path of a nested object, used to
    name its fields in errors.
    """

    def __init__(self, body: dict[str, object], prefix: str = "") -> None:
        self._body = body
        self._prefix = prefix
        self._consumed: set[str] = set()

    @classmethod
    def of_body(cls, body: object) -> Fields:
        """A reader over a whole request body, which must be a JSON object."""
        if not isinstance(body, dict):
            raise ApiError.bad_request(
                f"The request body must be a JSON object, got {json_type(body)}"
            )
        return cls(body)

    def param(self, name: str) -> str:
        """The name of field ``name`` as errors report it."""
        return f"{self._prefix}.{name}" if self._prefix else name

    def error(self, name: str, message: str) -> ApiError:
        """A 400 about field ``name``; the caller raises it."""
        return ApiError.bad_request(message, self.param(name))

    def take(self, name: str) -> object:
        """The raw value of ``name``, consumed; ``None`` when absent or null."""
        self._consumed.add(name)
        return self._body.get(name)

    def string(self, name: str) -> str | None:
        value = self.take(name)
        if value is not None and not isinstance(value, str):
            raise type_error(self.param(name), "a string", value)
        return value

    def required_string(self, name: str) -> str:
        value = self.string(name)
        if value is None:
            raise self.error(name, f"Missing required parameter: '{self.param(name)}'.")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.take(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise type_error(self.param(name), "a boolean", value)
        return value

    @overload
    def integer(
        self, name: str, default: int, *, minimum: int | None = ..., maximum: int | None = ...
    ) -> int: ...

    @overload
    def integer(
        self,
        name: str,
        default: None = None,
        *,
        minimum: int | None = ...,
        maximum: int | None = ...,
    ) -> int | None: ...

    def integer(
        self,
        name: str,
        default: int | None = None,
        *,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int | None:
        value = self.take(name)
        if value is None:
            return default
        return check_integer(self.param(name), value, minimum=minimum, maximum=maximum)

    def number(
        self,
        name: str,
        default: float,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> float:
        value = self.take(name)
        if value is None:
            return default
        return check_number(
            self.param(name),
            value,
            minimum=minimum,
            maximum=maximum,
            exclusive_minimum=exclusive_minimum,
        )

    def object(self, name: str) -> Fields | None:
        """A reader over the nested object ``name``; call its :meth:`finish` too."""
        value = self.take(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise type_error(self.param(name), "an object", value)
        return Fields(value, self.param(name))

    def strings(self, name: str) -> tuple[str, ...] | None:
        """A string or an array of strings, as a tuple."""
        value = self.take(name)
        if value is None:
            return None
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise type_error(self.param(name), "a string or an array of strings", value)
        return tuple(value)

    def integers(
        self, name: str, *, minimum: int | None = None, max_items: int | None = None
    ) -> tuple[int, ...] | None:
        """An array of at most ``max_items`` integers, each at least ``minimum``, as a tuple."""
        value = self.take(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise type_error(self.param(name), "an array of integers", value)
        if max_items is not None and len(value) > max_items:
            raise self.error(
                name, f"{self.param(name)} must have at most {max_items} entries, got {len(value)}"
            )
        return tuple(check_integer(self.param(name), item, minimum=minimum) for item in value)

    def finish(self) -> None:
        """Refuse the first field that no read consumed."""
        for name in self._body:
            if name not in self._consumed:
                raise self.error(
                    name, f"Unrecognized request argument supplied: {self.param(name)}"
                )
