"""Constrained-decoding libraries side by side on one tokenizer: what a token mask costs per token.

    python -m benchmarks.bench_grammar_libs --json benchmarks/results/grammar_libs_smollm2.json

For xgrammar, llguidance and outlines-core (whichever are installed), on SmolLM2-135M-Instruct's
tokenizer (49152 tokens; `stateful_hf.models`, fetched once): the time to prepare the tokenizer, to
compile a JSON schema and the generic JSON grammar (`json_object`), then, walking the tokens of a
valid document, the time per token to fill one request's bitmask and to accept the token, and the
time to fill the masks of a batch of 24 requests (each library's batched call where it has one) and
to apply them to [24, V] float32 logits, with the library's own function and with the engine's
(`stateful_hf.engine.grammar.apply_bitmask`: the three share one bitmask layout). Rounds alternate the
libraries; medians are reported. This is how stateful_hf/engine/grammar.py's library was chosen
(docs/structured-output.md). Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
SCHEMA_DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "poetry", "analytical engines"]}
OBJECT_DOC = {"id": 7, "ok": True, "items": [{"k": "a", "v": 1.5}, {"k": "b", "v": None}], "note": "two items"}
BATCH = 24


def _now() -> float:
    return time.perf_counter()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, eos: int):
        import xgrammar as xgr
        self.xgr = xgr
        t0 = _now()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.setup = _now() - t0
        self.vocab = vocab
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema):
        return self.compiler.compile_builtin_json_grammar() if schema is None else \
            self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, m, mask, i):
        m.fill_next_token_bitmask(mask, i)

    def fill_batch(self, ms, mask):
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m, t):
        assert m.accept_token(t), t

    def apply(self, logits, mask):
        self.xgr.apply_token_bitmask_inplace(logits, mask)


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, eos: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.lt = llguidance, llguidance.torch
        t0 = _now()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
        self.setup = _now() - t0
        self.vocab = vocab
        self.executor = llguidance.LLExecutor(1)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema, defaults={"whitespace_flexible": True})
        m = self.llg.LLMatcher(self.tok, grammar)       # compiles (lazily: the lexer grows as it is used)
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar)

    def bitmask(self, n):
        return self.lt.allocate_token_bitmask(n, self.vocab)

    def fill(self, m, mask, i):
        self.lt.fill_next_token_bitmask(m, mask, i)

    def fill_batch(self, ms, mask):
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def accept(self, m, t):
        assert m.consume_token(t), (t, m.get_error())

    def apply(self, logits, mask):
        self.lt.apply_token_bitmask_inplace(logits, mask)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab: int, eos: int):
        import outlines_core as oc
        from outlines_core.kernels import torch as kernels
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        self.oc, self.k = oc, kernels
        t0 = _now()
        unbyte = {c: b for b, c in bytes_to_unicode().items()}
        special = set(tok.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i in special or i >= vocab:
                continue
            tokens.setdefault(bytes(unbyte[c] for c in text), []).append(i)
        self.vocabulary = oc.Vocabulary(eos, tokens)
        self.setup = _now() - t0
        self.vocab, self.eos = vocab, eos

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema
        return self.oc.Index(build_regex_from_schema(json.dumps({"type": "object"} if schema is None else schema),
                                                     r"[ ]?"), self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    def bitmask(self, n):
        return torch.zeros(n, (self.vocab + 31) // 32, dtype=torch.int32)

    def fill(self, m, mask, i):
        self.k.fill_next_token_bitmask(m, mask[i:i + 1])

    def fill_batch(self, ms, mask):
        for i, m in enumerate(ms):                        # no batched call
            self.k.fill_next_token_bitmask(m, mask[i:i + 1])

    def accept(self, m, t):
        if t != self.eos:
            m.advance(t)

    def apply(self, logits, mask):
        self.k.apply_token_bitmask_inplace(logits, mask)


LIBRARIES = (Xgrammar, Llguidance, OutlinesCore)


def walk(lib, compiled, ids: list[int]) -> tuple[list[float], list[float]]:
    """(fill seconds, accept seconds) per token of `ids` for one fresh matcher."""
    m, mask = lib.matcher(compiled), lib.bitmask(1)
    fills, accepts = [], []
    for t in ids:
        t0 = _now()
        lib.fill(m, mask, 0)
        t1 = _now()
        assert mask[0, t // 32] >> (t % 32) & 1, f"{lib.name} masked out token {t}"
        lib.accept(m, t)
        fills.append(t1 - t0)
        accepts.append(_now() - t1)
    return fills, accepts


def walk_batch(lib, compiled, ids: list[int], logits: torch.Tensor) -> tuple[list[float], list[float], list[float]]:
    """(batched fill seconds, the library's apply seconds, the engine's apply seconds) per step for BATCH
    matchers walking `ids` together. The engine's: `grammar.apply_bitmask` (the same bitmask layout)."""
    from stateful_hf.engine.grammar import apply_bitmask
    ms, mask = [lib.matcher(compiled) for _ in range(BATCH)], lib.bitmask(BATCH)
    fills, applies, ours = [], [], []
    rows = list(range(BATCH))
    for t in ids:
        t0 = _now()
        lib.fill_batch(ms, mask)
        t1 = _now()
        lib.apply(logits.clone(), mask)
        applies.append(_now() - t1)
        x = logits.clone()
        t2 = _now()
        apply_bitmask(x, mask, rows)
        ours.append(_now() - t2)
        fills.append(t1 - t0)
        for m in ms:
            lib.accept(m, t)
    return fills, applies, ours


