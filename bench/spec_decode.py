"""Speculative decoding on a repetitive workload: tokens/s with ngram, suffix and predicted outputs
against no speculation, and a long-tail job's makespan, in one run.

Model: SmolLM2-135M-Instruct (the demo's GGUF file), greedy, its chat template; the workload mixes
three tasks whose answers repeat their prompts (request i gets task i % 3), each on its own
generated paragraph (4-6 sentences drawn from shared sentence templates, so a job's documents
share phrasing as a real batch job's do):

- extract: the paragraph, then "Copy the sentences that mention the <thing>.";
- rewrite: "Rewrite this paragraph fixing the typos:" and the paragraph with a few letters swapped;
- edit: "Replace <name> with <other name> ..." and the paragraph; its ``prediction`` (OpenAI
  predicted outputs) is the paragraph itself.

(a) At each concurrency c (requests in the engine at once), waves of c requests run to completion
(``LLM.generate`` of the wave), as many as it takes the no-speculation run to generate
``--min-tokens`` output tokens (256; ``max_tokens`` 80 each); each wave runs under every
configuration in turn (the order rotating from wave to wave). Configurations:
none (no speculation at all), ngram, suffix, and prediction (no method: only the edit requests,
which carry a prediction, speculate; the other two tasks decode plainly, so its ratio is diluted:
the c=1 table by task shows it undiluted). Every method at its defaults
(``num_speculative_tokens`` 4, ``disable_by_batch_size`` 16 unless a row says otherwise). Figures:
output tokens/s, the ratio to none at the same concurrency (also of CPU time: this process's CPU
seconds leave out the time it waited for a core on a shared machine), engine steps and the wall
time a step, the acceptance rate (accepted / drafted
tokens) and the mean accepted length (tokens a sequence gains per step that verified its drafts:
1 + accepted / drafts), and the share of steps the batch-size switch turned drafting off. At the
largest concurrency past the default switch, extra rows run with ``disable_by_batch_size=None``
(drafting never off): what the switch saves.

(b) A job with a long tail: ``--tail-requests`` (32) requests submitted at once, all but 4 with
``--tail-tokens`` (12) output tokens, those 4 with 10x as many (``ignore_eos``; they rewrite or edit
a 10-sentence document, which takes them all those tokens to copy): the wall-clock makespan with no
speculation, ngram and suffix (the switch at its default: drafting comes on once the short requests
are gone), the mean of two rounds (the configurations in turn, then in reverse).

Every configuration's token ids are checked against the no-speculation run's (speculation never
changes an output): a difference is printed and the command exits 1 after its tables.

One model load serves every configuration: each configuration gets its own speculative decoder at
each concurrency (``build_decoder``), installed in the engine for its waves (``install``), so all
of them run the same weights and KV cache, and the suffix proposer's history holds only that
configuration's earlier waves, as it would hold a job's earlier requests. Prefix caching is off so
that no configuration reuses another's prompts. On a machine shared with other work, ``--threads 1``
gives steadier figures (OpenMP threads waiting at barriers for a descheduled sibling make
multi-threaded timings swing).

    python -P bench/spec_decode.py                         # the full run (~10 CPU minutes)
    OMP_NUM_THREADS=1 python -P bench/spec_decode.py --threads 1
    python -P bench/spec_decode.py --quick                 # a smoke version (1-2 minutes on CPU)
    python -P bench/spec_decode.py --quick --device cuda   # bench/gpu_check.sh's `spec` section
    python -P bench/spec_decode.py --concurrency 1 4 --model PATH   # any HF folder or .gguf file

``--model auto`` (the default): the demo model, else (package not installed) a tiny random Llama,
whose figures only show that the bench runs. The last line printed is one JSON object:
{"ratios": {"<configuration>@<c>": ratio}, "acceptance": {...}, "tail_speedup": {...},
"identical": bool, "seconds": float}; ``--json FILE`` writes every row.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchinfer import LLM, SamplingParams
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.models.demo import demo_gguf, tiny_model
from batchinfer.workers.spec.decoder import SpecDecoder
from batchinfer.workers.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig

# configuration -> its speculative_config ("none": no speculative decoder at all)
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"use_predictions": False},
    "ngram": {"method": "ngram", "use_predictions": False},
    "suffix": {"method": "suffix", "use_predictions": False},
    "prediction": {"use_predictions": True},
}
TASKS = ("extract", "rewrite", "edit")
FULL = {"concurrency": [1, 4, 16, 64], "min_tokens": 256, "max_tokens": 80, "tail_requests": 32,
        "tail_tokens": 12}
QUICK = {"concurrency": [1, 8], "min_tokens": 32, "max_tokens": 32, "tail_requests": 8, "tail_tokens": 4}
LONG_TAIL = 4  # requests of the tail job with 10x the output
TAIL_FACTOR = 10
TAIL_ROUNDS = 2

NAMES = ["Maria Lopez", "Tom Becker", "Aiko Tanaka", "Omar Haddad", "Lena Novak", "Samuel Okafor",
         "Priya Nair", "Jonas Berg", "Clara Dubois", "Mateo Rossi"]
TOWNS = ["Alder Bend", "Millbrook", "Stonehaven", "Clearwater", "Redfield", "Ashford", "Pine Hollow",
         "Eastmere", "Brightwater", "Oakridge"]
GOODS = ["apples", "cheese", "honey", "wool", "bread", "pottery", "fish", "timber", "cider", "eggs"]
THINGS = ["bridge", "library", "school", "market hall", "clock tower", "harbour", "train station", "museum"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
COLOURS = ["red", "blue", "green", "white", "yellow"]
# Each sentence template mentions the paragraph's thing or not; the extract task asks for the former.
SENTENCES = [
    "The town of {town} holds a market every {day}.",
    "Farmers bring {good1}, {good2} and {good3} from the hills.",
    "In {year} a flood closed the {thing} for {n} months.",
    "{name} rebuilt the {thing} with stone from the old mill.",
    "Today the {thing} serves more than {count} people a day.",
    "{name2} opened a shop selling {good1} near the {thing}.",
    "The council painted the {thing} {colour} in {year2}.",
    "Every summer {name2} organises a festival for the children of {town}.",
    "The road to {town} is closed in winter when the snow is deep.",
    "Visitors often buy {good2} and {good3} before they leave.",
]


@dataclass
class Job:
    """One request of the workload: its prompt ids, task, output budget and predicted output."""

    prompt_token_ids: list[int]
    task: str
    max_tokens: int
    ignore_eos: bool = False
    prediction: str | None = None

    def params(self, use_predictions: bool) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              prediction=self.prediction if use_predictions else None)


def paragraph(rng: random.Random, sentences: tuple[int, int] = (4, 6)) -> tuple[str, dict[str, str]]:
    """A paragraph of ``sentences`` (least, most) template sentences, at least one about its thing,
    and its slot values."""
    name, name2, other = rng.sample(NAMES, 3)
    goods = rng.sample(GOODS, 3)
    slots = {"town": rng.choice(TOWNS), "day": rng.choice(DAYS), "good1": goods[0], "good2": goods[1],
             "good3": goods[2], "year": str(rng.randint(1890, 2010)), "year2": str(rng.randint(1950, 2020)),
             "n": str(rng.randint(2, 11)), "name": name, "name2": name2, "other": other,
             "thing": rng.choice(THINGS), "count": str(rng.randint(3, 40) * 100),
             "colour": rng.choice(COLOURS)}
    chosen = rng.sample(range(len(SENTENCES)), rng.randint(*sentences))
    if not any("{thing}" in SENTENCES[i] for i in chosen):
        chosen[0] = 2
    if not any("{name}" in SENTENCES[i] or "{name2}" in SENTENCES[i] for i in chosen):
        chosen[-1] = 3
    return " ".join(SENTENCES[i].format(**slots) for i in chosen), slots


def with_typos(text: str, rng: random.Random, count: int = 5) -> str:
    """``text`` with two inner letters swapped in ``count`` of its longer words."""
    words = text.split(" ")
    long_words = [i for i, w in enumerate(words) if len(w.strip(".,")) >= 5]
    for i in rng.sample(long_words, min(count, len(long_words))):
        w = words[i]
        j = rng.randrange(1, len(w.strip(".,")) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def make_jobs(tokenizer: Any, n: int, seed: int, max_tokens: int, first_task: int = 0,
              tasks: tuple[str, ...] = TASKS, sentences: tuple[int, int] = (4, 6)) -> list[Job]:
    """``n`` requests, task ``tasks[(first_task + i) % len(tasks)]``, each on its own paragraph of
    ``sentences`` sentences, in the model's chat template."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        task = tasks[(first_task + i) % len(tasks)]
        text, slots = paragraph(rng, sentences)
        prediction = None
        if task == "extract":
            ask = f"{text}\n\nCopy the sentences that mention the {slots['thing']}."
        elif task == "rewrite":
            ask = f"Rewrite this paragraph fixing the typos:\n\n{with_typos(text, rng)}"
        else:
            who = slots["name"] if slots["name"] in text else slots["name2"]
            ask = (f"Replace {who} with {slots['other']} in this paragraph. Reply with the paragraph "
                   f"only.\n\n{text}")
            prediction = text
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                            tokenize=True)
        jobs.append(Job(list(ids), task, max_tokens, prediction=prediction))
    return jobs


