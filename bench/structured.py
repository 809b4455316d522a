"""Structured-outputs benchmark (issue 13): what constraining 256 requests to JSON schemas costs.

Workload: 256 extraction requests, each with one of 8 realistic schemas (a contact, an invoice,
a product, an event, a review, an address, a job posting, a citation) and a short generated
document to extract from, greedy, the same ``max_tokens`` for every request. Model: the SmolLM2-135M
demo model (49,152-token vocabulary) when its package is installed, else a random Llama with a
49,152-token vocabulary over the tiny tokenizer (only 320 real tokens: its masks are far cheaper
than a real vocabulary's, so the fill figures then say little).

Two halves:

1. Backend level, per backend (llguidance, and xgrammar when installed): 256 matchers (the 8
   schemas in turn) advanced to varied points of valid extractions (tokenized by the model's
   tokenizer), then stepped one token at a time; each step fills the 256-row bitmask
   (``GrammarBackend.fill_bitmask``) and, separately, asks every matcher for its forced tokens as
   the engine does. The median over the steps (best of three rounds).
2. End to end: ``LLM.generate`` of the workload unconstrained, then constrained
   (``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``) per backend, and
   once more with llguidance and ``jump_forward=False`` (the grammar's cost alone, without the
   steps jump-forward saves); greedy, one run each, in this process. Reported: tokens/s
   constrained / tokens/s unconstrained (generated tokens, jump-forward ones included, over wall
   time), the share of outputs that parse and validate (``max_tokens`` cuts some: the default 64
   keeps the run short on 2 cores), the engine's mask-fill time per step and how long the step
   waited for it after the forward (the fill runs on a helper thread during the forward).

Targets on the 2-core CPU: ratio >= 0.85, mask fill <= 2 ms per step at 256 rows.

``--mask-cost`` (issue 27 item 5) instead measures what one request's grammar costs a step, as the
engine pays it (its forced tokens, the mask fill unless the text is forced, the token's accept), for
a simple regex and for DFA-heavy ones (counted repeats whose lexer builds new expressions every
token), with the lexer-fuel bound on (``StructuredLimits.lexer_fuel``'s default, what the scheduler
and the workers use) and off (llguidance's own fuel, 1,000,000): each spec's median ms a step over
``--mask-steps`` tokens (64: the issue's ``max_tokens``) or until it fails, its ratio to the simple
regex, the scheduler check's verdict, and what 20 such requests would hold a worker for in grammar
work alone.

    python bench/structured.py                  # the default run (~5 minutes on 2 cores)
    python bench/structured.py --quick          # 64 requests (~1.5 minutes)
    python bench/structured.py --backend-only   # only the backend-level half
    python bench/structured.py --quick --device cuda
    python bench/structured.py --mask-cost      # the per-request mask cost, bound on vs off (~30 s)

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from batchinfer import LLM, SamplingParams
from batchinfer.workers.models.demo import demo_gguf
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.structured.backend import GrammarBackend, Matcher, StructuredOutputError
from batchinfer.workers.structured.bitmask import first_allowed
from batchinfer.workers.structured.factory import make_backend
from batchinfer.workers.structured_params import StructuredLimits, StructuredOutputsParams
from batchinfer.workers.text.tokenizer import Tokenizer

VOCAB = 49152  # SmolLM2's; the random fallback model gets the same width
ROWS = 256

_STR = {"type": "string", "maxLength": 40}
SCHEMAS: dict[str, dict[str, Any]] = {
    "contact": {
        "type": "object",
        "properties": {"name": _STR, "email": {"type": "string", "format": "email"},
                       "phone": {"type": "string", "pattern": r"^\+?[0-9][0-9 -]{6,16}$"},
                       "company": _STR},
        "required": ["name", "email", "phone", "company"], "additionalProperties": False},
    "invoice": {
        "type": "object",
        "properties": {"invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,8}$"},
                       "date": {"type": "string", "format": "date"},
                       "total": {"type": "number", "minimum": 0, "maximum": 1000000},
                       "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
                       "paid": {"type": "boolean"}},
        "required": ["invoice_number", "date", "total", "currency", "paid"], "additionalProperties": False},
    "product": {
        "type": "object",
        "properties": {"name": _STR, "price": {"type": "number", "minimum": 0, "maximum": 100000},
                       "in_stock": {"type": "boolean"},
                       "category": {"enum": ["electronics", "books", "clothing", "home", "toys"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                "maxItems": 3}},
        "required": ["name", "price", "in_stock", "category", "tags"], "additionalProperties": False},
    "event": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 60},
                       "date": {"type": "string", "format": "date"},
                       "city": {"type": "string", "maxLength": 30},
                       "attendees": {"type": "integer", "minimum": 0, "maximum": 100000}},
        "required": ["title", "date", "city", "attendees"], "additionalProperties": False},
    "review": {
        "type": "object",
        "properties": {"product": _STR, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                       "sentiment": {"enum": ["positive", "neutral", "negative"]},
                       "summary": {"type": "string", "maxLength": 80}},
        "required": ["product", "rating", "sentiment", "summary"], "additionalProperties": False},
    "address": {
        "type": "object",
        "properties": {"street": _STR, "city": {"type": "string", "maxLength": 30},
                       "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "country": {"enum": ["US", "DE", "FR", "GB", "JP"]}},
        "required": ["street", "city", "postal_code", "country"], "additionalProperties": False},
    "job": {
        "type": "object",
        "properties": {"title": _STR, "company": _STR, "remote": {"type": "boolean"},
                       "salary_min": {"type": "integer", "minimum": 0, "maximum": 1000000},
                       "salary_max": {"type": "integer", "minimum": 0, "maximum": 1000000},
                       "skills": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                  "maxItems": 4}},
        "required": ["title", "company", "remote", "salary_min", "salary_max", "skills"],
        "additionalProperties": False},
    "citation": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 80},
                       "authors": {"type": "array", "maxItems": 3, "items": {
                           "type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                            "last": {"type": "string", "maxLength": 20}},
                           "required": ["first", "last"], "additionalProperties": False}},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "venue": _STR},
        "required": ["title", "authors", "year", "venue"], "additionalProperties": False},
}

_FIRST = ["Ada", "Grace", "Alan", "Linus", "Barbara", "Ken", "Margaret", "Dennis", "Frances", "John"]
_LAST = ["Lovelace", "Hopper", "Turing", "Torvalds", "Liskov", "Thompson", "Hamilton", "Ritchie", "Allen"]
_CITY = ["Berlin", "Paris", "London", "Tokyo", "Boston", "Lyon", "Munich", "Osaka", "Leeds"]
_COMPANY = ["Acme Corp", "Globex", "Initech", "Umbrella Labs", "Stark Industries", "Wayne Tech"]
_PRODUCT = ["Noise-cancelling headphones", "Espresso machine", "Trail running shoes", "Desk lamp",
            "Mechanical keyboard", "Board game"]


def example(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A short document of ``kind`` and the extraction that matches it (valid for its schema)."""
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    city, company = rng.choice(_CITY), rng.choice(_COMPANY)
    day = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == "contact":
        phone = f"+49 30 {rng.randint(1000000, 9999999)}"
        email = f"{first.lower()}.{last.lower()}@example.com"
        return (f"Hi, this is {first} {last} from {company}. Write to {email} or call {phone}.",
                {"name": f"{first} {last}", "email": email, "phone": phone, "company": company})
    if kind == "invoice":
        number, total = f"INV-{rng.randint(1000, 99999)}", round(rng.uniform(10, 5000), 2)
        cur, paid = rng.choice(["USD", "EUR", "GBP"]), rng.random() < 0.5
        return (f"Invoice {number} dated {day}: total {total} {cur}, {'paid' if paid else 'due in 30 days'}.",
                {"invoice_number": number, "date": day, "total": total, "currency": cur, "paid": paid})
    if kind == "product":
        name, price = rng.choice(_PRODUCT), round(rng.uniform(5, 900), 2)
        stock = rng.random() < 0.7
        return (f"{name}, now {price} dollars, {'in stock' if stock else 'sold out'}. Great for gifts.",
                {"name": name, "price": price, "in_stock": stock, "category": "electronics",
                 "tags": ["gift", "new"]})
    if kind == "event":
        n = rng.randint(50, 5000)
        return (f"The {city} Tech Meetup takes place on {day}; {n} people have signed up.",
                {"title": f"{city} Tech Meetup", "date": day, "city": city, "attendees": n})
    if kind == "review":
        name, stars = rng.choice(_PRODUCT), rng.randint(1, 5)
        mood = "positive" if stars >= 4 else "neutral" if stars == 3 else "negative"
        return (f"I gave the {name} {stars} stars. {'Love it!' if stars >= 4 else 'It broke after a week.'}",
                {"product": name, "rating": stars, "sentiment": mood, "summary": f"{stars}-star review"})
    if kind == "address":
        street, code = f"{rng.randint(1, 200)} Main Street", f"{rng.randint(10000, 99999)}"
        return (f"Ship it to {first} {last}, {street}, {code} {city}, Germany.",
                {"street": street, "city": city, "postal_code": code, "country": "DE"})
    if kind == "job":
        low = rng.randint(40, 90) * 1000
        return (f"{company} is hiring a Backend Engineer (remote) paying {low} to {low + 30000} a year; "
                f"Python and SQL required.",
                {"title": "Backend Engineer", "company": company, "remote": True, "salary_min": low,
                 "salary_max": low + 30000, "skills": ["Python", "SQL"]})
    year = rng.randint(1950, 2025)
    return (f"{first} {last} and {rng.choice(_FIRST)} {rng.choice(_LAST)}, 'On Computable Streams', "
            f"Journal of Systems, {year}.",
            {"title": "On Computable Streams", "authors": [{"first": first, "last": last}], "year": year,
             "venue": "Journal of Systems"})


