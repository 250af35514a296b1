"""Exact self-speculation for block-causal models (issue 46 item 2;
:class:`vispec.dllm.block_causal_speculative.BlockCausalSpeculativeLoop`).

* **Token equality with the stepwise block-causal run** on the embedded tiny-llada2 (LLaDA2 layout), for the threshold
  rule, LLaDA's quota and LLaDA2.1's token-editing policy, at temperature 0 and 0.8, over ``cache="prefix"`` (LLaDA2's
  exact cache of finished blocks) and ``cache="none"``, with ``k`` = 2, 4 and ``"auto"``: test prompts of three tasks
  in one padded batch and alone, the same tokens, ``stats["steps"]`` equal to the stepwise run's NFE, fewer forwards.
* A tiny random LLaDA2-layout model (float64): rows with different block counts, the prompt ending inside a block
  (a tail), early stop at EOS and token editing with post steps, every cache and draft length.
* **Negative control**: the same loop with the verification skipped (drafts from stale logits accepted as they are)
  gives other tokens, so the equality above can fail.
* **Certification by enumeration** (slow): on a block-causal model small enough to enumerate (3 real tokens, a prompt
  block, then 6 generated positions in 2 blocks of 3), the exact law of stepwise LLaDA (quota, low-confidence
  remasking, temperature 0.8) is computed by a plain recursion over every candidate draw; self-speculative samples over
  both caches must pass Pearson's chi-square test against it (power 0.99 against TV 0.03 at level 1e-3,
  tests/chi_square.py), and unverified self-speculation must fail it.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import pytest
import torch

from chi_square import ALPHA, chi_square_vs_exact, required_samples
from dllm_reference import quota_step_law
from vispec.dllm import LLaDAScheduler, StopDecoding, TokenEditingScheduler, decode, make_scheduler
from vispec.dllm.block_causal_speculative import BlockCausalSpeculativeLoop
from vispec.dllm.speculative import self_drafting_limit
from vispec.models.llada2 import LLaDA2MoeModelLM

POLICIES = {"threshold": dict(strategy="threshold", threshold=0.5), "llada": dict(strategy="llada", steps=32),
            "editing": dict(strategy="editing")}


@pytest.fixture(scope="module")
def pipe(tiny_llada2):
    return tiny_llada2


@pytest.fixture(scope="module")
def task_prompts():
    """One test prompt of each embedded task (lengths 31, 14 and 14 tokens: the batch is padded, and the prompts end
    inside a block of 32)."""
    from vispec.eval.bench.text_tasks import get_task, split_items

    tasks = ("arithmetic", "sort", "reverse")
    return [item.prompt for task in tasks for item in split_items(get_task(task), "test", 1, 0)]


def gens(count: int, seed: int = 20) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


def with_loop(loop_class, run):
    """``run()`` with :func:`vispec.dllm.decode` dispatching block-causal self-speculation to ``loop_class``."""
    decode_module = importlib.import_module("vispec.dllm.decode")  # the module (vispec.dllm.decode is the function)
    original = decode_module.BlockCausalSpeculativeLoop
    decode_module.BlockCausalSpeculativeLoop = loop_class
    try:
        return run()
    finally:
        decode_module.BlockCausalSpeculativeLoop = original


class UnverifiedLoop(BlockCausalSpeculativeLoop):
    """Negative control: every drafted step is accepted without its verification (parallel decoding from stale
    logits)."""

    def _verify(self, chain, table, todo, verified):
        return table[:, 1:] >= 0


# ---------------------------------------------------------------------------------------------- tiny-llada2
FAST = {("llada", "prefix"), ("threshold", "none"), ("editing", "prefix")}


@pytest.mark.parametrize("policy,cache", [
    pytest.param(policy, cache, marks=() if (policy, cache) in FAST else pytest.mark.slow)
    for policy in POLICIES for cache in ("prefix", "none")])
def test_tiny_llada2_equals_the_stepwise_run(pipe, task_prompts, policy, cache):
    """Three test prompts in one padded batch, at temperature 0 and 0.8, k = 2, 4 and auto: the stepwise run's tokens
    and steps at fewer forwards; each prompt alone too (k = 4, temperature 0.8), equal to its row of the batch."""
    call = dict(POLICIES[policy], cache=cache)
    for temperature in (0.0, 0.8):
        ref = pipe(prompt=task_prompts, temperature=temperature, generator=gens(3), **call)
        ref_nfe = [s["nfe"] for s in ref.stats]
        for k in (2, 4, "auto"):
            out = pipe(prompt=task_prompts, temperature=temperature, generator=gens(3), speculative=k, **call)
            where = (policy, cache, temperature, k)
            assert torch.equal(out.sequences, ref.sequences), where
            assert [s["steps"] for s in out.stats] == ref_nfe, where  # the stepwise run's steps
            assert all(s["nfe"] <= n for s, n in zip(out.stats, ref_nfe)), where
            assert all(s["canvases"] >= s["nfe"] for s in out.stats), where
            if policy == "editing":
                assert [s["edits"] for s in out.stats] == [s["edits"] for s in ref.stats], where
            if k == 4:
                assert sum(s["nfe"] for s in out.stats) < sum(ref_nfe), where
                batched = out
    for i, prompt in enumerate(task_prompts):  # alone (temperature 0.8): the row's own tokens and forwards
        alone_ref = pipe(prompt=[prompt], temperature=0.8, generator=gens(3)[i: i + 1], **call)
        alone = pipe(prompt=[prompt], temperature=0.8, generator=gens(3)[i: i + 1], speculative=4, **call)
        assert torch.equal(alone.sequences, alone_ref.sequences), (policy, cache, i)
        assert torch.equal(alone.sequences[0], batched.sequences[i]), (policy, cache, i)
        assert alone.stats[0]["steps"] == alone_ref.stats[0]["nfe"] == ref_nfe[i]
        assert alone.stats[0]["nfe"] == batched.stats[i]["nfe"]


def test_tiny_llada2_forward_counts(pipe, task_prompts):
    """LLaDA's one token per step (32 steps over the answer; early stop at EOS) at temperature 0 with the prefix cache:
    k = 4 spends at most half the stepwise run's forwards on every prompt (observed: 26, 14, 14 stepwise; 11, 6, 7),
    although the chains of a block end at its end and each block starts with the stepwise run's own first forward."""
    ref = pipe(prompt=task_prompts, cache="prefix", **POLICIES["llada"])
    out = pipe(prompt=task_prompts, cache="prefix", speculative=4, **POLICIES["llada"])
    assert torch.equal(out.sequences, ref.sequences)
    for fast, slow in zip(out.stats, ref.stats):
        assert fast["steps"] == slow["nfe"] and 2 * fast["nfe"] <= slow["nfe"], (fast, slow)


