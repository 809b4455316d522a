"""The rank side of tests/test_tp_model.py: what each spawned rank process runs.

A module of its own, imported as ``tp_ranks`` (tests/ is on pytest's ``pythonpath``, and a
spawned child gets its parent's ``sys.path``): a spawned rank unpickles its target by module name,
and a test module's name under ``--import-mode=importlib`` (``tests.test_tp_model``) is importable
only while the repository root is on ``sys.path``, which ``make test`` (``python -P``) keeps off it.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

from batchinfer.workers.models import Decoder, load_model
from batchinfer.workers.models.attention import AttentionMetadata
from batchinfer.workers.parallel.group import TPGroup, TPGroupError

# -- the workload every rank and the reference run ------------------------------------------------

def paged_logits(model: Decoder, block_size: int = 4, num_blocks: int = 48) -> torch.Tensor:
    """Logits [T_total, V] of a fixed workload: two sequences prefilled in chunks (one step mixing
    a chunk and a decode), then decode steps; blocks from a shuffled pool (the engine's CPU
    attention backend, over a zeroed cache as the model runner allocates it)."""
    gen = torch.Generator().manual_seed(0)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
              for _ in range(model.num_layers)]
    prompts = [torch.randint(0, 310, (n,), generator=gen).tolist() for n in (13, 6)]
    tables: dict[int, list[int]] = {0: [], 1: []}
    lens = {0: 0, 1: 0}
    steps = [[(0, prompts[0][:8]), (1, prompts[1])], [(0, prompts[0][8:]), (1, [7])]]
    steps += [[(0, [t]), (1, [t + 1])] for t in (11, 42, 99)]
    out = []
    for chunks in steps:
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for sid, tokens in chunks:
            start, end = lens[sid], lens[sid] + len(tokens)
            while len(tables[sid]) * block_size < end:
                tables[sid].append(free.pop())
            slots += [tables[sid][p // block_size] * block_size + p % block_size for p in range(start, end)]
            ids += tokens
            positions += range(start, end)
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(end)
            lens[sid] = end
        width = max(len(tables[sid]) for sid, _ in chunks)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([tables[s] + [0] * (width - len(tables[s])) for s, _ in chunks],
                                      dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_q=max(len(t) for _, t in chunks), max_seqlen_k=max(seq_lens))
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)  # [T, C]
            out.append(model.compute_logits(hidden))  # [T, V]
    return torch.cat(out)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rank_main(rank: int, size: int, port: int, models: dict[str, str], out: str) -> None:
    """One rank: join the group, check the collectives, load and run every model, then a dead peer."""
    torch.set_num_threads(1)
    out_dir = Path(out)
    try:
        tp = TPGroup.init(rank, size, f"tcp://127.0.0.1:{port}", "gloo", "cpu", timeout_s=60)
        results: dict[str, object] = {}
        # Collectives: all_reduce sums in place, all_gather orders by rank, broadcast copies rank 0's.
        x = torch.full((2, 3), float(rank + 1))
        assert tp.all_reduce(x) is x
        results["all_reduce"] = x.clone()
        results["all_gather"] = tp.all_gather(torch.full((2, 1), float(rank)), dim=1)
        results["broadcast"] = tp.broadcast(torch.tensor([rank * 10 + 5]), src=0)
        results["min_int"] = tp.all_reduce_min_int(100 - rank * 7)
        tp.barrier()
        for name, path in models.items():
            model = load_model(path, tp=tp, progress=False)
            assert model.tp is tp
            results[name] = {"logits": paged_logits(model), "bytes": param_bytes(model),
                             "kv_heads": model.num_kv_heads,
                             "kv_bytes": model.kv_cache_bytes_per_token()}
            del model
        torch.save(results, out_dir / f"rank{rank}.pt")
        # A peer that is gone: the others leave, rank 0's next collective raises (no hang).
        tp.barrier()  # the others meet this one, then leave (their sockets close)
        if rank != 0:
            tp.close()
            return
        try:
            tp.all_reduce(torch.zeros(1))
        except TPGroupError as e:
            assert tp.broken
            (out_dir / "dead_peer.txt").write_text(str(e))
    except BaseException:
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    # A broken gloo group may abort the interpreter's shutdown (its threads are never joined):
    # a rank whose group broke leaves at once, as the engine's rank processes do.
    os._exit(0)
