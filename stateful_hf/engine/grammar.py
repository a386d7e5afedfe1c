"""Structured output: a request's `JsonConstraint` compiled to a grammar (xgrammar), a matcher per
request, and the batched token mask applied to a step's logits before sampling.

Imported only when a request carries a constraint (`Engine.submit`, `ModelRunner.execute`): the free
path never loads this module or xgrammar. Why xgrammar: its per-token mask was the cheapest of the
three maintained libraries measured on SmolLM2's 49152-token vocabulary (benchmarks/bench_grammar_libs.py,
docs/structured-output.md).

- Compiling: one xgrammar `GrammarCompiler` per tokenizer (`Compilers`); compiled grammars are kept in
  an LRU keyed by the tokenizer and the constraint's canonical text (`JsonConstraint.key`), as futures,
  so concurrent requests for one schema compile it once. Compiles run in a small worker pool and a
  caller waits at most `timeout` seconds (a compile that overruns keeps running and is cached when done).
  An invalid schema or an overrun is a `GrammarError` (a ValueError) that says why.
- A request's matcher (`Grammar`) stops on the engine's EOS ids and the request's stop_token_ids
  (the tokenizer's EOS when there are none); the mask allows them only once the JSON is complete, and
  `constrain` adds them to the request's stop_token_ids, so a constrained turn ends exactly when its
  grammar does (also with ignore_eos).
- Per step, `mask_logits` fills the bitmasks of the constrained rows in one batched call and sets their
  disallowed logits to -inf; free rows are untouched (their tokens are those they get alone). After the
  step commits, `accept_tokens` advances each matcher by the token its request emitted: the session's
  KV is that of the emitted tokens, so a later free turn on the session is exact as ever.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .constraint import JsonConstraint

if TYPE_CHECKING:
    from .request import Request

log = logging.getLogger(__name__)

COMPILE_TIMEOUT = 5.0          # seconds a request waits for its grammar (EngineConfig.grammar_compile_timeout)
CACHE_SIZE = 256               # compiled grammars kept per tokenizer (LRU)
MAX_WHITESPACE = 16            # whitespace characters between JSON tokens at most: no endless blank runs
COMPILE_THREADS = 2            # the compile pool: a slow compile does not hold up every other one


class GrammarError(ValueError):
    """A constraint that cannot be used: an invalid or unsupported schema, a compile over the time limit,
    no tokenizer, or xgrammar missing. `param`: the request field it came from, `code`: why (for a
    server's 400: invalid_schema, schema_too_complex, or structured_output_unavailable)."""

    def __init__(self, message: str, param: str = "response_format", code: str = "invalid_schema"):
        super().__init__(message)
        self.param, self.code = param, code


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise GrammarError(f"structured output needs xgrammar ({e}); install it: pip install "
                           "'stateful-hf[structured]'", code="structured_output_unavailable") from None
    return xgrammar


_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+?\.cc:\d+:\s*")


def _reason(e: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CPP_PREFIX.sub("", text)


class Compilers:
    """One compiler per tokenizer (held weakly) and its LRU of compiled grammars. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pool: ThreadPoolExecutor | None = None

    def _compiler(self, tokenizer) -> _Compiler:
        with self._lock:
            c = self._by_tokenizer.get(tokenizer)
            if c is None:
                try:
                    c = _Compiler(tokenizer)
                except GrammarError:
                    raise
                except Exception as e:  # noqa: BLE001 - a tokenizer xgrammar cannot read: the request fails, says why
                    raise GrammarError(f"structured output cannot use this tokenizer ({type(e).__name__}: "
                                       f"{_reason(e)})", code="structured_output_unavailable") from None
                self._by_tokenizer[tokenizer] = c
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
            return c

    def compile(self, tokenizer, constraint: JsonConstraint, timeout: float = COMPILE_TIMEOUT,
                param: str = "response_format"):
        """The compiled grammar of `constraint` for `tokenizer` (cached); GrammarError naming `param`
        if it cannot be compiled or takes more than `timeout` seconds."""
        return self.compile_for(tokenizer, constraint, timeout, param)[0]

    def compile_for(self, tokenizer, constraint: JsonConstraint, timeout: float = COMPILE_TIMEOUT,
                    param: str = "response_format") -> tuple[object, _Compiler]:
        """`compile`, and the tokenizer's compiler (its vocabulary size and EOS id)."""
        if tokenizer is None:
            raise GrammarError("structured output needs a tokenizer: Engine(model, tokenizer=...)", param,
                               "structured_output_unavailable")
        try:
            c = self._compiler(tokenizer)
        except GrammarError as e:
            raise GrammarError(str(e), param, e.code) from None
        assert self._pool is not None  # made with the first compiler (`_compiler`)
        fut = c.future(constraint, self._pool)
        try:
            return fut.result(timeout), c
        except FutureTimeout:
            raise GrammarError(f"compiling {constraint.describe()} took longer than the limit of {timeout:g} s; "
                               "simplify the schema (long maxLength / maxItems bounds and deep nesting compile "
                               "slowly)", param, "schema_too_complex") from None
        except GrammarError as e:
            raise GrammarError(str(e), param, e.code) from None

    def cached(self, tokenizer) -> int:
        """Compiled grammars kept for `tokenizer` (tests, stats)."""
        c = self._by_tokenizer.get(tokenizer)
        return 0 if c is None else len(c.cache)


class _Compiler:
    def __init__(self, tokenizer):
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer)
        self.vocab = self.info.vocab_size
        self.eos = getattr(tokenizer, "eos_token_id", None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache: OrderedDict[str, Future] = OrderedDict()
        self.lock = threading.Lock()

    def future(self, constraint: JsonConstraint, pool: ThreadPoolExecutor) -> Future:
        with self.lock:
            fut = self.cache.get(constraint.key)
            if fut is not None:
                self.cache.move_to_end(constraint.key)
                return fut
            fut = self.cache[constraint.key] = pool.submit(self._compile, constraint)
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
            return fut

    def _compile(self, c: JsonConstraint):
        schema = '{"type": "object"}' if c.schema is None else c.schema
        options = {"strict_mode": c.strict, "any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}
        try:
            if not (c.prefix or c.suffix):
                return self.compiler.compile_json_schema(schema, **options)
            xgr = _xgrammar()
            literal = lambda text: [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")] \
                if text else []
            parts = [*literal(c.prefix), xgr.Grammar.from_json_schema(schema, **options), *literal(c.suffix)]
            return self.compiler.compile_grammar(xgr.Grammar.concat(*parts))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types: all mean "cannot"
            raise GrammarError(f"{c.describe()} cannot be compiled: {_reason(e)}") from None


COMPILERS = Compilers()


class Grammar:
    """One request's matcher, advanced by each token the request emits (`accept_tokens`)."""

    __slots__ = ("matcher", "stop_ids", "vocab", "rejected")

    def __init__(self, compiled, stop_ids: tuple[int, ...], vocab: int):
        self.matcher = _xgrammar().GrammarMatcher(compiled, override_stop_tokens=list(stop_ids))
        self.stop_ids, self.vocab, self.rejected = stop_ids, vocab, 0


def constrain(r: Request, tokenizer, eos: frozenset[int], timeout: float = COMPILE_TIMEOUT) -> None:
    """Give queued request `r` (whose sampling has a constraint) its matcher: compile (or find) the
    grammar, stop on EOS / stop_token_ids (the tokenizer's EOS if there are none), and make those its
    stop tokens also under ignore_eos. GrammarError if the grammar cannot be had."""
    assert r.sampling.constraint is not None, r
    compiled, c = COMPILERS.compile_for(tokenizer, r.sampling.constraint, timeout)
    stops = set(eos) | set(r.sampling.stop_token_ids)
    if not stops and c.eos is not None:
        stops = {int(c.eos)}
    if not stops:
        raise GrammarError("structured output needs a stop token: the model has no EOS id and the request "
                           "no stop_token_ids", code="structured_output_unavailable")
    stop_ids = tuple(sorted(stops))
    extra = tuple(t for t in stop_ids if t not in r.sampling.stop_token_ids)
    r.constrain(Grammar(compiled, stop_ids, c.vocab),
                replace(r.sampling, stop_token_ids=r.sampling.stop_token_ids + extra) if extra else r.sampling)


_local = threading.local()


def _batch_matcher():
    b = getattr(_local, "batch", None)
    if b is None:
        b = _local.batch = _xgrammar().BatchGrammarMatcher(max_threads=1)
    return b


def _bitmask(rows: int, vocab: int) -> torch.Tensor:
    """A thread's reusable int32 bitmask [rows, ceil(vocab / 32)] (filled before every use)."""
    words = (vocab + 31) // 32
    buf = getattr(_local, "bitmask", None)
    if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
        buf = _local.bitmask = torch.empty(max(rows, 32), words, dtype=torch.int32)
    return buf[:rows]


def mask_logits(logits: torch.Tensor, requests) -> None:
    """Set to -inf, in place, the logits of tokens each constrained request's grammar does not allow
    next (rows of `logits` [R, V] are `requests`, in order); free rows are left as they are."""
    rows = [j for j, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    vocab = requests[rows[0]].grammar.vocab
    mask = _bitmask(len(requests), vocab)            # row j is logits row j's (only `rows` are filled)
    _batch_matcher().batch_fill_next_token_bitmask([requests[j].grammar.matcher for j in rows], mask,
                                                   indices=rows)
    apply_bitmask(logits, mask, rows)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, t] = -inf for each r in `rows` where bit t of mask[r] is 0 (int32 words, bit t % 32 of
    word t // 32: xgrammar's layout; mask has a row per logits row, those not in `rows` unused), and
    for every t past the mask's 32 * words tokens (ids the tokenizer lacks).

    On a GPU, xgrammar's kernel. On the CPU, without branches (masked_fill / where on a mask this
    irregular cost ~3x more) and without torch's thread team (a parallel elementwise op stalls on a
    busy host: 6-20 ms per step measured in the engine, against ~2.5 ms here): per row, in numpy,
    unpack the bits, take their log and add it: log 1 = +0 leaves an allowed logit as it is, bit for
    bit; log 0 = -inf."""
    width, covered = logits.shape[1], 32 * mask.shape[1]
    n = min(width, covered)
    if not logits.is_cpu:
        mask = mask.to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(logits, mask, vocab_size=n, indices=rows)
    else:
        import numpy as np
        words = mask.numpy().view(np.uint8)
        a = logits.numpy() if logits.dtype == torch.float32 else None     # rows added in numpy, else in torch
        bias = np.empty(n, dtype=np.float32)
        with np.errstate(divide="ignore"):
            for r in rows:
                np.log(np.unpackbits(words[r], count=n, bitorder="little"), out=bias, dtype=np.float32)
                if a is not None:
                    row = a[r, :n]
                    row += bias
                else:                        # bf16 / fp16 logits: numpy has no bfloat16
                    logits[r, :n] += torch.from_numpy(bias).to(logits.dtype)
    if width > covered:
        logits[rows, covered:] = float("-inf")


def accept_tokens(requests, tokens) -> None:
    """Advance each constrained request's matcher by the token it emitted (after the step committed)."""
    for r, t in zip(requests, tokens, strict=True):
        g = r.grammar
        if g is not None and not g.matcher.accept_token(int(t)):
            g.rejected += 1          # cannot happen through the mask; logged, never raised mid-commit
            log.warning("request %s: token %d is outside its grammar (%s)", r.request_id, t,
                        r.sampling.constraint.describe())