def build_decoder(engine: Engine, spec: dict[str, Any]) -> SpecDecoder | None:
    """The speculative decoder ``Engine`` builds from ``EngineConfig.speculative_config`` = ``spec``
    (None for no speculation): each configuration gets its own, on one loaded model."""
    config = SpeculativeConfig.from_value(spec)
    assert config is not None and config.method != "draft"  # a draft model needs the engine's parts
    if config.method is None and not config.use_predictions:
        return None
    return SpecDecoder.build(config, max_model_len=engine.max_model_len)


def install(engine: Engine, decoder: SpecDecoder | None) -> None:
    """Make ``decoder`` the engine's (between ``generate`` calls: no sequence is running)."""
    engine.spec = decoder
    engine.scheduler.on_finish = None if decoder is None else decoder.release


@dataclass
class Run:
    """One configuration's measurement: its decoder (kept across its waves: the suffix proposer's
    history grows over them as over a job) and what its waves took and gave."""

    label: str
    spec: dict[str, Any]
    decoder: SpecDecoder | None = None
    wall: float = 0.0
    cpu: float = 0.0  # this process's CPU seconds: leaves out the time it waited for a core
    tokens: int = 0
    steps: int = 0
    token_ids: list[list[int]] = field(default_factory=list)  # per request, in submission order
    wave_walls: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall

    def acceptance(self) -> tuple[float | None, float | None]:
        """(accepted / drafted tokens, 1 + accepted / drafts) over every method that drafted."""
        if self.decoder is None:
            return None, None
        methods = self.decoder.summary()["methods"].values()
        drafts = sum(m["drafts"] for m in methods)
        drafted = sum(m["draft_tokens"] for m in methods)
        accepted = sum(m["accepted_tokens"] for m in methods)
        if not drafts:
            return None, None
        return accepted / drafted, 1 + accepted / drafts

    def off_share(self) -> float | None:
        """The share of its steps that the batch-size switch turned drafting off."""
        if self.decoder is None:
            return None
        return self.decoder.summary()["disabled_steps"] / max(1, self.steps)


