"""Grammar constraints with llguidance: compile, validate, and a token mask per step.

Three layers:

* :func:`grammar_for` turns a :class:`~sluice.engine.params.Constraint` into
  llguidance's grammar text (JSON schema, regex, SGLang's GBNF-style ``ebnf``, or
  llguidance's Lark dialect), and :func:`validate_constraint` checks it — no
  tokenizer and no engine needed, so the HTTP layer refuses a bad schema, regex or
  grammar with the compiler's own message before anything is generated.
* :class:`TokenGrammar` binds grammars to the model's tokenizer (built once, at
  load). It compiles each (kind, source) once, keeping a bounded LRU cache of
  compiled matchers, and hands every sequence its own copy. Compiling, the
  grammar's first mask (which builds its lexer and can take a second for a regex
  such as ``a{1000}{1000}``) and a first token taken on a copy (where a lexer past
  llguidance's limits fails) run on a worker thread (:meth:`TokenGrammar.prepare`),
  so the engine keeps stepping the other sequences meanwhile. The front end awaits
  the same compile before it submits (``pipeline.runner``), so a grammar that
  cannot run is a 400.
* :meth:`TokenGrammar.allowed` computes the masks of every constrained row of a
  step in one call of llguidance's executor, which releases the GIL and spreads
  the rows over its threads: the batch is never walked one row at a time.

JSON schemas compile without free whitespace, so a document comes out compact
(``{"a":1}``, as OpenAI's structured outputs do) and a small model cannot stall in
endless blank space; a schema's own ``x-guidance`` options override that.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from .params import Constraint

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions

# torch (and transformers, for llguidance.hf) load only with a TokenGrammar: the HTTP
# layer validates constraints without them.

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept per tokenizer (and validations kept), least recently used out."""

# Applied before a schema's own ``x-guidance`` options (which win).
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'


