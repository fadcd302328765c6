"""llguidance vs xgrammar on this machine, with the default model's tokenizer.

``python -P -m sluice.bench.grammar_libs`` measures, for each library that is
importable: tokenizer set-up, grammar compile time (JSON schemas, regex, GBNF),
per-token mask time along a fixed accepted token path (first mask apart), and one
batched mask computation for B sequences against B masks computed one by one.
The numbers behind the "Grammar library" section of docs/architecture.md; run it
again if either library changes. xgrammar is not a dependency: install it by hand
(``pip install xgrammar==0.2.8``) to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from sluice.bench.machine import print_machine
from sluice.engine.loader import load_tokenizer, resolve_model

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "rating": {"type": "number"},
            "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}},
            "cast": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
                    "required": ["name", "role"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["title", "year", "rating", "genres", "cast"],
        "additionalProperties": False,
    },
}
DOCS = {
    "flat": {"name": "Paris", "population": 2102650},
    "nested": {
        "title": "The Long Night",
        "year": 1999,
        "rating": 7.5,
        "genres": ["drama", "horror"],
        "cast": [{"name": "Ann Lee", "role": "Mara"}, {"name": "Bo Kim", "role": "Tom"}],
    },
}
REGEX = r"(\+\d{1,3} )?\(\d{3}\) \d{3}-\d{4}"
REGEX_TEXT = "+1 (555) 123-4567"
GBNF = 'root ::= "The answer is " ("yes" | "no") "." ws\nws ::= [ \\t\\n]*'
GBNF_TEXT = "The answer is yes."


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _time(fn: Callable[[], object], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Lib(Protocol):
    name: str
    init_s: float

    def compile(self, kind: str, source: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None: ...
    def fill_batch(self, matchers: list[Any], mask: torch.Tensor) -> None: ...
    def consume(self, matcher: Any, token: int) -> bool: ...


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.init_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, source: str) -> Any:
        grammar = self.ll.grammar_from(kind, source)  # type: ignore[arg-type]
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, mask, row)

    def fill_batch(self, matchers: list[Any], mask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], mask
        )

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        # No cache: each compile below is a real one.
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.init_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, kind: str, source: str) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(source)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        return self.compiler.compile_grammar(source)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    def fill_batch(self, matchers: list[Any], mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


def _cases() -> list[tuple[str, str, str, str]]:
    """(label, kind, source, an accepted output)."""
    cases = [
        (f"schema:{k}", "json_schema", json.dumps(s), json.dumps(DOCS[k]))
        for k, s in SCHEMAS.items()
    ]
    cases.append(("regex", "regex", REGEX, REGEX_TEXT))
    cases.append(("gbnf", "ebnf", GBNF, GBNF_TEXT))
    return cases


def _walk(
    lib: Lib, compiled: Any, tokens: list[int], batch: int, words: int, *, batched: bool
) -> float:
    """Mean seconds per step to compute the masks of ``batch`` sequences."""
    matchers, positions = [], []
    for i in range(batch):
        m = lib.matcher(compiled)
        offset = i % len(tokens)
        for token in tokens[:offset]:
            lib.consume(m, token)
        matchers.append(m)
        positions.append(offset)
    masks = torch.full((batch, words), -1, dtype=torch.int32)
    spent, steps = 0.0, 0
    while any(p < len(tokens) for p in positions):
        live = [i for i, p in enumerate(positions) if p < len(tokens)]
        start = time.perf_counter()
        if batched:
            lib.fill_batch([matchers[i] for i in live], masks)
        else:
            for row, i in enumerate(live):
                lib.fill(matchers[i], masks, row)
        spent += time.perf_counter() - start
        steps += 1
        for i in live:
            lib.consume(matchers[i], tokens[positions[i]])
            positions[i] += 1
    return spent / steps


def measure(lib: Lib, tokenizer: Any, batch: int) -> dict[str, Any]:
    vocab = len(tokenizer)
    words = (vocab + 31) // 32
    out: dict[str, Any] = {"tokenizer_init_ms": _ms(lib.init_s), "cases": {}}
    for label, kind, source, text in _cases():

        def compile_once(kind: str = kind, source: str = source) -> object:
            return lib.compile(kind, source)

        compile_s = _time(compile_once)
        compiled = lib.compile(kind, source)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        mask = torch.full((1, words), -1, dtype=torch.int32)
        matcher = lib.matcher(compiled)
        times = []
        for token in tokens:
            start = time.perf_counter()
            lib.fill(matcher, mask, 0)
            times.append(time.perf_counter() - start)
            allowed = bool((mask[0, token // 32] >> (token % 32)) & 1)
            assert allowed and lib.consume(matcher, token), (lib.name, label, token)
        rest = times[1:]
        # B sequences of the same grammar, each at its own point of the path: every
        # step computes B masks (batched, or one by one), then each consumes a token.
        batched = _walk(lib, compiled, tokens, batch, words, batched=True)
        one_by_one = _walk(lib, compiled, tokens, batch, words, batched=False)
        out["cases"][label] = {
            "compile_ms": _ms(compile_s),
            "tokens": len(tokens),
            "first_mask_ms": _ms(times[0]),
            "mask_mean_ms": _ms(statistics.fmean(rest)) if rest else None,
            "mask_max_ms": _ms(max(rest)) if rest else None,
            f"batch{batch}_step_ms": _ms(batched),
            f"serial{batch}_step_ms": _ms(one_by_one),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    print_machine()
    tokenizer = load_tokenizer(resolve_model(None).folder)
    results: dict[str, Any] = {}
    for cls in (LLGuidance, XGrammar):
        try:
            lib = cls(tokenizer)
        except ImportError as exc:
            results[cls.name] = f"not installed: {exc}"
            continue
        results[cls.name] = measure(lib, tokenizer, args.batch)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