def new_run(llm: LLM, label: str, spec: dict[str, Any]) -> Run:
    engine = llm.engine
    assert isinstance(engine, Engine)
    return Run(label, spec, build_decoder(engine, spec))


def run_wave(llm: LLM, run: Run, wave: list[Job]) -> None:
    """Run ``wave`` (all submitted at once, to completion) with ``run``'s decoder; add its figures."""
    engine = llm.engine
    assert isinstance(engine, Engine)
    install(engine, run.decoder)
    use_predictions = run.spec.get("use_predictions", True)
    prompts = [{"prompt_token_ids": j.prompt_token_ids} for j in wave]
    steps = engine.num_steps
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, [j.params(use_predictions) for j in wave], use_tqdm=False)
    run.wave_walls.append(time.perf_counter() - t0)
    run.cpu += time.process_time() - c0
    run.wall += run.wave_walls[-1]
    run.steps += engine.num_steps - steps
    for o in outs:
        run.token_ids.append(list(o.outputs[0].token_ids))
        run.tokens += len(o.outputs[0].token_ids)


def check_same(base: Run, run: Run, where: str, mismatches: list[str]) -> None:
    """Record every request whose tokens differ from the no-speculation run's."""
    for i, (want, got) in enumerate(zip(base.token_ids, run.token_ids, strict=True)):
        if want != got:
            at = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                      min(len(want), len(got)))
            mismatches.append(f"{where} {run.label}: request {i} differs from position {at} "
                              f"({len(want)} vs {len(got)} tokens)")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def bench_concurrency(llm: LLM, tokenizer: Any, cs: list[int], min_tokens: int, max_tokens: int,
                      mismatches: list[str]) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """(a): every configuration at every concurrency; table rows and the c=1 tokens/s by task.

    Waves of ``c`` requests are added until the no-speculation run has ``min_tokens`` (and every
    task has come up); each wave runs under every configuration in turn, the order rotating from
    wave to wave, so that the machine's drifting speed falls on all of them alike."""
    rows: list[dict[str, Any]] = []
    by_task: dict[str, dict[str, float]] = {}
    uncapped_at = max((c for c in cs if c > DEFAULT_DISABLE_BY_BATCH_SIZE), default=None)
    for c in cs:
        runs = [new_run(llm, name, CONFIGS[name]) for name in ("none", "ngram", "suffix", "prediction")]
        if c == uncapped_at:  # what the batch-size switch saves: the same with drafting never off
            runs += [new_run(llm, f"{name}, disable_by_batch_size=None",
                             {**CONFIGS[name], "disable_by_batch_size": None})
                     for name in ("ngram", "suffix")]
        base = runs[0]
        waves: list[list[Job]] = []
        while base.tokens < min_tokens or len(waves) * c < len(TASKS):
            waves.append(make_jobs(tokenizer, c, seed=1000 * c + len(waves), max_tokens=max_tokens,
                                   first_task=len(waves)))
            turn = len(waves) % len(runs)
            for run in runs[turn:] + runs[:turn]:
                run_wave(llm, run, waves[-1])
        for run in runs:
            check_same(base, run, f"c={c}", mismatches)
            rate, length = run.acceptance()
            row = {"c": c, "config": run.label, "requests": sum(map(len, waves)), "tokens": run.tokens,
                   "wall_s": round(run.wall, 2), "tokens_per_s": round(run.tokens_per_s, 2),
                   "ratio": round(run.tokens_per_s / base.tokens_per_s, 3),
                   "cpu_ratio": round(base.cpu / run.cpu, 3), "steps": run.steps,
                   "ms_per_step": round(run.wall / run.steps * 1e3, 1), "acceptance": rate,
                   "mean_accepted_length": length, "off_share": run.off_share()}
            rows.append(row)
            print(f"c={c:3d} {run.label:38s} {run.wall:7.1f} s {run.tokens:6d} tokens "
                  f"{run.tokens_per_s:7.1f} tok/s  x{row['ratio']:.2f} (CPU time x{row['cpu_ratio']:.2f})  "
                  f"acceptance {fmt(rate, '.2f')}  "
                  f"mean accepted length {fmt(length, '.2f')}", flush=True)
        if c == 1:  # one request a wave: each request's own tokens/s, summed by task
            jobs = [wave[0] for wave in waves]
            for task in TASKS:
                idx = [i for i, j in enumerate(jobs) if j.task == task]
                for run in runs:
                    tokens = sum(len(run.token_ids[i]) for i in idx)
                    by_task.setdefault(task, {})[run.label] = tokens / sum(run.wave_walls[i] for i in idx)
    return rows, by_task