def workload(n: int, seed: int = 0) -> list[tuple[str, str, dict[str, Any]]]:
    """``n`` (schema name, document, extraction), the 8 schemas in turn."""
    rng = random.Random(seed)
    names = list(SCHEMAS)
    return [(names[i % len(names)], *example(names[i % len(names)], rng)) for i in range(n)]


def validator(schema: dict[str, Any]):
    """A ``jsonschema`` validator (format checks on) or None when the library is not installed."""
    if importlib.util.find_spec("jsonschema") is None:
        return None
    import jsonschema

    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


# -- backend level ----------------------------------------------------------------------------------

def bench_backend(name: str, tok: Tokenizer, vocab: int, eos: list[int], steps: int,
                  threads: int | None) -> dict[str, Any]:
    """Median 256-row mask fill and forced-token lookups per step for one backend."""
    t0 = time.perf_counter()
    backend = make_backend(name, tok, vocab, eos, num_threads=threads)
    build_s = time.perf_counter() - t0
    compile_ms = {}
    for kind, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        compile_ms[kind] = (time.perf_counter() - t0) * 1e3
    # Each row walks a valid extraction token by token, starting at a different point of it.
    rows: list[dict[str, Any]] = []
    for i, (kind, _, answer) in enumerate(workload(ROWS, seed=1)):
        v = validator(SCHEMAS[kind])
        if v is not None:
            v.validate(answer)
        ids = tok.encode(json.dumps(answer, separators=(",", ":")), add_special_tokens=False)
        row = {"params": StructuredOutputsParams(json=SCHEMAS[kind]), "ids": ids, "pos": 0}
        row["matcher"] = backend.matcher(backend.compile(row["params"]))
        for _ in range((i * 7) % len(ids)):
            _advance(backend, row)
        rows.append(row)
    bitmask = backend.allocate_bitmask(ROWS)
    _fill(backend, rows, bitmask)  # warm up (first-use tables, thread pools)
    for r in rows:
        r["matcher"].forced_tokens()
    # Three rounds of steps; the best round's median counts (a shared machine's other load only
    # ever adds time), and the p90 over all steps shows the spread.
    fills, forced, round_medians = [], [], []
    for _ in range(3):
        this_round = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _fill(backend, rows, bitmask)
            this_round.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for r in rows:
                r["matcher"].forced_tokens()
            forced.append(time.perf_counter() - t0)
            for r in rows:
                _advance(backend, r)
        fills += this_round
        round_medians.append(statistics.median(this_round))
    return {"build_s": round(build_s, 3), "compile_ms": {k: round(v, 2) for k, v in compile_ms.items()},
            "fill_ms_median": round(min(round_medians) * 1e3, 3),
            "fill_ms_p90": round(sorted(fills)[int(0.9 * len(fills))] * 1e3, 3),
            "forced_ms_median": round(statistics.median(forced) * 1e3, 3)}