class ConstraintError(ValueError):
    """A schema, regex or grammar the compiler refuses; the message is the compiler's."""

    def __init__(self, constraint: Constraint, message: str) -> None:
        self.kind = constraint.kind
        what = {
            "json_schema": "JSON schema",
            "json_object": "JSON object constraint",
            "regex": "regex",
            "ebnf": "EBNF grammar",
            "lark": "Lark grammar",
        }[constraint.kind]
        super().__init__(f"Invalid {what}: {message.strip()}")


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def grammar_for(constraint: Constraint) -> str:
    """llguidance's grammar text for ``constraint``; :class:`ConstraintError` if the
    source cannot even be read (not JSON, not GBNF). Compile errors come later."""
    kind, source = constraint.kind, constraint.source
    if kind in ("json_schema", "json_object"):
        if kind == "json_object":
            source = _ANY_OBJECT
        try:
            schema = json.loads(source)
        except ValueError as exc:
            raise ConstraintError(constraint, f"not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise ConstraintError(constraint, "a schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise ConstraintError(constraint, str(exc)) from exc
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "ebnf":
        try:
            lark = gbnf_to_lark(source)
        # The converter raises plain ``Exception`` for some errors (no ``root`` rule).
        except Exception as exc:
            raise ConstraintError(constraint, str(exc)) from exc
        return llguidance.LLMatcher.grammar_from_lark(lark)
    return llguidance.LLMatcher.grammar_from_lark(source)


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _validation_error(constraint: Constraint) -> str:
    return llguidance.LLMatcher.validate_grammar(grammar_for(constraint))


def validate_constraint(constraint: Constraint) -> None:
    """Raise :class:`ConstraintError` with the compiler's message if ``constraint``
    does not compile. Needs no tokenizer; results are cached."""
    message = _validation_error(constraint)
    if message:
        raise ConstraintError(constraint, message)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    @property
    def ll(self) -> llguidance.LLMatcher:
        return self._m

    def consume(self, token: int) -> bool:
        """Advance over ``token``; False if the grammar rejects it (never after a mask)."""
        return bool(self._m.consume_token(token))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from here, the grammar accepts in a row (consumes none)."""
        return int(self._m.validate_tokens(list(tokens)))

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar matcher could not roll back {n} tokens")

    @property
    def accepting(self) -> bool:
        """The text so far is a complete document: the sequence may end here."""
        return bool(self._m.is_accepting())

    @property
    def stopped(self) -> bool:
        """The grammar allows nothing more: the sequence must end."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class TokenGrammar:
    """Grammars bound to one tokenizer: compiled matchers and batched token masks.

    ``eos_token_ids`` are the ids the grammar may end on; :meth:`allowed` leaves them
    out of the masks, because whether a sequence may stop is the caller's decision
    (its own stop ids, ``ignore_eos``, ``min_tokens``), taken only while the matcher
    is :attr:`~GrammarMatcher.accepting`.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_ids: Iterable[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
        threads: int | None = None,
    ) -> None:
        import llguidance.hf
        import torch

        eos = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
        self.vocab_size: int = self.tokenizer.vocab_size
        self._eos = torch.tensor(sorted(set(self.tokenizer.eos_tokens)), dtype=torch.long)
        self._executor = llguidance.LLExecutor(threads)
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.RLock()  # a done future's callback runs under it
        self._words = (self.vocab_size + 31) // 32
        self._compiling: dict[Constraint, Future[Any]] = {}
        self._workers = ThreadPoolExecutor(2, thread_name_prefix="sluice-grammar")

    def prepare(self, constraint: Constraint) -> Future[Any]:
        """Compile ``constraint`` on a worker thread unless it is cached (or being
        compiled); the future ends when :meth:`matcher` is cheap, or holds the
        :class:`ConstraintError`."""
        with self._lock:
            if constraint in self._cache:
                done: Future[Any] = Future()
                done.set_result(None)
                return done
            future = self._compiling.get(constraint)
            if future is None:
                future = self._workers.submit(self._compile, constraint)
                self._compiling[constraint] = future
                future.add_done_callback(lambda _: self._compiled(constraint))
            return future

    def _compiled(self, constraint: Constraint) -> None:
        with self._lock:
            self._compiling.pop(constraint, None)

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """Compile and cache ``constraint``'s matcher, its lexer warmed by a first mask."""
        compiled = llguidance.LLMatcher(self.tokenizer, grammar_for(constraint), log_level=0)
        if compiled.is_error():
            raise ConstraintError(constraint, compiled.get_error())
        # Warm the shared lexer through a copy: copies of a matcher that computed a
        # mask itself are slow to compute their own.
        scratch = np.empty(self._words, dtype=np.int32)
        probe = compiled.deep_copy()
        self._executor.unsafe_compute_mask_ptr(
            [(probe, 0)], scratch.ctypes.data, self._words * 4, 1
        )
        self._probe(constraint, probe, scratch)
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _probe(self, constraint: Constraint, probe: llguidance.LLMatcher, mask: Any) -> None:
        """Take the first token the first mask allows: a grammar whose lexer outgrows
        llguidance's limits (``(a{1000}){1000}`` compiles, and masks once) fails there,
        so it is refused before admission rather than at its first generated token."""
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        bits[[t for t in self.tokenizer.eos_tokens if t < len(bits)]] = 0
        allowed = np.flatnonzero(bits)
        if len(allowed):
            probe.consume_token(int(allowed[0]))
        if probe.is_error():
            # Its first line says what failed; the rest is the parser's state.
            reason = probe.get_error().strip().splitlines()[0]
            raise ConstraintError(constraint, f"the grammar cannot run: {reason}")

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher at the start of ``constraint`` (compiled here unless
        :meth:`prepare` did it); :class:`ConstraintError` if it does not compile."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
        if compiled is None:
            compiled = self._compile(constraint)
        return GrammarMatcher(compiled.deep_copy())

    @property
    def cached(self) -> int:
        return len(self._cache)

    def allowed(self, matchers: Sequence[GrammarMatcher], vocab: int) -> torch.Tensor:
        """``[len(matchers), vocab]`` booleans: the tokens each grammar allows next.

        One parallel llguidance call fills every row's bitmask. EOS ids are left out
        (see the class). Ids past the tokenizer's vocabulary (padding rows of the
        model's output layer) are never allowed.
        """
        import torch

        rows = len(matchers)
        bitmask = torch.empty(rows, self._words, dtype=torch.int32)
        # What ``llguidance.torch.fill_next_token_bitmask_par`` does, without importing
        # that module (it pulls in torch.compile at import).
        self._executor.unsafe_compute_mask_ptr(
            [(m.ll, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            self._words * 4,
            rows,
        )
        # Token t is bit t % 32 of little-endian word t // 32: bytes in order, bits
        # least significant first. numpy's unpacking is one cheap single-threaded pass.
        bits = torch.from_numpy(
            np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        )
        if bits.shape[1] >= vocab:
            allowed = bits[:, :vocab].contiguous()
        else:
            allowed = torch.zeros(rows, vocab, dtype=torch.bool)
            allowed[:, : bits.shape[1]] = bits
        allowed[:, self._eos[self._eos < vocab]] = False
        return allowed