def bench_tail(llm: LLM, tokenizer: Any, n: int, short: int,
               mismatches: list[str]) -> list[dict[str, Any]]:
    """(b): ``n`` requests at once, ``LONG_TAIL`` of them with ``TAIL_FACTOR`` x the output: the
    long ones rewrite or edit a long document (10 sentences: it takes them all their tokens to copy,
    where a short answer would end and ``ignore_eos`` go on with unrelated text). Two rounds, the
    configurations in turn and then in reverse, so that drift falls on all alike; the mean makespan."""
    jobs = make_jobs(tokenizer, n - LONG_TAIL, seed=7, max_tokens=short)
    longs = make_jobs(tokenizer, LONG_TAIL, seed=8, max_tokens=short * TAIL_FACTOR, tasks=("rewrite", "edit"),
                      sentences=(len(SENTENCES), len(SENTENCES)))
    for k, job in enumerate(longs):  # spread over the submission order
        jobs.insert(k * n // LONG_TAIL, job)
    for job in jobs:
        job.ignore_eos = True
    runs = [new_run(llm, name, CONFIGS[name]) for name in ("none", "ngram", "suffix")]
    for round_ in range(TAIL_ROUNDS):
        for run in runs if round_ % 2 == 0 else runs[::-1]:
            run_wave(llm, run, jobs)
    rows = []
    for run in runs:
        check_same(runs[0], run, "tail", mismatches)
        rate, length = run.acceptance()
        speedup = runs[0].wall / run.wall
        rows.append({"config": run.label, "makespan_s": round(run.wall / TAIL_ROUNDS, 2),
                     "tokens": run.tokens // TAIL_ROUNDS,
                     "speedup": round(speedup, 3), "cpu_speedup": round(runs[0].cpu / run.cpu, 3),
                     "acceptance": rate, "mean_accepted_length": length,
                     "off_share": run.off_share()})
        print(f"tail {run.label:8s} makespan {run.wall / TAIL_ROUNDS:7.1f} s  "
              f"{run.tokens // TAIL_ROUNDS} tokens  x{speedup:.2f} "
              f"(CPU time x{runs[0].cpu / run.cpu:.2f})  "
              f"acceptance {fmt(rate, '.2f')}", flush=True)
    return rows


def print_tables(rows: list[dict[str, Any]], by_task: dict[str, dict[str, float]],
                 tail: list[dict[str, Any]], tail_shape: str) -> None:
    print("| c (requests) | configuration | tokens | tok/s | ratio | ratio of CPU time | steps | ms/step "
          "| acceptance | mean accepted length | steps drafting off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['c']} ({r['requests']}) | {r['config']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
              f"**{r['ratio']:.2f}** | {r['cpu_ratio']:.2f} | {r['steps']} | {r['ms_per_step']:.0f} | "
              f"{fmt(r['acceptance'], '.2f')} | "
              f"{fmt(r['mean_accepted_length'], '.2f')} | {fmt(r['off_share'], '.0%')} |")
    if by_task:
        print()
        labels = list(next(iter(by_task.values())))
        print("| c=1, by task: tok/s (ratio) | " + " | ".join(labels) + " |")
        print("|---|" + "---|" * len(labels))
        for task, tps in by_task.items():
            cells = [f"{tps[label]:.1f} ({tps[label] / tps['none']:.2f})" for label in labels]
            print(f"| {task} | " + " | ".join(cells) + " |")
    print()
    print(f"| long-tail job: {tail_shape} | makespan s | tokens | speedup | speedup of CPU time | acceptance "
          "| steps drafting off |")
    print("|---|---|---|---|---|---|---|")
    for r in tail:
        print(f"| {r['config']} | {r['makespan_s']:.1f} | {r['tokens']} | **{r['speedup']:.2f}** | "
              f"{r['cpu_speedup']:.2f} | "
              f"{fmt(r['acceptance'], '.2f')} | {fmt(r['off_share'], '.0%')} |")


def load_model(name: str) -> Path | str:
    if name == "auto":
        try:
            return demo_gguf()
        except FileNotFoundError:
            print("the demo model is not installed: a tiny random Llama instead (its figures mean nothing)")
            return tiny_model()
    if name == "demo":
        return demo_gguf()
    return tiny_model() if name == "tiny" else Path(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke version: concurrency 1 and 8, 32 tokens each, an 8-request tail job")
    ap.add_argument("--device", default="cpu", help="cpu (the default) or cuda[:N]")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (float32: outputs comparable)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="requests in the engine at once (default 1 4 16 64; --quick 1 8)")
    ap.add_argument("--min-tokens", type=int, default=None,
                    help="output tokens per configuration and concurrency, at least (256; --quick 32)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="max_tokens of (a)'s requests (80; --quick 32)")
    ap.add_argument("--tail-requests", type=int, default=None, help="(b)'s requests (32; --quick 8)")
    ap.add_argument("--tail-tokens", type=int, default=None,
                    help="(b)'s short requests' output tokens; the 4 long ones get 10x (12; --quick 4)")
    ap.add_argument("--model", default="auto",
                    help="auto (the demo model, else a tiny random one), demo, tiny, a folder or a .gguf")
    ap.add_argument("--json", default=None, help="also write every row to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    w = dict(QUICK if args.quick else FULL)
    for key in w:
        if getattr(args, key) is not None:
            w[key] = getattr(args, key)
    if w["tail_requests"] < LONG_TAIL:
        ap.error(f"--tail-requests must be at least {LONG_TAIL}")
    started = time.perf_counter()
    model = load_model(args.model)
    cs: list[int] = w["concurrency"]
    longest = w["tail_tokens"] * TAIL_FACTOR
    seqs = max(*cs, w["tail_requests"])
    blocks = seqs * ((256 + max(w["max_tokens"], longest) + 32) // 16 + 2)  # prompts are < 200 tokens
    llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=seqs, num_kv_blocks=blocks,
              enable_prefix_caching=False, speculative_config=CONFIGS["none"])
    tokenizer = llm.get_tokenizer()
    warm = make_jobs(tokenizer, 3, seed=1, max_tokens=8)  # first-call allocations, every code path
    for name in ("none", "ngram", "prediction"):
        run_wave(llm, new_run(llm, name, CONFIGS[name]), warm)
    print(f"== spec_decode: {Path(model).name}, {args.device} {args.dtype}, {torch.get_num_threads()} "
          f"threads; {SpeculativeConfig().num_speculative_tokens} draft tokens, "
          f"disable_by_batch_size {DEFAULT_DISABLE_BY_BATCH_SIZE}; (a) greedy, max_tokens {w['max_tokens']}, "
          f">= {w['min_tokens']} tokens per configuration", flush=True)
    mismatches: list[str] = []
    rows, by_task = bench_concurrency(llm, tokenizer, cs, w["min_tokens"], w["max_tokens"], mismatches)
    tail = bench_tail(llm, tokenizer, w["tail_requests"], w["tail_tokens"], mismatches)
    shape = (f"{w['tail_requests']} requests at once, {w['tail_requests'] - LONG_TAIL} x {w['tail_tokens']} "
             f"+ {LONG_TAIL} x {longest} tokens")
    elapsed = time.perf_counter() - started
    print(f"== spec_decode: {Path(model).name}, {args.device}, {torch.get_num_threads()} threads, "
          f"{elapsed:.0f} s in all; outputs identical to no speculation: {'yes' if not mismatches else 'NO'}")
    print_tables(rows, by_task, tail, shape)
    summary = {"ratios": {f"{r['config']}@{r['c']}": r["ratio"] for r in rows if r["config"] != "none"},
               "acceptance": {f"{r['config']}@{r['c']}": None if r["acceptance"] is None
                              else round(r["acceptance"], 3) for r in rows if r["config"] != "none"},
               "tail_speedup": {r["config"]: r["speedup"] for r in tail if r["config"] != "none"},
               "identical": not mismatches, "seconds": round(elapsed, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "by_task_c1": by_task, "tail": tail,
                                               "summary": summary}, indent=2) + "\n")
    for line in mismatches:
        print("MISMATCH", line)
    print(json.dumps(summary))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