def _fill(backend: GrammarBackend, rows: list[dict[str, Any]], bitmask: torch.Tensor) -> None:
    pairs: list[tuple[Matcher, int]] = [(r["matcher"], j) for j, r in enumerate(rows)]
    backend.fill_bitmask(pairs, bitmask)


def _advance(backend: GrammarBackend, row: dict[str, Any]) -> None:
    """One more token of the row's extraction; a fresh matcher after the last one."""
    if row["pos"] >= len(row["ids"]):
        row["matcher"], row["pos"] = backend.matcher(backend.compile(row["params"])), 0
    if not row["matcher"].accept(row["ids"][row["pos"]]):
        raise RuntimeError(f"{backend.name} rejected a valid extraction: {row['matcher'].error}")
    row["pos"] += 1


# -- one request's mask cost a step: a DFA-heavy regex vs a simple one, bound on vs off ---------------

SIMPLE_REGEX = "[a-z ]{1,200}"
# Counted repeats: forced text the lexer looks ahead through, building derivative expressions as it goes.
DFA_HEAVY = {"heavy_100": "(x{100}){100}", "heavy_300": "(x{300}){300}", "heavy_1000": "(x{1000}){1000}"}
UNBOUNDED_FUEL = 1_000_000  # llguidance's own initial_lexer_fuel: the bound off