def test_skipping_verification_changes_the_tokens(pipe, task_prompts):
    """Negative control: the loop that accepts its drafts unverified gives other tokens than the stepwise run on these
    prompts (with verification, the same), for each policy at temperature 0."""
    for policy in ("llada", "threshold", "editing"):
        call = dict(POLICIES[policy], cache="prefix")
        ref = pipe(prompt=task_prompts, **call)
        unverified = with_loop(UnverifiedLoop, lambda: pipe(prompt=task_prompts, speculative=4, **call))
        assert not torch.equal(unverified.sequences, ref.sequences), policy
        assert torch.equal(pipe(prompt=task_prompts, speculative=4, **call).sequences, ref.sequences), policy


# ---------------------------------------------------------------------------------------------- a tiny random model
MASK, EOS, PAD = 99, 1, 0


@pytest.fixture(scope="module")
def model():
    from test_llada2 import tiny_llada2

    return tiny_llada2(4.0)


def padded_prompts(lengths=(5, 8, 2), seed=0):
    """Left-padded random prompts; with blocks of 8 and 16 generated tokens a row of 8 decodes 2 blocks, the others 3
    (their first block starts inside the prompt and their last ends in a tail)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(2, MASK, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


@pytest.mark.parametrize("policy", ["editing", "threshold", "llada"])
def test_random_model_equals_the_stepwise_run(model, policy):
    """Early stop at EOS on and off, the editing policy with post steps and T2T edits, every cache, k = 2, 4, auto."""
    ids, mask = padded_prompts()
    schedulers = {"editing": lambda: TokenEditingScheduler(max_post_steps=4),
                  "threshold": lambda: make_scheduler("threshold", threshold=0.5), "llada": lambda: LLaDAScheduler()}
    kwargs = dict(gen_length=16, block_length=8, steps=8 if policy == "llada" else None)
    for cache, temperature, early_stop in (("prefix", 0.0, True), ("none", 0.8, False), ("prefix", 0.8, False)):
        call = dict(kwargs, cache=cache, temperature=temperature, early_stop_eos=early_stop)
        ref = decode(model, ids, mask, scheduler=schedulers[policy](), generator=gens(3), **call)
        for k in (2, 4, "auto"):
            out = decode(model, ids, mask, scheduler=schedulers[policy](), generator=gens(3), speculative=k, **call)
            where = (policy, cache, temperature, early_stop, k)
            assert torch.equal(out.tokens, ref.tokens), where
            assert out.stats.extra["steps"].tolist() == ref.stats.nfe.tolist(), where
            assert (out.stats.nfe <= ref.stats.nfe).all(), where
            assert out.labels["attention"] == "block_causal" and out.labels["cache"] == cache
            assert out.labels["speculative"]["draft_length"] == k and out.method == ref.method
            if policy == "editing":
                assert torch.equal(out.stats.extra["edits"], ref.stats.extra["edits"]), where
    if policy == "editing":
        assert (ref.stats.extra["edits"] > 0).any()  # the T2T edits are part of the reference


def test_draft_length_one_is_the_stepwise_run(model):
    ids, mask = padded_prompts()
    call = dict(gen_length=16, block_length=8, cache="prefix", temperature=0.8)
    ref = decode(model, ids, mask, scheduler=TokenEditingScheduler(), generator=gens(3), **call)
    out = decode(model, ids, mask, scheduler=TokenEditingScheduler(), generator=gens(3), speculative=1, **call)
    assert torch.equal(out.tokens, ref.tokens) and out.stats.nfe.tolist() == ref.stats.nfe.tolist()


def test_callback_sees_the_verified_canvas_and_can_stop(model):
    ids, mask = padded_prompts()
    seen = []

    def callback(progress):
        seen.append(progress)
        if len(seen) == 2:
            raise StopDecoding

    call = dict(gen_length=16, block_length=8, steps=16, cache="prefix")
    out = decode(model, ids, mask, scheduler=LLaDAScheduler(), speculative=4, callback=callback, **call)
    assert len(seen) == 2 and out.labels.get("interrupted") is True
    first = seen[0]
    assert first.tokens.shape == (3, 16) and first.details["transfer_index"].shape == (3, 16)
    assert first.details["advanced"].ge(1).all() and torch.equal(first.num_committed, first.details["reference_steps"])
    with pytest.raises(ValueError, match="cannot edit"):
        decode(model, ids, mask, scheduler=LLaDAScheduler(), speculative=4, callback=lambda p: {"tokens": p.tokens},
               **call)


def test_what_block_causal_self_speculation_does_not_take_is_refused(model):
    ids, mask = padded_prompts()
    with pytest.raises(ValueError, match="cache='dual' does not apply to a block-causal model"):
        decode(model, ids, mask, scheduler=LLaDAScheduler(), steps=8, gen_length=16, block_length=8, cache="dual",
               speculative=4)
    with pytest.raises(ValueError, match="speculative .*cache='dkv'"):
        decode(model, ids, mask, scheduler=LLaDAScheduler(), steps=8, gen_length=16, block_length=8, cache="dkv",
               speculative=4)
    from vispec.dllm.options import UnmaskingOptions

    with pytest.raises(ValueError, match="self_drafting_limit .* block-causal"):
        self_drafting_limit(model, ids[:1, -5:], UnmaskingOptions(steps=8, gen_length=16, block_length=8),
                            scheduler=LLaDAScheduler())


# ---------------------------------------------------------------------------------------------- certification
C_VOCAB = 3  # real tokens 0..2, the mask 3 (never proposed)
C_MASK = C_VOCAB
C_PROMPT = [1, 2, 0]  # one whole block
C_GEN, C_BLOCK, C_STEPS, C_T = 6, 3, 6, 0.8  # two generated blocks of 3, one token per step


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(1)
    m = LLaDA2MoeModelLM(vocab_size=C_VOCAB + 1, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_experts=None,
                         first_k_dense_replace=1, mask_token_id=C_MASK, eos_token_id=2, pad_token_id=0,
                         block_length=C_BLOCK, max_position_embeddings=16, initializer_range=0.3)
    return m.double().eval()


@torch.no_grad()
def exact_block_causal_law(model) -> torch.Tensor:
    """``[3 ** C_GEN]`` the law of the stepwise block-causal LLaDA sampler's outputs (index ``Σ x_j 3^(L-1-j)``):
    blocks of ``C_BLOCK`` after the prompt block, a block's logits from the canvas up to its end under the
    block-causal mask (what both caches compute, up to float rounding), LLaDA's quota, each masked position's
    candidate drawn from ``softmax(ℓ / T)`` over the real tokens (float64), the ``n_i`` most confident
    (``softmax(ℓ)[x̂]`` over the whole vocabulary in the logits' dtype, ties to the lowest position) committed. Plain
    Python over every candidate draw of every step."""
    P, per_block = len(C_PROMPT), C_STEPS // (C_GEN // C_BLOCK)
    memo: dict = {}

    def logits(canvas: tuple, block: int) -> torch.Tensor:
        if (canvas, block) not in memo:
            end = P + (block + 1) * C_BLOCK
            memo[(canvas, block)] = model(torch.tensor([C_PROMPT + list(canvas)])[:, :end]).logits[0, end - C_BLOCK:end]
        return memo[(canvas, block)]

    law = {tuple([C_MASK] * C_GEN): 1.0}
    for block in range(C_GEN // C_BLOCK):
        lo = block * C_BLOCK
        for i in range(per_block):
            nxt: dict = defaultdict(float)
            for canvas, p in law.items():
                masked = [j for j in range(lo, lo + C_BLOCK) if canvas[j] == C_MASK]
                quota = C_BLOCK // per_block + (1 if i < C_BLOCK % per_block else 0)
                if not masked or quota == 0:
                    nxt[canvas] += p
                    continue
                ell = logits(canvas, block)
                draw = [torch.softmax(ell[j - lo, :C_VOCAB].double() / C_T, dim=-1) for j in masked]
                conf = [torch.softmax(ell[j - lo], dim=-1) for j in masked]
                for new, prob in quota_step_law(canvas, masked, draw, conf, quota):
                    nxt[new] += p * prob
            law = dict(nxt)
    joint = torch.zeros(C_VOCAB ** C_GEN, dtype=torch.float64)
    for canvas, p in law.items():
        assert C_MASK not in canvas
        joint[sum(t * C_VOCAB ** (C_GEN - 1 - j) for j, t in enumerate(canvas))] += p
    return joint


def sample(model, n: int, speculative, cache: str, loop_class=None, seed: int = 0) -> torch.Tensor:
    out, batch = [], 4096
    for start in range(0, n, batch):
        count = min(batch, n - start)
        ids = torch.tensor([C_PROMPT] * count)
        run = lambda: decode(model, ids, scheduler=LLaDAScheduler(), gen_length=C_GEN,  # noqa: E731
                             block_length=C_BLOCK, steps=C_STEPS, temperature=C_T, generator=gens(count, seed + start),
                             speculative=speculative, cache=cache).tokens
        out.append(run() if loop_class is None else with_loop(loop_class, run))
    return torch.cat(out)


def test_enumerated_model_agrees_per_seed(tiny_model):
    """The enumerated sampler's self-speculative run equals its stepwise run per seed, with fewer forwards (a cheap
    check that the certificate below tests the right object; the law itself is the slow test)."""
    ids = torch.tensor([C_PROMPT] * 64)
    call = dict(gen_length=C_GEN, block_length=C_BLOCK, steps=C_STEPS, temperature=C_T, cache="prefix")
    ref = decode(tiny_model, ids, scheduler=LLaDAScheduler(), generator=gens(64), **call)
    out = decode(tiny_model, ids, scheduler=LLaDAScheduler(), generator=gens(64), speculative=3, **call)
    assert torch.equal(ref.tokens, out.tokens) and out.stats.nfe.sum() < ref.stats.nfe.sum()


@pytest.mark.slow
def test_block_causal_self_speculation_has_the_stepwise_law(tiny_model):
    """Self-speculation over the prefix cache (k = 3 and auto) and without a cache (k = 3) passes the chi-square test
    against the enumerated stepwise law; unverified self-speculation (drafts from stale logits accepted as they are)
    fails it (its law is TV ~0.5 away on this model)."""
    joint = exact_block_causal_law(tiny_model)
    assert abs(float(joint.sum()) - 1) < 1e-12
    n = required_samples(joint)
    for speculative, cache in ((3, "prefix"), ("auto", "prefix"), (3, "none")):
        statistic, p_value, tv = chi_square_vs_exact(sample(tiny_model, n, speculative, cache), joint, C_VOCAB)
        assert p_value > ALPHA, f"{speculative}/{cache}: deviates from the stepwise law (p={p_value:.2e}, TV={tv:.4f})"
    tokens = sample(tiny_model, n, 3, "prefix", loop_class=UnverifiedLoop)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, C_VOCAB)
    assert p_value < ALPHA, f"the test failed to reject unverified drafts (p={p_value:.2e}, TV={tv:.4f})"
