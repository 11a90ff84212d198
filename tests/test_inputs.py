"""Step inputs built in columns equal the row-by-row definition, on random batches."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from astream.base.sampling import SamplingParams
from astream.core.scheduler import ScheduledBatch, ScheduledSeq
from astream.core.sequence import Sequence
from astream.executor.decode_tables import DecodeTables
from astream.executor.inputs import build_inputs


def reference(batch: ScheduledBatch, block_size: int) -> dict:
    """Every row of the step, one token at a time, as plain lists."""
    out = {k: [] for k in ("ids", "positions", "slots", "sample", "dst", "src", "key_slots", "tables", "lens")}
    cu_q, cu_k = [0], [0]
    for item in batch.items:
        seq, table = item.seq, item.seq.block_table
        known = seq.num_tokens - seq.num_pending
        for pos in range(item.start, item.start + item.num_tokens):
            if pos >= known:
                out["dst"].append(len(out["ids"]))
                out["src"].append(seq.pending_row)
            out["ids"].append(seq.token_slice(pos, pos + 1)[0] if pos < known else 0)
            out["positions"].append(pos)
            out["slots"].append(table[pos // block_size] * block_size + pos % block_size)
        if item.sample:
            out["sample"].append(len(out["ids"]) - 1)
        if item.num_tokens > 1:
            cu_q.append(cu_q[-1] + item.num_tokens)
            cu_k.append(cu_k[-1] + item.start + item.num_tokens)
            out["key_slots"] += [table[p // block_size] * block_size + p % block_size
                                 for p in range(item.start + item.num_tokens)]
        else:
            out["tables"].append(table)
            out["lens"].append(item.start + 1)
    width = max((len(t) for t in out["tables"]), default=0)
    out["tables"] = [t + [0] * (width - len(t)) for t in out["tables"]]
    out["cu"] = (cu_q, cu_k)
    return out


def random_batch(rng: random.Random, block_size: int) -> ScheduledBatch:
    items = []
    for i in range(rng.randint(1, 12)):
        seq = Sequence(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 80))],
                       SamplingParams(), i)
        seq.output_token_ids = [rng.randrange(1000) for _ in range(rng.choice([0, 0, rng.randint(1, 30)]))]
        seq.num_pending, seq.pending_row = rng.choice([0, 0, 1]), rng.randrange(8)
        total = seq.num_tokens
        if rng.random() < 0.5:
            start, n = total - 1, 1                          # a decode
        else:
            start = rng.randrange(total) if rng.random() < 0.5 else 0
            n = rng.randint(1, total - start)                # a chunk (maybe of one token)
        seq.block_table = rng.sample(range(500), -(-(start + n) // block_size) + rng.randint(0, 2))
        items.append(ScheduledSeq(seq, start, n, sample=rng.random() < 0.8))
    items.sort(key=lambda item: item.num_tokens == 1)       # as the scheduler orders them
    return ScheduledBatch(1, tuple(items))


def values(tensor: torch.Tensor | None) -> list | None:
    return None if tensor is None else tensor.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_columns_equal_the_row_by_row_definition(seed):
    rng = random.Random(seed)
    for _ in range(300):
        block_size = rng.choice([1, 4, 16])
        batch = random_batch(rng, block_size)
        want, got = reference(batch, block_size), build_inputs(batch, block_size, torch.device("cpu"))
        attn, chunks = got.attn, [item for item in batch.items if item.num_tokens > 1]
        assert got.input_ids.dtype == got.positions.dtype == attn.slot_mapping.dtype == torch.int64
        assert values(got.input_ids) == want["ids"] and got.num_tokens == len(want["ids"])
        assert values(got.positions) == want["positions"] and values(attn.slot_mapping) == want["slots"]
        assert values(got.sample_rows) == want["sample"]
        assert values(got.pending_dst) == (want["dst"] or None)
        assert values(got.pending_src) == (want["src"] or None)
        assert attn.num_prefill_tokens == sum(item.num_tokens for item in chunks)
        if chunks:
            cu_q, cu_k = want["cu"]
            assert values(attn.prefill.cu_seqlens_q) == attn.prefill.host_cu_seqlens_q == cu_q
            assert values(attn.prefill.cu_seqlens_k) == attn.prefill.host_cu_seqlens_k == cu_k
            continues = any(item.start > 0 for item in chunks)
            assert values(attn.prefill_key_slots) == (want["key_slots"] if continues else None)
        else:
            assert attn.prefill is None and attn.prefill_key_slots is None
        if want["tables"]:
            assert attn.decode_block_tables.dtype == attn.decode_context_lens.dtype == torch.int32
            assert values(attn.decode_block_tables) == want["tables"]
            assert values(attn.decode_context_lens) == want["lens"]
            assert attn.decode_max_context == max(want["lens"])
        else:
            assert attn.decode_block_tables is None and attn.decode_max_context == 0


def test_decode_tables_kept_between_steps_equal_tables_built_afresh():
    """Tables grow by appending and are replaced on release, each life with an epoch of its
    own (as the block manager does); rows come and go and change order; every step's array
    is the plain padded one."""
    rng, epochs = random.Random(7), itertools.count(1)

    def fresh() -> Table:
        return Table([rng.randrange(100) for _ in range(rng.randint(1, 9))], next(epochs))

    kept, live = DecodeTables(), [fresh() for _ in range(6)]
    for _ in range(400):
        for owner in rng.sample(live, rng.randint(0, len(live))):
            owner.block_table.append(rng.randrange(100))
        if rng.random() < 0.2:
            live[rng.randrange(len(live))] = fresh()             # released, then given blocks anew
        if rng.random() < 0.2 and len(live) > 1:
            live.pop(rng.randrange(len(live)))
        if rng.random() < 0.2:
            live.insert(rng.randrange(len(live) + 1), fresh())
        if rng.random() < 0.1:
            rng.shuffle(live)
        width = max(len(owner.block_table) for owner in live)
        want = [owner.block_table + [0] * (width - len(owner.block_table)) for owner in live]
        got = kept.build(live)
        assert got.dtype == np.int32 and got.tolist() == want
        assert DecodeTables().build(live).tolist() == want
    assert len(kept.row_of) == len(live)                 # last step's rows only, by epoch


@dataclass(slots=True)
class Table:
    block_table: list[int]
    kv_epoch: int