def mask_cost(backend: GrammarBackend, regex: str, steps: int) -> dict[str, Any]:
    """One fresh matcher of ``regex`` stepped ``steps`` tokens as the engine steps a request (forced
    tokens, the mask fill unless forced, the accept; the token: the forced one, else the lowest
    allowed one); the per-step times until it fails, and the scheduler check's verdict."""
    params = StructuredOutputsParams(regex=regex)
    # A compile of its own (not the cache's): a spec's matchers share their lexer's states, so a
    # matcher of an already probed spec would not pay for them again.
    matcher = backend.matcher(backend._compile(params))
    bitmask = backend.allocate_bitmask(1)
    eos = set(backend.eos_token_ids)
    times: list[float] = []
    error = None
    for _ in range(steps):
        t0 = time.perf_counter()
        forced = matcher.forced_tokens()
        if not forced:
            backend.fill_bitmask([(matcher, 0)], bitmask)
        if matcher.error is None:
            token = forced[0] if forced else first_allowed(bitmask[0], backend.vocab_size, eos)
            if token is not None:
                matcher.accept(token)
        times.append(time.perf_counter() - t0)
        error = matcher.error
        if error is not None or token is None or matcher.is_terminated:
            break
    try:
        backend.validate(params)
        verdict = "accepted"
    except StructuredOutputError as e:
        verdict = f"refused: {e}"
    return {"verdict": verdict, "steps": len(times), "error": error,
            "ms_per_step_median": round(statistics.median(times) * 1e3, 3),
            "ms_per_step_max": round(max(times) * 1e3, 3), "total_ms": round(sum(times) * 1e3, 2)}


def bench_mask_cost(tok: Tokenizer, vocab: int, eos: list[int], steps: int) -> dict[str, Any]:
    """``mask_cost`` of the simple regex and the DFA-heavy ones, with the lexer-fuel bound on and off."""
    result: dict[str, Any] = {}
    for label, fuel in (("bound_on", StructuredLimits().lexer_fuel), ("bound_off", UNBOUNDED_FUEL)):
        backend = make_backend("llguidance", tok, vocab, eos, limits=StructuredLimits(lexer_fuel=fuel),
                               num_threads=1)
        mask_cost(backend, SIMPLE_REGEX, 2)  # warm up (first-use tables)
        rows = {"simple": mask_cost(backend, SIMPLE_REGEX, steps)}
        rows.update({name: mask_cost(backend, regex, steps) for name, regex in DFA_HEAVY.items()})
        base = rows["simple"]["ms_per_step_median"]
        print(f"-- lexer fuel {fuel:,} ({label.replace('_', ' ')})")
        for name, row in rows.items():
            row["ratio_to_simple"] = round(row["ms_per_step_median"] / base, 1) if base else None
            regex = SIMPLE_REGEX if name == "simple" else DFA_HEAVY[name]
            # what 20 such requests at max_tokens=steps hold a worker for in grammar work alone
            row["twenty_requests_s"] = round(20 * row["ms_per_step_median"] * steps / 1e3, 2) \
                if row["error"] is None else round(20 * row["total_ms"] / 1e3, 2)
            ended = f"failed at step {row['steps']}: {row['error']}" if row["error"] \
                else f"{row['steps']} steps"
            print(f"{name:10s} {regex:16s} {row['ms_per_step_median']:8.3f} ms/step median "
                  f"(max {row['ms_per_step_max']:.3f}, x{row['ratio_to_simple']} the simple regex), "
                  f"{ended}; 20 requests: {row['twenty_requests_s']} s; scheduler: {row['verdict'][:90]}",
                  flush=True)
        result[label] = {"lexer_fuel": fuel, **rows}
    return result