def run(args) -> dict:
    from transformers import AutoTokenizer

    from stateful_hf.models import DEFAULT_MODEL, fetch, is_fetched, model_dir
    if not is_fetched(DEFAULT_MODEL):
        fetch(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(str(model_dir(DEFAULT_MODEL)))
    vocab, eos = len(tok), tok.eos_token_id
    docs = {"json_schema": (SCHEMA, SCHEMA_DOC), "json_object": (None, OBJECT_DOC)}
    libs, out = [], {"tokenizer": DEFAULT_MODEL, "vocab": vocab, "batch": BATCH, "rounds": args.rounds,
                     "torch_threads": torch.get_num_threads(), "libraries": {}}
    for cls in LIBRARIES:
        try:
            libs.append(cls(tok, vocab, eos))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    logits = torch.randn(BATCH, vocab)
    samples: dict = {lib.name: {k: {"fill": [], "accept": [], "batch_fill": [], "apply": [], "ours": []} for k in docs}
                     for lib in libs}
    compiled: dict = {}
    for lib in libs:
        rec = out["libraries"][lib.name] = {"tokenizer_setup_s": lib.setup, "compile_s": {}}
        for kind, (schema, _) in docs.items():
            t0 = _now()
            try:
                compiled[lib.name, kind] = lib.compile(schema)
                rec["compile_s"][kind] = _now() - t0
            except Exception as e:  # noqa: BLE001 - a library that cannot compile this kind: reported
                rec["compile_s"][kind] = f"fails: {type(e).__name__}: {str(e)[:200]}"
    for _ in range(args.rounds):
        for lib in libs:
            for kind, (_, doc) in docs.items():
                if (lib.name, kind) not in compiled:
                    continue
                ids = tok(json.dumps(doc), add_special_tokens=False)["input_ids"] + [eos]
                f, a = walk(lib, compiled[lib.name, kind], ids)
                bf, ap, ours = walk_batch(lib, compiled[lib.name, kind], ids, logits)
                s = samples[lib.name][kind]
                s["fill"] += f
                s["accept"] += a
                s["batch_fill"] += bf
                s["apply"] += ap
                s["ours"] += ours
    for lib in libs:
        for kind, s in samples[lib.name].items():
            if not s["fill"]:
                continue
            out["libraries"][lib.name][kind] = {
                "fill_us_median": 1e6 * statistics.median(s["fill"]), "fill_us_p90": 1e6 * _p90(s["fill"]),
                "accept_us_median": 1e6 * statistics.median(s["accept"]),
                "batch24_fill_us_median": 1e6 * statistics.median(s["batch_fill"]),
                "batch24_apply_us_median": 1e6 * statistics.median(s["apply"]),
                "batch24_engine_apply_us_median": 1e6 * statistics.median(s["ours"]),
                "tokens": len(s["fill"]) // args.rounds}
    return out


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    res = run(args)
    print(f"{'library':<14} {'kind':<12} {'setup s':>8} {'compile s':>10} {'fill us':>8} {'p90':>8} {'accept us':>9} "
          f"{'24 fill us':>10} {'24 apply us':>11} {'engine apply':>12}")
    for name, r in res["libraries"].items():
        for kind in ("json_schema", "json_object"):
            c = r["compile_s"].get(kind)
            if kind not in r:
                print(f"{name:<14} {kind:<12} {r['tokenizer_setup_s']:>8.2f} {c}")
                continue
            k = r[kind]
            print(f"{name:<14} {kind:<12} {r['tokenizer_setup_s']:>8.2f} {c:>10.3f} {k['fill_us_median']:>8.1f} "
                  f"{k['fill_us_p90']:>8.1f} {k['accept_us_median']:>9.1f} {k['batch24_fill_us_median']:>10.1f} "
                  f"{k['batch24_apply_us_median']:>11.1f} {k['batch24_engine_apply_us_median']:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
