"""FlexPrefill (sparse prefill): the last-block estimate and the per-head selection against a
brute-force statement of the rule on fresh random inputs; the estimate's Triton kernels against
its torch reference and its masks through the shared block-sparse Triton kernel (interpreter
on the CPU); the policy's parameters, name and
command-line flag; and through the engine: a covering gamma or budget gives Full's tokens,
resident and offloaded, chunked prefill included, a lower gamma reads fewer blocks."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import run_interpreted_check

from astream import LLM, SamplingParams
from astream.base.config import EngineConfig
from astream.face.cli import parse_command
from astream.ops import flexprefill as fp
from astream.ops import xattention as xa
from astream.ops.attention_ref import varlen_attention_ref
from astream.ops.varlen import VarlenMeta
from astream.policies import CombinedPolicy, FlexPrefillPolicy, QuestPolicy, make_policy


def random_qkv(n_q, n_k, heads=4, kv_heads=2, dim=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, dim, generator=gen) * 1.5 for n, h in ((n_q, heads), (n_k, kv_heads),
                                                                          (n_k, kv_heads)))
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ---- the estimate ------------------------------------------------------------------------

def brute_estimate(q, k, block, scale):
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    n_kb, offset, group = -(-n_k // block), n_k - n_q, heads // kv_heads
    rows = range(max(0, n_q - block), n_q)
    vertical = torch.zeros(heads, n_kb, dtype=torch.float64)
    slash = torch.zeros(heads, n_kb, dtype=torch.float64)
    pooled = torch.zeros(heads, n_kb, dtype=torch.float64)
    for h in range(heads):
        kh = h // group
        for t in rows:
            pos = t + offset
            s = torch.tensor([float(q[t, h].double() @ k[u, kh].double()) * scale
                              for u in range(pos + 1)], dtype=torch.float64)
            for u, p in enumerate(torch.softmax(s, 0).tolist()):
                vertical[h, u // block] += p / len(rows)
                slash[h, (pos - u) // block] += p / len(rows)
        mean_q = torch.stack([q[t, h].double() for t in rows]).mean(0)
        means = [k[b * block:(b + 1) * block, kh].double().mean(0) for b in range(n_kb)]
        pooled[h] = torch.softmax(torch.stack([mean_q @ m * scale for m in means]), 0)
    return vertical, slash, pooled


@pytest.mark.parametrize("n_q,n_k,block", [(40, 40, 16), (100, 230, 16), (20, 75, 16), (64, 64, 32)])
def test_estimate_matches_brute_force(n_q, n_k, block):
    q, k, _ = random_qkv(n_q, n_k, seed=n_q + n_k)
    got = fp.last_block_estimate(q, k, block=block, scale=0.3)
    for name, got_part, want in zip(got._fields, got, brute_estimate(q, k, block, 0.3)):
        torch.testing.assert_close(got_part.double(), want, atol=1e-5, rtol=1e-5, msg=name)


def test_estimate_in_kv_head_slices_is_the_same(monkeypatch):
    q, k, _ = random_qkv(70, 150, heads=8, kv_heads=4, seed=9)
    want = fp.last_block_estimate(q, k, block=16, scale=0.3)
    monkeypatch.setattr(fp, "ESTIMATE_BYTES", 1)                     # one KV head at a time
    for a, b in zip(fp.last_block_estimate(q, k, block=16, scale=0.3), want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_block_means_in_row_slices_are_the_same(monkeypatch):
    k = torch.randn(1000, 3, 8, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = fp.block_means(k, 64)
    monkeypatch.setattr(fp, "MEAN_ROWS", 100)                         # slices of one block
    torch.testing.assert_close(fp.block_means(k, 64), want, atol=1e-6, rtol=1e-6)
    ref = torch.stack([k[i:i + 64].float().mean(0) for i in range(0, 1000, 64)], 1)
    torch.testing.assert_close(want, ref, atol=1e-5, rtol=1e-5)


def test_the_policys_estimate_reads_the_key_block_means_once_and_the_same(monkeypatch):
    """FlexPrefillPolicy.estimate hands one pass over the keys' block means to both halves:
    the result is what each computes alone, and a mean of the wrong shape is refused."""
    q, k, _ = random_qkv(70, 150, heads=8, kv_heads=4, seed=3)
    want = (fp.last_block_estimate(q, k, block=16, scale=0.3),
            fp.query_aware_scores(q, k, block=16, scale=0.3))
    passes = []
    means = fp.block_means
    monkeypatch.setattr(fp, "block_means", lambda x, block: passes.append(x.shape) or means(x, block))
    est, qa = FlexPrefillPolicy(block_size=16).estimate(q, k, 0.3)
    assert passes.count(k.shape) == 1                    # the keys once; the queries once too
    for a, b in zip(est, want[0]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(qa, want[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="key_means of shape"):
        fp.query_aware_scores(q, k, block=16, scale=0.3, key_means=means(k, 32))


def test_js_distance_matches_its_formula():
    gen = torch.Generator().manual_seed(2)
    p, r = torch.rand(5, 9, generator=gen), torch.rand(5, 9, generator=gen)
    p[0, :3] = 0                                              # zero entries count 0 * log 0 = 0
    p, r = p / p.sum(-1, keepdim=True), r / r.sum(-1, keepdim=True)
    for row in range(5):
        a, b = p[row].double().tolist(), r[row].double().tolist()
        kl = lambda x, y: sum(xi * math.log(xi / yi) for xi, yi in zip(x, y) if xi > 0)
        m = [(x + y) / 2 for x, y in zip(a, b)]
        want = math.sqrt(0.5 * kl(a, m) + 0.5 * kl(b, m))
        assert abs(float(fp.js_distance(p[row], r[row])) - want) < 1e-6
    assert torch.all(fp.js_distance(p, p) < 1e-3)


def test_query_aware_scores_match_brute_force():
    n_q, n_k, block, scale = 50, 120, 16, 0.3
    q, k, _ = random_qkv(n_q, n_k, seed=4)
    got = fp.query_aware_scores(q, k, block=block, scale=scale)
    _, last = xa.visible_blocks(n_q, n_k, block, torch.device("cpu"))
    for h in range(4):
        for i in range(got.shape[1]):
            mean_q = q[i * block:(i + 1) * block, h].double().mean(0)
            s = torch.stack([mean_q @ k[j * block:(j + 1) * block, h // 2].double().mean(0) * scale
                             for j in range(int(last[i]) + 1)])
            want = torch.zeros(got.shape[2], dtype=torch.float64)
            want[:len(s)] = torch.softmax(s, 0)
            torch.testing.assert_close(got[h, i].double(), want, atol=1e-5, rtol=1e-5)


# ---- the selection -----------------------------------------------------------------------

def brute_cover(scores, gamma, forced=(), valid=None, low=0, high=None):
    """The ranked cover stated plainly: forced first, then the highest scores, the fewest
    whose mass reaches gamma of the total, the count clamped to [low, high]."""
    valid = list(range(len(scores))) if valid is None else valid
    order = sorted(valid, key=lambda b: (b not in forced, -float(scores[b]), b))
    total = sum(max(0.0, float(scores[b])) for b in valid)
    count, mass = 0, 0.0
    if gamma >= 1:
        count = len(valid)
    else:
        for b in order:
            if mass >= gamma * total:
                break
            count, mass = count + 1, mass + max(0.0, float(scores[b]))
        count = max(count, low)
        count = count if high is None else min(count, high)
    count = min(max(count, len([b for b in forced if b in valid])), len(valid))
    return set(order[:count])


def brute_select(est, qa, gamma, tau, min_blocks, max_blocks, n_q, n_k, block):
    heads, n_kb = est.vertical.shape
    first, last = xa.visible_blocks(n_q, n_k, block, torch.device("cpu"))
    n_qb = len(first)
    mask = torch.zeros(heads, n_qb, n_kb, dtype=torch.bool)
    aware = []
    for h in range(heads):
        p, r = est.pooled[h].double().tolist(), est.vertical[h].double().tolist()
        m = [(x + y) / 2 for x, y in zip(p, r)]
        js = math.sqrt(max(0.0, 0.5 * sum(x * math.log(x / z) for x, z in zip(p, m) if x > 0)
                           + 0.5 * sum(y * math.log(y / z) for y, z in zip(r, m) if y > 0)))
        query_aware = js < tau
        aware.append(query_aware)
        if gamma >= 1:
            for i in range(n_qb):
                mask[h, i, :int(last[i]) + 1] = True
            continue
        high = min_blocks if query_aware else max_blocks
        columns = brute_cover(est.vertical[h], gamma, {0}, low=min_blocks, high=high)
        diagonals = brute_cover(est.slash[h], gamma, {0}, low=min_blocks, high=high)
        pairs = set()
        if query_aware:
            cells = [(i, j) for i in range(n_qb) for j in range(int(last[i]) + 1)]
            flat = qa[h].flatten()
            pairs = {divmod(c, n_kb) for c in brute_cover(flat, gamma, valid=[i * n_kb + j for i, j in cells])}
        for i in range(n_qb):
            for j in range(int(last[i]) + 1):
                mask[h, i, j] = (j in columns or int(last[i]) - j in diagonals or j == 0
                                 or j >= int(first[i]) or (i, j) in pairs)
    return mask, aware


# (n_q, n_k, block, gamma, min_blocks, max_blocks)
SELECT_CASES = [(100, 230, 16, 0.8, 1, None), (128, 128, 16, 0.6, 2, 4), (37, 300, 16, 0.9, 0, None),
                (200, 200, 32, 0.95, 1, 3), (64, 500, 16, 0.5, 3, None), (90, 90, 16, 1.0, 1, None)]


@pytest.mark.parametrize("case", SELECT_CASES)
@pytest.mark.parametrize("tau_mode", ["none", "all", "mixed"])
def test_selection_matches_brute_force(case, tau_mode):
    n_q, n_k, block, gamma, min_blocks, max_blocks = case
    q, k, _ = random_qkv(n_q, n_k, heads=8, kv_heads=2, seed=n_k + block)
    q[:, :4] *= 3.0                                             # sharper heads diverge more
    est = fp.last_block_estimate(q, k, block=block, scale=0.25)
    qa = fp.query_aware_scores(q, k, block=block, scale=0.25)
    js = fp.js_distance(est.pooled, est.vertical)
    tau = {"none": 0.0, "all": 1.0, "mixed": float(js.median()) + 1e-6}[tau_mode]
    got, aware = fp.select_blocks(est, qa, gamma=gamma, tau=tau, min_blocks=min_blocks,
                                  max_blocks=max_blocks, n_q=n_q, n_k=n_k, block=block)
    want, want_aware = brute_select(est, qa, gamma, tau, min_blocks, max_blocks, n_q, n_k, block)
    assert aware.tolist() == want_aware
    if tau_mode == "mixed":
        assert 0 < sum(want_aware) < len(want_aware)
    assert torch.equal(got, want)


def test_ranked_cover_matches_brute_force_on_random_rows():
    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        n = 1 + trial % 13
        scores = torch.rand(3, n, generator=gen) ** 3
        forced = torch.rand(3, n, generator=gen) < 0.2
        valid = torch.rand(3, n, generator=gen) < 0.8
        gamma = [0.3, 0.7, 0.95, 1.0][trial % 4]
        low, high = trial % 3, (None if trial % 2 else 1 + trial % 5)
        got = fp.ranked_cover(scores, gamma, forced=forced, valid=valid, low=low, high=high)
        for r in range(3):
            want = brute_cover(scores[r], gamma, set(torch.nonzero(forced[r]).flatten().tolist()),
                               torch.nonzero(valid[r]).flatten().tolist(), low, high)
            assert set(torch.nonzero(got[r]).flatten().tolist()) == want, (trial, r)


def test_the_kept_mass_reaches_gamma_and_grows_with_it():
    n, block = 256, 16
    q, k, _ = random_qkv(n, n, seed=11)
    est = fp.last_block_estimate(q, k, block=block, scale=0.5)
    qa = fp.query_aware_scores(q, k, block=block, scale=0.5)
    kept = []
    for gamma in (0.3, 0.6, 0.9, 0.99):
        mask, _ = fp.select_blocks(est, qa, gamma=gamma, tau=0.0, min_blocks=0, max_blocks=None,
                                   n_q=n, n_k=n, block=block)
        # The last query block reads every kept column block: its vertical mass reaches gamma.
        assert torch.all((est.vertical * mask[:, -1]).sum(-1) >= gamma - 1e-5)
        kept.append(int(mask.sum()))
    assert kept == sorted(kept) and kept[0] < kept[-1]


def test_covering_settings_are_full_attention():
    n_q, n_k, block = 60, 150, 16
    q, k, v = random_qkv(n_q, n_k, seed=6)
    est = fp.last_block_estimate(q, k, block=block, scale=0.25)
    qa = fp.query_aware_scores(q, k, block=block, scale=0.25)
    visible = xa.visible_mask(4, n_q, n_k, block, torch.device("cpu"))
    for gamma, min_blocks in ((1.0, 0), (0.3, fp.block_budget(n_k, block))):
        for tau in (0.0, 1.0):
            mask, _ = fp.select_blocks(est, qa, gamma=gamma, tau=tau, min_blocks=min_blocks,
                                       max_blocks=None, n_q=n_q, n_k=n_k, block=block)
            assert torch.equal(mask, visible)
    out, lse = xa.block_sparse_attention_ref(q, k, v, visible, block=block, scale=0.25)
    meta = VarlenMeta(torch.tensor([0, n_q]), torch.tensor([0, n_k]), n_q, n_k, [0, n_q], [0, n_k])
    ref_out, ref_lse = varlen_attention_ref(q, k, v, meta, causal=True, scale=0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


# ---- the estimate's Triton kernels -------------------------------------------------------

# (n_q, n_k, heads, kv heads, dim, block): more rows than a block, fewer rows than a block
# and keys not a multiple of it, a head dim that is not a power of two, one KV head, and
# more key blocks than a stats program walks.
ESTIMATE_CASES = [(40, 40, 4, 2, 16, 16), (10, 75, 4, 2, 32, 16), (100, 300, 4, 1, 24, 32),
                  (64, 700, 2, 2, 32, 64), (16, 2100, 2, 1, 16, 16)]
GPU_ESTIMATE_CASES = [(8192, 40000, 32, 8, 128, 128), (3000, 3000, 14, 2, 64, 128)]


def check_triton_flexprefill_estimate(device: str, tol: float = 1e-5) -> int:
    """The kernels' vertical and slash sums against last_block_sums_ref on fresh random inputs
    (float32; bf16 too on the GPU, against the reference on the same bf16 inputs)."""
    from astream.ops.triton_flexprefill import last_block_sums_triton
    cases = ESTIMATE_CASES + (GPU_ESTIMATE_CASES if device == "cuda" else [])
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    checked = 0
    for i, (n_q, n_k, heads, kvh, dim, block) in enumerate(cases):
        for dtype in dtypes:
            q, k, _ = (x.to(device) for x in random_qkv(n_q, n_k, heads, kvh, dim, seed=300 + i,
                                                        dtype=dtype))
            rows = q[n_q - min(block, n_q):]
            got = last_block_sums_triton(rows, k, block=block, scale=dim ** -0.5)
            want = fp.last_block_sums_ref(rows, k, block=block, scale=dim ** -0.5)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=tol, rtol=1e-3)
            # Each row's weights sum to 1 whichever way they are grouped.
            torch.testing.assert_close(got[0].sum(-1), torch.ones(heads, device=device), atol=1e-4, rtol=0)
            torch.testing.assert_close(got[1].sum(-1), torch.ones(heads, device=device), atol=1e-4, rtol=0)
            checked += 1
    return checked


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_estimate_interpreter_matches_reference():
    assert run_interpreted_check("test_flexprefill", "check_triton_flexprefill_estimate") == len(ESTIMATE_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_estimate_on_gpu_matches_reference():
    cases = len(ESTIMATE_CASES) + len(GPU_ESTIMATE_CASES)
    assert check_triton_flexprefill_estimate("cuda", tol=1e-5) == 2 * cases


# ---- its masks through the block-sparse Triton kernel ------------------------------------

# (n_q, n_k, heads, kv heads, dim, block, gamma, tau)
KERNEL_CASES = [(70, 200, 4, 2, 32, 16, 0.7, 0.2), (96, 96, 4, 1, 64, 32, 0.9, 1.0)]


def check_triton_flexprefill_masks(device: str, tol: float = 2e-3) -> int:
    from astream.ops.triton_xattention import block_sparse_attention_triton
    for i, (n_q, n_k, heads, kvh, dim, block, gamma, tau) in enumerate(KERNEL_CASES):
        q, k, v = (x.to(device) for x in random_qkv(n_q, n_k, heads, kvh, dim, seed=80 + i))
        scale = dim ** -0.5
        est = fp.last_block_estimate(q, k, block=block, scale=scale)
        qa = fp.query_aware_scores(q, k, block=block, scale=scale)
        mask, _ = fp.select_blocks(est, qa, gamma=gamma, tau=tau, min_blocks=1, max_blocks=None,
                                   n_q=n_q, n_k=n_k, block=block)
        out, lse = block_sparse_attention_triton(q, k, v, mask, block=block, scale=scale)
        ref_out, ref_lse = xa.block_sparse_attention_ref(q, k, v, mask, block=block, scale=scale)
        torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    return len(KERNEL_CASES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested")
def test_triton_kernel_on_flexprefill_masks_interpreter_matches_reference():
    assert run_interpreted_check("test_flexprefill", "check_triton_flexprefill_masks") == len(KERNEL_CASES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_on_flexprefill_masks_on_gpu_matches_reference():
    assert check_triton_flexprefill_masks("cuda", tol=1e-2) == len(KERNEL_CASES)


# ---- the policy, its name and its flag ---------------------------------------------------

def test_policy_parameters_are_checked():
    for bad in (dict(gamma=0), dict(gamma=1.5), dict(gamma=True), dict(tau=-0.1), dict(tau="x"),
                dict(block_size=48), dict(block_size=8), dict(min_budget=-1),
                dict(min_budget=1024, max_budget=512), dict(max_budget=0), dict(chunk_tokens=-1),
                dict(chunk_tokens=1.5)):
        with pytest.raises(ValueError, match="FlexPrefillPolicy"):
            FlexPrefillPolicy(**bad)
    with pytest.raises(ValueError, match="no budget"):
        make_policy("flexprefill", 1024)
    assert make_policy("flexprefill") == FlexPrefillPolicy(gamma=0.99, tau=0.1, min_budget=1024,
                                                           max_budget=None, block_size=128,
                                                           dense_tail=128, chunk_tokens=32768)
    assert make_policy("flexprefill(gamma=0.9, tau=0.2, max_budget=8192)") == FlexPrefillPolicy(
        gamma=0.9, tau=0.2, max_budget=8192)
    combined = make_policy("flexprefill+quest", 512)
    assert combined == CombinedPolicy(prefill=FlexPrefillPolicy(), decode=QuestPolicy(budget_tokens=512))


def test_the_name_is_taken_by_the_command_line_and_engine_config():
    _, (engine_kw, _) = parse_command(["generate", "--sparse-policy", "flexprefill(gamma=0.9)", "hi"], {})
    assert make_policy(engine_kw["sparse_policy"]) == FlexPrefillPolicy(gamma=0.9)
    _, (engine_kw, *_) = parse_command(["serve", "--sparse-policy", "flexprefill"], {})
    assert engine_kw["sparse_policy"] == "flexprefill"
    assert EngineConfig(sparse_policy="flexprefill").sparse_policy == "flexprefill"


# ---- through the engine ------------------------------------------------------------------

KW = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=2048, kv_block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = " ".join(f"Item {i} costs {i * 13 % 50} dollars and weighs {i % 7} pounds."
                for i in range(40)) + " Which item is the heaviest?"
PROMPTS = [LONG, "The quick brown fox", "def fibonacci(n):"]
COVERING = [pytest.param(FlexPrefillPolicy(gamma=1.0, block_size=16), id="gamma-1"),
            pytest.param(FlexPrefillPolicy(gamma=0.5, tau=0.3, min_budget=4096, block_size=16),
                         id="budget-covers")]


@pytest.mark.parametrize("policy", COVERING)
@pytest.mark.parametrize("mode", ["one-chunk", "chunked", "offload"])
def test_covering_settings_give_fulls_tokens(smol_llm, policy, mode):
    want = [o.token_ids for o in smol_llm.generate(PROMPTS, GREEDY)]
    extra = {"one-chunk": {}, "chunked": dict(max_num_batched_tokens=128),
             "offload": dict(max_num_batched_tokens=256, offload=True)}[mode]
    with LLM(**KW, sparse_policy=policy, **extra) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        stats = llm.stats()
    assert all(d == 1.0 for d in stats["flexprefill_density"])


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_a_covering_budget_gives_fulls_tokens_on_tiny_qwen3(tiny_qwen3, offload):
    kw = dict(device="cpu", num_kv_blocks=64, kv_block_size=16, max_num_batched_tokens=64)
    prompt = " ".join(f"word{i}" for i in range(60))
    with LLM(str(tiny_qwen3), **kw) as llm:
        want = llm.generate([prompt], GREEDY)[0].token_ids
    policy = FlexPrefillPolicy(gamma=0.5, tau=0.3, min_budget=1024, block_size=16)
    with LLM(str(tiny_qwen3), **kw, sparse_policy=policy, offload=offload) as llm:
        assert llm.generate([prompt], GREEDY)[0].token_ids == want


def test_a_lower_gamma_reads_fewer_blocks_and_still_writes_text():
    policy = FlexPrefillPolicy(gamma=0.6, tau=0.1, min_budget=16, block_size=16)
    with LLM(**KW, sparse_policy=policy, max_num_batched_tokens=256) as llm:
        out = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(0 < d < 1 for d in stats["flexprefill_density"]), stats["flexprefill_density"]
    assert all(0 <= a <= 1 for a in stats["flexprefill_query_aware"])
    assert sum(ch.isalpha() for ch in out.text) > len(out.text) // 3, out.text