# -- end to end -------------------------------------------------------------------------------------

def prompts_for(tok: Tokenizer, items: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    out = []
    for kind, doc, _ in items:
        fields = ", ".join(SCHEMAS[kind]["properties"])
        ask = f"Extract the {kind} ({fields}) from this text as JSON.\n{doc}"
        messages = [{"role": "user", "content": ask}]
        out.append(tok.apply_chat_template(messages, add_generation_prompt=True))
    return out


def run_llm(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def bench_engine(model: Path, device: str, runs: list[tuple[str, bool]], items, max_tokens: int,
                 threads: int | None) -> dict[str, Any]:
    """Unconstrained once, then constrained per ``(backend, jump_forward)`` run: tokens/s, the
    ratio to unconstrained, validity, the engine's grammar counters."""
    result: dict[str, Any] = {}
    base_tps = None
    for name, jump in runs:
        label = name if jump else f"{name}_no_jump_forward"
        llm = LLM(model, device=device, max_num_seqs=ROWS, max_num_batched_tokens=4096,
                  structured_outputs_backend=name, grammar_threads=threads, jump_forward=jump)
        tok = llm.get_tokenizer()
        prompts = prompts_for(tok, items)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        if base_tps is None:
            free = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            wall, outs = run_llm(llm, prompts, [free] * len(prompts))
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            base_tps = tokens / wall
            result["unconstrained"] = {"wall_s": round(wall, 2), "tokens": tokens,
                                       "tokens_per_s": round(base_tps, 1)}
            print(f"unconstrained:                     {wall:6.1f} s  {tokens:6d} tokens  "
                  f"{base_tps:6.1f} tokens/s", flush=True)
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[kind]))
                  for kind, _, _ in items]
        wall, outs = run_llm(llm, prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        valid = complete = 0
        for (kind, _, _), o in zip(items, outs, strict=True):
            c = o.outputs[0]
            complete += bool(c.structured_complete)
            try:
                value = json.loads(c.text)
            except ValueError:
                continue  # cut off by max_tokens
            v = validator(SCHEMAS[kind])
            valid += v is None or v.is_valid(value)
        stats = llm.engine.structured.stats()
        tps = tokens / wall
        steps = max(1, stats["num_steps"])
        result[label] = {
            "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tps, 1),
            "ratio": round(tps / base_tps, 3), "valid": valid, "complete": complete, "requests": len(items),
            "grammar_steps": stats["num_steps"], "jump_forward_tokens": stats["num_jump_forward_tokens"],
            "mask_fill_ms_per_step": round(stats["mask_fill_seconds"] / steps * 1e3, 3),
            "mask_wait_ms_per_step": round(stats["mask_wait_seconds"] / steps * 1e3, 3)}
        r = result[label]
        print(f"constrained {label:23s} {wall:6.1f} s  {tokens:6d} tokens  {tps:6.1f} tokens/s  "
              f"ratio {r['ratio']:.3f}  valid {valid}/{len(items)} (complete {complete})  "
              f"{stats['num_steps']} steps, jump-forward {r['jump_forward_tokens']} tokens, fill "
              f"{r['mask_fill_ms_per_step']:.2f} ms/step (waited {r['mask_wait_ms_per_step']:.2f})",
              flush=True)
        del llm
        gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 requests, 20 steps a round")
    ap.add_argument("--requests", type=int, default=None, help="requests end to end (default 256)")
    ap.add_argument("--max-tokens", type=int, default=None, help="max_tokens of every request (default 64)")
    ap.add_argument("--steps", type=int, default=None, help="backend-level steps a round (default 40)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="auto",
                    help="auto (the demo model if installed), demo, random, or a path")
    ap.add_argument("--backends", default=None,
                    help="backend level: comma list (default: llguidance, and xgrammar if installed)")
    ap.add_argument("--engine-backends", default=None,
                    help="end to end: comma list (default: the backend-level ones)")
    ap.add_argument("--no-jump-forward-run", action=argparse.BooleanOptionalAction, default=True,
                    help="also run llguidance end to end with jump_forward off (default: on)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads and grammar_threads")
    ap.add_argument("--backend-only", action="store_true", help="skip the end-to-end half")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    ap.add_argument("--mask-cost", action="store_true",
                    help="only one request's mask cost a step: DFA-heavy regexes vs a simple one")
    ap.add_argument("--mask-steps", type=int, default=64, help="--mask-cost: tokens a spec is stepped (64)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.requests or (64 if args.quick else ROWS)
    max_tokens = args.max_tokens or 64
    steps = args.steps or (20 if args.quick else 40)
    have_xgrammar = importlib.util.find_spec("xgrammar") is not None
    backends = args.backends.split(",") if args.backends else ["llguidance"] + ["xgrammar"] * have_xgrammar
    if not have_xgrammar:
        print("xgrammar is not installed: its figures are skipped")
        backends = [b for b in backends if b != "xgrammar"]
    engine_backends = [b for b in args.engine_backends.split(",") if b != "xgrammar" or have_xgrammar] \
        if args.engine_backends else backends
    runs = [(b, True) for b in engine_backends] + [(engine_backends[0], False)] * args.no_jump_forward_run

    tmp = tempfile.TemporaryDirectory()
    model: Path
    if args.model in ("auto", "demo"):
        try:
            model = demo_gguf()
        except FileNotFoundError:
            if args.model == "demo":
                raise
            model = Path()
    else:
        model = Path(args.model) if args.model != "random" else Path()
    if model == Path():
        model = make_tiny_model(tmp.name, vocab_size=VOCAB, hidden_size=256, intermediate_size=768,
                                num_hidden_layers=4, max_position_embeddings=1024)
        print(f"model: a random Llama with a {VOCAB}-token vocabulary over the tiny tokenizer "
              "(320 real tokens: the mask figures are not representative)")
        tok = Tokenizer.from_dir(model)
        vocab = VOCAB
    else:
        print(f"model: {model.name}")
        tok = Tokenizer.from_gguf(model) if model.suffix == ".gguf" else Tokenizer.from_dir(model)
        vocab = tok.vocab_size
    eos = tok.eos_token_ids
    print(f"vocab {vocab}, eos {eos}, torch threads {torch.get_num_threads()}, backends {backends}")

    if args.mask_cost:
        cost = bench_mask_cost(tok, vocab, eos, args.mask_steps)
        summary = {"model": model.name, "vocab": vocab, "steps": args.mask_steps}
        for label, rows in cost.items():
            summary[f"{label}_simple_ms"] = rows["simple"]["ms_per_step_median"]
            for name in DFA_HEAVY:
                r = rows[name]
                summary[f"{label}_{name}_ratio"] = r["ratio_to_simple"]
                summary[f"{label}_{name}_ended"] = f"error at step {r['steps']}" if r["error"] else "served"
        if args.json:
            Path(args.json).write_text(json.dumps({"model": model.name, "mask_cost": cost}, indent=2) + "\n")
        print("== structured outputs: mask cost a step per request")
        print(json.dumps(summary))
        return
    result: dict[str, Any] = {"model": model.name, "vocab": vocab, "requests": n, "max_tokens": max_tokens,
                              "device": args.device, "backend": {}}
    for name in backends:
        r = bench_backend(name, tok, vocab, eos, steps, args.threads)
        result["backend"][name] = r
        compile_ms = sum(r["compile_ms"].values())
        print(f"backend {name:11s} build {r['build_s']:.2f} s, compile {compile_ms:.1f} ms "
              f"for 8 schemas, fill {r['fill_ms_median']:.3f} ms/step median (p90 {r['fill_ms_p90']:.3f}) "
              f"at {ROWS} rows, forced-token lookups {r['forced_ms_median']:.3f} ms/step", flush=True)
    if not args.backend_only:
        result["engine"] = bench_engine(model, args.device, runs, workload(n), max_tokens, args.threads)
    print("== structured outputs")
    summary = {"model": result["model"], "requests": n, "max_tokens": max_tokens, "device": args.device}
    for name in backends:
        summary[f"{name}_fill_ms"] = result["backend"][name]["fill_ms_median"]
    for label, r in result.get("engine", {}).items():
        if label != "unconstrained":
            summary[f"{label}_ratio"] = r["ratio"]
            summary[f"{label}_valid"] = f"{r['valid']}/{n}"
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
