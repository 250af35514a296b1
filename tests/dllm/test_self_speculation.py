"""Exact self-speculative decoding of masked diffusion LMs (issue 29, :mod:`vispec.dllm.speculative`).

* **Token equality with the stepwise run**, for every policy (LLaDA's quota with low-confidence and random
  remasking, Dream's schedule, threshold, factor, entropy bound, contiguous), at temperature 0 and 0.8, with and
  without guidance and early stop at EOS, padded batches: same tokens, and the run's ``steps`` equal to the stepwise
  run's NFE, at fewer forwards.
* **Certification by enumeration**: on a model small enough to enumerate (4 real tokens, a canvas of 4 positions
  in 2 blocks), the exact law of the stepwise LLaDA sampler (LLaDA's quota, low-confidence remasking, temperature
  0.8, guidance 1.5) is computed by a plain recursion over every candidate draw; ``n`` self-speculative samples
  (``n`` from the power calculation: power 0.99 against TV 0.03 at level 1e-3, tests/chi_square.py) must pass
  Pearson's chi-square test against it. Negative controls, which the same test must reject: threshold decoding
  (several tokens per step), and self-speculation that accepts its drafts without verifying them.
* Embedded models at temperature 0: tiny-mdlm (and, slow, tiny-mdlm-long) equal the stepwise run on test prompts of
  every task, alone and batched.
* Refusals: the rules that would change the stepwise run, and bad draft lengths, before any forward.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import pytest
import torch

from chi_square import ALPHA, chi_square_vs_exact, required_samples
from dllm_reference import quota_step_law
from helpers import left_padded, tiny_llada, tiny_llada_prompts
from vispec.dllm import LLaDAScheduler, SelfSpeculation, StopDecoding, ThresholdScheduler, decode, make_scheduler
from vispec.dllm.speculative import SpeculativeLoop
from vispec.models.llada import LLaDAModelLM

MASK, PAD, EOS, EOT = 60, 0, 1, 2

SETTINGS = [("llada", {}, 16), ("llada", {}, 8), ("llada", {"remasking": "random"}, 16),
            ("threshold", {"threshold": 0.5}, None), ("factor", {}, None), ("entropy", {}, None),
            ("contiguous", {}, None), ("dream", {}, 8), ("dream", {"alg": "origin"}, 8)]


@pytest.fixture(scope="module")
def model():
    return tiny_llada()


prompts = tiny_llada_prompts


def gens(count: int, seed: int = 10) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


# ---------------------------------------------------------------------------------------------- token equality
FAST = {("llada", 16, 0.0), ("llada", 8, 0.8), ("dream", 8, 0.8), ("threshold", None, 0.0)}


@pytest.mark.parametrize("strategy,settings,steps,temperature", [
    pytest.param(strategy, settings, steps, t, marks=() if (strategy, steps, t) in FAST and not settings.get("remasking")
                 else pytest.mark.slow)
    for strategy, settings, steps in SETTINGS for t in (0.0, 0.8)])
def test_equals_the_stepwise_run(model, strategy, settings, steps, temperature):
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    for guidance, early_stop in ((1.0, False), (1.5, True)):
        kwargs = dict(steps=steps, gen_length=16, block_length=8, temperature=temperature, guidance_scale=guidance,
                      early_stop_eos=early_stop)
        ref = decode(model, ids, mask, scheduler=make_scheduler(strategy, **settings), generator=gens(3), **kwargs)
        for k in (2, 5):
            out = decode(model, ids, mask, scheduler=make_scheduler(strategy, **settings), generator=gens(3),
                         speculative=k, **kwargs)
            where = (strategy, settings, temperature, guidance, early_stop, k)
            assert torch.equal(out.tokens, ref.tokens), where
            assert out.stats.extra["steps"].tolist() == ref.stats.nfe.tolist(), where  # the stepwise run's steps
            assert (out.stats.nfe <= ref.stats.nfe).all() and (out.stats.extra["canvases"] >= out.stats.nfe).all()
            assert out.labels["speculative"] == {"draft_length": k} and out.method == ref.method


CACHED = [("llada", {}, 24), ("threshold", {"threshold": 0.5}, None), ("dream", {}, 12), ("factor", {}, None),
          ("llada", {"remasking": "random"}, 12), ("entropy", {}, None)]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("strategy,settings,steps", [
    pytest.param(*setting, marks=() if i < 2 else pytest.mark.slow) for i, setting in enumerate(CACHED)])
def test_over_a_block_cache_equals_the_stepwise_cached_run(model, cache, strategy, settings, steps):
    """Over Fast-dLLM's prefix and dual caches the reference is the stepwise run with that cache (its refresh at each
    block start included): the same tokens and steps, for every policy, at temperature 0 and 0.8, with guidance and
    early stop, padded batches; fewer forwards; the forwarded canvases are spans, the refreshes full forwards."""
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    for temperature, guidance, early_stop in ((0.0, 1.0, False), (0.8, 1.5, True)):
        kwargs = dict(steps=steps, gen_length=24, block_length=8, temperature=temperature, guidance_scale=guidance,
                      early_stop_eos=early_stop, cache=cache)
        ref = decode(model, ids, mask, scheduler=make_scheduler(strategy, **settings), generator=gens(3), **kwargs)
        for k in (2, 5):
            out = decode(model, ids, mask, scheduler=make_scheduler(strategy, **settings), generator=gens(3),
                         speculative=k, **kwargs)
            where = (cache, strategy, settings, temperature, guidance, early_stop, k)
            assert torch.equal(out.tokens, ref.tokens), where
            assert out.stats.extra["steps"].tolist() == ref.stats.nfe.tolist(), where
            assert (out.stats.nfe <= ref.stats.nfe).all(), where
            assert out.labels["cache"] == cache and out.labels["speculative"] == {"draft_length": k}


def test_the_cached_reference_is_another_run(model):
    """Negative control for the test above: the stepwise run with a block cache gives other tokens than without one
    (stale prefix / suffix K/V), and uncached self-speculation reproduces the uncached run, not the cached one; so
    the equality above holds because the cached verification follows the cached reference."""
    ids, mask = left_padded(prompts(), PAD)
    kwargs = dict(steps=24, gen_length=24, block_length=8, scheduler=make_scheduler("llada"))
    for cache in ("prefix", "dual"):
        cached = decode(model, ids, mask, generator=gens(3), cache=cache, **kwargs)
        uncached_ssd = decode(model, ids, mask, generator=gens(3), speculative=4, **kwargs)
        assert not torch.equal(cached.tokens, uncached_ssd.tokens)
        assert torch.equal(decode(model, ids, mask, generator=gens(3), cache=cache, speculative=4, **kwargs).tokens,
                           cached.tokens)


def test_a_row_gets_its_own_tokens_in_any_batch(model):
    """Padded batch = each row alone (own chain, own noise keys), at temperature > 0."""
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    kwargs = dict(steps=16, gen_length=16, block_length=8, temperature=0.8, speculative=SelfSpeculation(4))
    batched = decode(model, ids, mask, scheduler=LLaDAScheduler(), generator=gens(3), **kwargs)
    for i, row in enumerate(rows):
        alone = decode(model, row[None], scheduler=LLaDAScheduler(), generator=[gens(3)[i]], **kwargs)
        assert torch.equal(batched.tokens[i], alone.tokens[0])
        assert batched.stats.nfe[i] == alone.stats.nfe[0]


def test_draft_length_one_is_the_stepwise_run(model):
    ids, mask = left_padded(prompts(), PAD)
    kwargs = dict(steps=16, gen_length=16, block_length=8)
    ref = decode(model, ids, mask, scheduler=LLaDAScheduler(), **kwargs)
    out = decode(model, ids, mask, scheduler=LLaDAScheduler(), speculative=1, **kwargs)
    assert torch.equal(out.tokens, ref.tokens) and out.stats.nfe.tolist() == ref.stats.nfe.tolist()


def test_callback_sees_the_verified_canvas_and_can_stop(model):
    ids, mask = left_padded(prompts(), PAD)
    seen = []

    def callback(progress):
        seen.append(progress)
        if len(seen) == 2:
            raise StopDecoding

    out = decode(model, ids, mask, scheduler=LLaDAScheduler(), steps=16, gen_length=16, block_length=8, speculative=4,
                 callback=callback)
    assert len(seen) == 2 and out.labels.get("interrupted") is True
    first = seen[0]
    assert first.details["advanced"].ge(1).all() and first.details["transfer_index"].shape == (3, 16)
    assert torch.equal(first.num_committed, first.details["reference_steps"])  # one token per step
    with pytest.raises(ValueError, match="cannot edit"):
        decode(model, ids, mask, scheduler=LLaDAScheduler(), steps=16, gen_length=16, block_length=8, speculative=4,
               callback=lambda progress: {"guidance_scale": 2.0})


@pytest.mark.parametrize("option,words", [
    ({"cache": "dkv"}, "cache='dkv'"), ({"eotp": True}, "eotp"), ({"compile": True}, "compile"),
])
def test_rules_that_change_the_stepwise_run_are_refused(model, option, words):
    ids, mask = left_padded(prompts(), PAD)
    with pytest.raises(ValueError, match=f"speculative .*{words}"):
        decode(model, ids, mask, scheduler=LLaDAScheduler(), steps=16, gen_length=16, block_length=8, speculative=4,
               **option)


@pytest.mark.parametrize("value", [0, -3, 1.5, "4", 257])
def test_bad_draft_lengths_are_named(value):
    with pytest.raises(ValueError, match="draft_length|speculative"):
        SelfSpeculation(value) if not isinstance(value, str) else decode(None, None, scheduler=LLaDAScheduler(),
                                                                          speculative=value)


# ---------------------------------------------------------------------------------------------- certification
E_MASK, E_VOCAB = 4, 4  # real tokens 0..3, the mask 4 (never proposed)
E_PROMPT = [1, 3]
E_GEN, E_BLOCK, E_STEPS = 4, 2, 4
E_T, E_G = 0.8, 1.5


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(3)
    m = LLaDAModelLM(d_model=16, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=32, vocab_size=5, embedding_size=5,
                     max_sequence_length=16, rope_theta=10000.0, mask_token_id=E_MASK, eos_token_id=3, eot_token_id=None, pad_token_id=0,
                     bos_token_id=0, init_std=0.3)
    return m.to(torch.float64).eval()


@torch.no_grad()
def exact_stepwise_law(model, cache_mode: str = "none") -> torch.Tensor:
    """``[4 ** E_GEN]`` the law of the stepwise LLaDA sampler's outputs (index ``Σ x_j 4^(L-1-j)``): LLaDA's blocks and
    quota, each masked position's candidate drawn from ``softmax(ℓ / T)`` over the real tokens (float64), the ``n_i``
    most confident (``softmax(ℓ)[x̂]`` over the whole vocabulary in the logits' dtype, ties to the lowest position)
    committed. Plain Python over every candidate draw of every step. ``cache_mode="dual"``: the sampler with
    Fast-dLLM's dual cache, whose logits at a block's later steps come from the block's span against the K/V cached
    by the block's first (full) forward; the law's states then carry the canvas the block started from."""
    per_block = E_STEPS // (E_GEN // E_BLOCK)
    memo: dict = {}
    P = len(E_PROMPT)

    def inputs(canvas: tuple) -> torch.Tensor:
        x = torch.tensor([E_PROMPT + list(canvas)])
        uncond = x.clone()
        uncond[0, :P] = E_MASK
        return torch.cat([x, uncond])

    def mix(both: torch.Tensor) -> torch.Tensor:
        return both[1] + E_G * (both[0] - both[1])

    def logits(canvas: tuple, start: tuple, first: bool, lo: int, hi: int) -> torch.Tensor:
        key = (canvas, start if cache_mode != "none" and not first else None)
        if key in memo:
            return memo[key]
        if cache_mode == "none":
            value = mix(model(inputs(canvas)).logits)[P:]
        elif first:  # the block's refresh: a full forward that caches every position's K/V
            out = model.compute_kv_cache(inputs(canvas))
            memo[("kv", canvas)] = out.kv_cache
            value = mix(out.logits)[P:]
        else:  # a cached step: the block's span against the refresh's K/V (of the canvas the block started from)
            span = model.forward_span(inputs(canvas)[:, P + lo: P + hi], P + lo, memo[("kv", start)].clone()).logits
            value = torch.zeros(E_GEN, span.shape[-1], dtype=span.dtype)
            value[lo:hi] = mix(span)
        memo[key] = value
        return value

    law = {(tuple([E_MASK] * E_GEN), None): 1.0}  # (canvas, the canvas its block started from)
    for block in range(E_GEN // E_BLOCK):
        lo, hi = block * E_BLOCK, (block + 1) * E_BLOCK
        law = {(canvas, canvas): p for (canvas, _), p in law.items()}
        for i in range(per_block):
            nxt: dict = defaultdict(float)
            for (canvas, start), p in law.items():
                masked = [j for j in range(lo, hi) if canvas[j] == E_MASK]
                quota = E_BLOCK // per_block + (1 if i < E_BLOCK % per_block else 0)
                if not masked or quota == 0:
                    nxt[(canvas, start)] += p
                    continue
                ell = logits(canvas, start, i == 0, lo, hi)
                # candidates: Gumbel-max in float64; the ranking: softmax in the logits' own precision (LLaDA's)
                draw = [torch.softmax(ell[j, :E_VOCAB].double() / E_T, dim=-1) for j in masked]
                conf = [torch.softmax(ell[j], dim=-1) for j in masked]
                for new, prob in quota_step_law(canvas, masked, draw, conf, quota):
                    nxt[(new, start)] += p * prob
            law = dict(nxt)
    joint = torch.zeros(E_VOCAB ** E_GEN, dtype=torch.float64)
    for (canvas, _), p in law.items():
        assert E_MASK not in canvas
        joint[sum(t * E_VOCAB ** (E_GEN - 1 - j) for j, t in enumerate(canvas))] += p
    return joint


class UnverifiedLoop(SpeculativeLoop):
    """Negative control: every drafted step is accepted without its verification (parallel decoding from stale
    logits)."""

    def _verify(self, chain, table, todo, verified):
        return table[:, 1:] >= 0


def sample(model, scheduler_factory, n: int, speculative, loop_class=None, seed: int = 0,
           cache: str = "none") -> torch.Tensor:
    out, batch = [], 4096
    for start in range(0, n, batch):
        count = min(batch, n - start)
        ids = torch.tensor([E_PROMPT] * count)
        kwargs = dict(gen_length=E_GEN, block_length=E_BLOCK, temperature=E_T, guidance_scale=E_G,
                      generator=gens(count, seed + start), speculative=speculative, cache=cache)
        scheduler = scheduler_factory()
        if scheduler.fixed_steps:
            kwargs["steps"] = E_STEPS
        if loop_class is None:
            out.append(decode(model, ids, scheduler=scheduler, **kwargs).tokens)
        else:
            decode_module = importlib.import_module("vispec.dllm.decode")  # the module (vispec.dllm.decode is the function)
            original = decode_module.SpeculativeLoop
            decode_module.SpeculativeLoop = loop_class
            try:
                out.append(decode(model, ids, scheduler=scheduler, **kwargs).tokens)
            finally:
                decode_module.SpeculativeLoop = original
    return torch.cat(out)


@pytest.fixture(scope="module")
def certificate(tiny_model):
    joint = exact_stepwise_law(tiny_model)
    assert abs(float(joint.sum()) - 1) < 1e-12
    return joint, required_samples(joint)


@pytest.mark.slow
@pytest.mark.parametrize("k", [4])
def test_self_speculation_has_the_stepwise_law(tiny_model, certificate, k):
    joint, n = certificate
    tokens = sample(tiny_model, LLaDAScheduler, n, k)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, E_VOCAB)
    assert p_value > ALPHA, f"self-speculation (k={k}) deviates from the stepwise law (p={p_value:.2e}, TV={tv:.4f})"


@pytest.mark.slow
@pytest.mark.parametrize("control", ["threshold", "unverified"])
def test_negative_controls_are_rejected(tiny_model, certificate, control):
    joint, n = certificate
    if control == "threshold":
        tokens = sample(tiny_model, lambda: ThresholdScheduler(threshold=0.3), n, None)
    else:
        tokens = sample(tiny_model, LLaDAScheduler, n, 4, loop_class=UnverifiedLoop)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, E_VOCAB)
    assert p_value < ALPHA, f"the test failed to reject {control} (p={p_value:.2e}, TV={tv:.4f})"


def test_enumeration_matches_the_stepwise_sampler_at_temperature_zero_limit(tiny_model):
    """The enumerator's rule is the sampler's: the stepwise and self-speculative runs agree per seed (a cheap check that
    the certificate tests the right object; the law itself is the slow test)."""
    ids = torch.tensor([E_PROMPT] * 64)
    kwargs = dict(gen_length=E_GEN, block_length=E_BLOCK, steps=E_STEPS, temperature=E_T, guidance_scale=E_G)
    ref = decode(tiny_model, ids, scheduler=LLaDAScheduler(), generator=gens(64), **kwargs)
    out = decode(tiny_model, ids, scheduler=LLaDAScheduler(), generator=gens(64), speculative=3, **kwargs)
    assert torch.equal(ref.tokens, out.tokens)


# ---------------------------------------------------------------------------------------------- real model families
def test_dream_checkpoint_equals_its_stepwise_run(tmp_path):
    """A Dream-layout checkpoint (shifted logits: position p is predicted at p - 1) under DreamScheduler, every
    algorithm, padded batch, temperature 0 and 0.7."""
    from dream_reference import random_dream_state, tiny_dream_config, write_dream_folder
    from vispec.dllm import DreamScheduler
    from vispec.models.dream_checkpoint import load_dream_checkpoint

    config = tiny_dream_config()
    dream = load_dream_checkpoint(write_dream_folder(tmp_path / "dream", random_dream_state(config), config))
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 60, (n,), generator=gen) for n in (5, 3)]
    ids, mask = left_padded(rows, 1)
    for alg, temperature in (("entropy", 0.0), ("maskgit_plus", 0.7), ("origin", 0.7), ("topk_margin", 0.0)):
        kwargs = dict(steps=8, gen_length=8, block_length=8, temperature=temperature, mask_token_id=60)
        ref = decode(dream, ids, mask, scheduler=DreamScheduler(alg=alg), generator=gens(2), **kwargs)
        out = decode(dream, ids, mask, scheduler=DreamScheduler(alg=alg), generator=gens(2), speculative=4, **kwargs)
        assert torch.equal(out.tokens, ref.tokens), alg
        assert out.stats.extra["steps"].tolist() == ref.stats.nfe.tolist()


def embedded_equality(name: str, per_task: int, batch: int, alone: int, k: int = 8,
                      tasks: tuple = ("arithmetic", "sort", "reverse"), **call) -> None:
    """Temperature 0 on the first ``per_task`` test prompts of each of ``tasks``: self-speculation equals the stepwise
    run alone (k = 4, the first ``alone`` prompts) and in batches of ``batch`` (draft length ``k``), at fewer
    forwards."""
    from vispec.eval.bench.text_tasks import get_task, split_items
    from vispec.pipelines import MaskedDiffusionLMPipeline

    pipe = MaskedDiffusionLMPipeline.from_pretrained(f"vispec/{name}")
    pipe.set_progress_bar_config(disable=True)
    prompts = [item.prompt for task in tasks for item in split_items(get_task(task), "test", per_task, 0)]
    units = [(4, prompts[i: i + 1]) for i in range(alone)]
    units += [(k, prompts[i: i + batch]) for i in range(0, len(prompts), batch)]
    for k, chunk in units:
        ref = pipe(prompt=chunk, strategy="llada", **call)
        out = pipe(prompt=chunk, strategy="llada", speculative=k, **call)
        assert torch.equal(out.sequences, ref.sequences), (name, k, chunk)
        assert [s["steps"] for s in out.stats] == [s["nfe"] for s in ref.stats]
        assert all(s["nfe"] < r["nfe"] for s, r in zip(out.stats, ref.stats))


def test_tiny_mdlm_equals_the_stepwise_run_on_test_prompts():
    embedded_equality("tiny-mdlm", per_task=2, batch=6, alone=2, early_stop_eos=False)


@pytest.mark.slow
def test_tiny_mdlm_equals_the_stepwise_run_on_more_test_prompts():
    """The pipeline's default early stop at EOS, 8 test prompts per task (batches of 12), the first 3 alone too
    (`vispec bench text --settings llada+ssd=K` compares every problem it runs)."""
    embedded_equality("tiny-mdlm", per_task=8, batch=12, alone=3)


@pytest.mark.slow
def test_tiny_mdlm_long_equals_the_stepwise_run_on_test_prompts():
    """gen length 256 (LLaDA's one token per step: 256 forwards of the stepwise run per prompt): a sort and a reverse
    test prompt in one batch, k = 4 (tiny-mdlm covers rows alone; `vispec bench text` compares every problem)."""
    embedded_equality("tiny-mdlm-long", per_task=1, batch=2, alone=0, k=4, tasks=("sort", "reverse"),
                      early_stop_eos=False)


def test_self_drafting_limit_is_the_forwards_of_an_unbounded_draft_length(model):
    """``self_drafting_limit`` (the acceptance limit of self-drafting, computed from one stepwise run) equals the
    forwards of self-speculation with ``k`` = the whole canvas, and bounds every smaller ``k`` from below."""
    from vispec.dllm.options import UnmaskingOptions
    from vispec.dllm.speculative import self_drafting_limit

    rows = prompts(lengths=(5, 5, 5))
    ids = torch.stack(rows)
    options = UnmaskingOptions(steps=16, gen_length=16, block_length=8, temperature=0.8, guidance_scale=1.5)
    limit = self_drafting_limit(model, ids, options, scheduler=LLaDAScheduler(), generator=gens(3))
    full = decode(model, ids, scheduler=LLaDAScheduler(), generator=gens(3), speculative=16,
                  **{k: getattr(options, k) for k in ("steps", "gen_length", "block_length", "temperature",
                                                      "guidance_scale")})
    assert limit == full.stats.nfe.tolist()
    small = decode(model, ids, scheduler=LLaDAScheduler(), generator=gens(3), speculative=3, steps=16, gen_length=16,
                   block_length=8, temperature=0.8, guidance_scale=1.5)
    assert all(s >= l for s, l in zip(small.stats.nfe.tolist(), limit))


@pytest.fixture(scope="module")
def cached_certificate(tiny_model):
    joint = exact_stepwise_law(tiny_model, "dual")
    assert abs(float(joint.sum()) - 1) < 1e-12
    return joint, required_samples(joint)


@pytest.mark.slow
def test_self_speculation_over_the_dual_cache_has_the_cached_stepwise_law(tiny_model, cached_certificate):
    """The certificate for the cached sampler (issue 46): the exact law of stepwise LLaDA over Fast-dLLM's dual cache,
    by enumeration; self-speculation over the same cache (k = 4 and auto) must pass the chi-square test against it,
    and the negative control, self-speculation over the cache that accepts its drafts unverified, must fail it. (The
    uncached sampler's law is only TV 0.019 away on this model, below the power target of 0.03: not a control; the
    token-equality tests tell the cached and uncached runs apart instead.)"""
    joint, n = cached_certificate
    for speculative in (4, "auto"):
        tokens = sample(tiny_model, LLaDAScheduler, n, speculative, cache="dual")
        statistic, p_value, tv = chi_square_vs_exact(tokens, joint, E_VOCAB)
        assert p_value > ALPHA, f"{speculative}: deviates from the cached stepwise law (p={p_value:.2e}, TV={tv:.4f})"
    tokens = sample(tiny_model, LLaDAScheduler, n, 4, loop_class=UnverifiedLoop, cache="dual")
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, E_VOCAB)
    assert p_value < ALPHA, f"the test failed to reject unverified drafts (p={p_value:.2e}, TV={tv:.4f})"
