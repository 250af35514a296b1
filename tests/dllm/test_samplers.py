"""dLLM samplers: LLaDA reference semantics, quota schedule, threshold / factor / entropy rules, caches, batching."""

from __future__ import annotations

import copy

import pytest
import torch
from dllm_reference import llada_reference
from helpers import left_padded, tiny_llada, tiny_llada_prompts

from vispec.dllm import (
    ContiguousScheduler,
    EntropyBoundScheduler,
    FactorScheduler,
    LLaDAScheduler,
    ThresholdScheduler,
    count_tokens,
    decode,
    make_scheduler,
)

MASK, PAD, EOS, EOT = 60, 0, 1, 2


@pytest.fixture(scope="module")
def model():
    return tiny_llada()


prompts = tiny_llada_prompts


@pytest.mark.parametrize("gen_length,block_length,steps", [(16, 16, 16), (16, 4, 8), (12, 4, 6), (8, 4, 16)])
@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_temperature_zero_equals_the_reference_pseudo_code(model, gen_length, block_length, steps, cfg_scale):
    """LLaDA's cfg_scale w is vispec's guidance_scale w + 1 (same arithmetic, same tokens)."""
    for prompt in prompts():
        expected = llada_reference(model, prompt, steps=steps, gen_length=gen_length, block_length=block_length,
                                   mask_id=MASK, cfg_scale=cfg_scale)
        out = decode(model, prompt[None], scheduler=LLaDAScheduler(), steps=steps, gen_length=gen_length,
                     block_length=block_length, guidance_scale=cfg_scale + 1)
        assert torch.equal(out.tokens[0], expected)


def test_llada_ranks_in_the_logits_precision_with_ties_to_the_lowest_position():
    """LLaDA's generate() takes softmax in the logits' dtype: in float32 both near-certain positions below round to
    exactly 1.0 and vispec commits the lower one (LLaDA's torch.topk leaves the order of ties unspecified); in
    float64 position 1 (margin 25 > 20) would win."""
    logits = torch.full((1, 3, 5), 0.0)
    logits[0, 0, 0], logits[0, 1, 1], logits[0, 2, 2] = 20.0, 25.0, 5.0
    sample = torch.full((1, 3), 4)
    scheduler = LLaDAScheduler()
    scheduler.set_timesteps(3, gen_length=3, block_length=3)
    step = dict(mask_token_id=4, num_masked_at_block_start=torch.tensor([3]))
    out32 = scheduler.step(logits, 0, sample, **step)
    assert out32.transfer_index.tolist() == [[True, False, False]] and out32.prev_sample.tolist() == [[0, 4, 4]]
    assert out32.confidence[0, 0] == out32.confidence[0, 1] == 1.0
    out64 = scheduler.step(logits.double(), 0, sample, **step)  # float64 logits: the float64 ranking
    assert out64.transfer_index.tolist() == [[False, True, False]]
    assert ThresholdScheduler(threshold=0.5).step(logits, 0, sample, mask_token_id=4).confidence[0, 1] < 1.0  # float64


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_float32_model_equals_the_reference_ranking_in_float32(model, cfg_scale):
    model32 = copy.deepcopy(model).float()
    for prompt in prompts():
        expected = llada_reference(model32, prompt, steps=8, gen_length=16, block_length=8, mask_id=MASK,
                                   cfg_scale=cfg_scale)
        out = decode(model32, prompt[None], scheduler=LLaDAScheduler(), steps=8, gen_length=16, block_length=8,
                     guidance_scale=cfg_scale + 1)
        assert torch.equal(out.tokens[0], expected)


@pytest.mark.parametrize("options", [dict(logits_eos_inf=True), dict(confidence_eos_eot_inf=True)])
def test_eos_options_match_the_reference(model, options):
    for prompt in prompts():
        expected = llada_reference(model, prompt, steps=8, gen_length=8, block_length=8, mask_id=MASK, eos_id=EOS,
                                   eot_id=EOT, **options)
        out = decode(model, prompt[None], scheduler=LLaDAScheduler(), steps=8, gen_length=8, block_length=8, **options)
        assert torch.equal(out.tokens[0], expected)
        if options.get("logits_eos_inf"):
            assert not (out.tokens == EOS).any()


def test_confidence_eos_eot_inf_ranks_eos_last_at_any_temperature():
    """Intended semantics (spec §1.3, LLaDA PR #139): EOS keeps its proposal but gets confidence 0."""
    logits = torch.full((1, 2, 8), -5.0)
    logits[0, 0, EOS] = 9.0  # position 0 proposes EOS with high confidence
    logits[0, 1, 5] = 1.0  # position 1 proposes token 5 with low confidence
    sample = torch.full((1, 2), MASK)
    conf_mask = torch.zeros(8, dtype=torch.bool)
    conf_mask[[EOS, EOT]] = True
    sched = LLaDAScheduler()
    sched.set_timesteps(2, 2, 2)
    from vispec.dllm.schedulers import UnmaskNoise

    noise = UnmaskNoise(torch.tensor([3]), torch.arange(2)[None], torch.tensor([0]))
    for temperature in (0.0, 0.7):
        out = sched.step(logits, 0, sample, mask_token_id=MASK, temperature=temperature, noise=noise,
                         num_masked_at_block_start=torch.tensor([2]), confidence_mask=conf_mask)
        assert out.sampled_tokens[0, 0] == EOS and out.confidence[0, 0] == 0.0
        assert out.transfer_index.tolist() == [[False, True]]


def test_quota_schedule_front_loads_the_remainder(model):
    commits = []
    decode(model, prompts()[0][None], scheduler=LLaDAScheduler(), steps=6, gen_length=14, block_length=7,
           callback=lambda p: commits.append((p.details["block"], int(p.details["transfer_index"].sum()))))
    # 7 masks over 3 steps per block: 3, 2, 2
    assert commits == [(0, 3), (0, 2), (0, 2), (1, 3), (1, 2), (1, 2)]
    sched = LLaDAScheduler()
    sched.set_timesteps(8, 4, 4)
    assert [int(sched.quota(torch.tensor([4]), i)) for i in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]


def test_output_and_progress_speak_the_shared_vocabulary(model):
    """decode returns a DecodeOutput and reports DecodeProgress (vispec.outputs), as the image decoders do."""
    from vispec.dllm import SCHEDULERS
    from vispec.outputs import UNDECIDED, DecodeOutput, DecodeProgress

    assert {name: cls.strategy for name, cls in SCHEDULERS.items()} == {name: name for name in SCHEDULERS}
    ids, mask = left_padded(prompts(), PAD)
    kwargs = dict(scheduler=make_scheduler("threshold", threshold=0.5), gen_length=8, block_length=4, cache="dual",
                  temperature=0.7, generator=[torch.Generator().manual_seed(i) for i in range(3)])
    seen = []

    def callback(progress):
        seen.append(DecodeProgress(progress.step, progress.num_committed.clone(), progress.tokens.clone(),
                                   {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in progress.details.items()}))
        progress.tokens.fill_(0)  # copies: cannot change decoding
        progress.details["transfer_index"].fill_(True)

    out = decode(model, ids, mask, callback=callback, **kwargs)
    kwargs["generator"] = [torch.Generator().manual_seed(i) for i in range(3)]
    assert torch.equal(decode(model, ids, mask, **kwargs).tokens, out.tokens)
    assert isinstance(out, DecodeOutput) and out.tokens.shape == (3, 8) and out.method == "threshold"
    assert out.labels == {"scheduler": "ThresholdScheduler", "cache": "dual"}
    rows = out.as_dicts()
    assert [r["nfe"] for r in rows] == out.stats.nfe.tolist() and [r["tokens"] for r in rows] == out.stats.tokens.tolist()
    assert rows[0]["method"] == "threshold" and rows[0]["scheduler"] == "ThresholdScheduler" and rows[0]["cache"] == "dual"
    assert [p.step for p in seen] == list(range(len(seen))) and len(seen) >= 2
    before = torch.zeros(3, dtype=torch.long)
    for p in seen:
        decided = p.tokens != UNDECIDED
        assert torch.equal(p.num_committed, decided.sum(dim=1)) and (p.num_committed >= before).all()
        assert torch.equal(p.tokens[decided], out.tokens[decided])  # a committed token never changes
        assert set(p.details) == {"block", "step_in_block", "rows", "transfer_index"}
        assert p.details["transfer_index"].shape == (p.details["rows"].numel(), 4)
        before = p.num_committed
    assert torch.equal(seen[-1].tokens, out.tokens) and seen[-1].num_committed.tolist() == [8, 8, 8]


def test_steps_beyond_the_masks_cost_no_forward(model):
    out = decode(model, prompts()[0][None], scheduler=LLaDAScheduler(), steps=16, gen_length=8, block_length=4)
    assert out.stats.nfe.tolist() == [8]  # 8 steps per block, 4 masks: the 4 empty steps are skipped
    assert not (out.tokens == MASK).any()


def _all_settings():
    return [("llada", dict(), 16), ("llada", dict(remasking="random"), 16), ("threshold", dict(threshold=0.5), None),
            ("factor", dict(factor=2.0), None), ("entropy", dict(gamma=2.0), None),
            ("contiguous", dict(threshold=0.5), None)]


@pytest.mark.parametrize("strategy,settings,steps", _all_settings())
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_batch_with_padding_equals_one_by_one(model, strategy, settings, steps, cache):
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(len(rows))]
    kwargs = dict(steps=steps, gen_length=16, block_length=8, cache=cache, temperature=0.8, guidance_scale=1.5,
                  early_stop_eos=True)
    batched = decode(model, ids, mask, scheduler=make_scheduler(strategy, **settings), generator=gens(), **kwargs)
    for i, row in enumerate(rows):
        alone = decode(model, row[None], scheduler=make_scheduler(strategy, **settings), generator=[gens()[i]], **kwargs)
        assert torch.equal(batched.tokens[i], alone.tokens[0]), (strategy, cache, i)
        assert batched.stats.nfe[i] == alone.stats.nfe[0]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_caches_are_exact_when_each_block_takes_one_step(model, cache):
    """At a block boundary the cache is refreshed by a full forward: a policy that completes every block in
    its first step must give the cache-free tokens exactly."""
    ids, mask = left_padded(prompts(), PAD)
    one_step = lambda: ThresholdScheduler(threshold=1e-12)
    ref = decode(model, ids, mask, scheduler=one_step(), gen_length=16, block_length=4)
    out = decode(model, ids, mask, scheduler=one_step(), gen_length=16, block_length=4, cache=cache)
    assert torch.equal(out.tokens, ref.tokens) and out.stats.nfe.tolist() == [4, 4, 4]


def test_caches_cost_the_same_forwards_and_approximate_within_a_block(model):
    ids, mask = left_padded(prompts(), PAD)
    results = {c: decode(model, ids, mask, scheduler=LLaDAScheduler(), steps=16, gen_length=16, block_length=4, cache=c)
               for c in ("none", "prefix", "dual")}
    for out in results.values():
        assert out.stats.nfe.tolist() == [16, 16, 16] and not (out.tokens == MASK).any()


def test_threshold_rule_commits_confident_positions_and_at_least_one():
    conf = torch.tensor([[0.95, 0.3, 0.91, float("-inf")], [0.2, 0.4, 0.1, 0.3]], dtype=torch.float64)
    masked = torch.isfinite(conf)
    got = ThresholdScheduler(threshold=0.9).select(conf, None, masked, 0, None, None)
    assert got.tolist() == [[True, False, True, False], [False, True, False, False]]


def test_factor_rule_per_rank_threshold():
    # sorted: 0.99 (rank 1), 0.8 (rank 2: 3 * 0.2 = 0.6 <= 1), 0.7 (rank 3: 4 * 0.3 = 1.2 > 1): commit 2
    conf = torch.tensor([[0.7, 0.99, 0.8, float("-inf")]], dtype=torch.float64)
    got = FactorScheduler(factor=1.0).select(conf, None, torch.isfinite(conf), 0, None, None)
    assert got.tolist() == [[False, True, True, False]]
    low = torch.tensor([[0.1, 0.2]], dtype=torch.float64)  # rank 1 always passes
    assert FactorScheduler(factor=1.0).select(low, None, torch.isfinite(low), 0, None, None).tolist() == [[False, True]]


def test_factor_rule_commit_last_rank_follows_the_official_boundary():
    conf = torch.tensor([[0.99, 0.98, 0.2], [0.99, 0.2, 0.1], [0.99, 0.2, float("-inf")]], dtype=torch.float64)
    masked = torch.isfinite(conf)
    paper = FactorScheduler(factor=1.0).select(conf, None, masked, 0, None, None)
    code = FactorScheduler(factor=1.0, commit_last_rank=True).select(conf, None, masked, 0, None, None)
    assert paper.sum(-1).tolist() == [2, 1, 1]
    assert code.sum(-1).tolist() == [3, 1, 2]  # the last masked rank was the first to fail: committed too
    with pytest.raises(ValueError, match="commit_last_rank"):
        FactorScheduler(commit_last_rank="yes")


def test_contiguous_rule_commits_the_confident_run_from_the_leftmost_mask():
    inf = float("-inf")
    conf = torch.tensor([[inf, 0.95, inf, 0.93, 0.5, 0.99],    # run 1, 3 (a decoded position inside); 4 blocks 5
                         [0.4, 0.99, 0.98, inf, inf, inf],     # leftmost mask unconfident: the most confident only
                         [0.91, 0.92, 0.97, 0.96, inf, 0.95]], dtype=torch.float64)
    masked = torch.isfinite(conf)
    got = ContiguousScheduler(threshold=0.9).select(conf, None, masked, 0, None, None)
    assert got.tolist() == [[False, True, False, True, False, False], [False, True, False, False, False, False],
                            [True, True, True, True, False, True]]
    assert make_scheduler("contiguous", threshold=0.8).config.threshold == 0.8


def test_entropy_bound_prefix():
    entropy = torch.tensor([[0.5, 0.1, 0.3, float("inf")]], dtype=torch.float64)
    masked = torch.isfinite(entropy)
    conf = torch.zeros_like(entropy)
    # ascending 0.1, 0.3, 0.5: spent 0, 0.1, 0.4 -> gamma 0.2 takes 2, gamma 0.4 takes 3, gamma 0 takes 1
    for gamma, expected in ((0.2, [False, True, True, False]), (0.4, [True, True, True, False]), (0.0, [False, True, False, False])):
        got = EntropyBoundScheduler(gamma=gamma).select(conf, entropy, masked, 0, None, None)
        assert got.tolist() == [expected]


def test_early_stop_fills_after_eos_and_counts_tokens_before_it():
    from vispec.dllm.loop import fill_after_eos

    x = torch.tensor([[9, 5, EOS, MASK, 7, MASK], [9, MASK, 6, 6, MASK, MASK]])
    fill_after_eos(x, torch.arange(2), 1, EOS, MASK)
    assert x.tolist() == [[9, 5, EOS, EOS, 7, EOS], [9, MASK, 6, 6, MASK, MASK]]
    seqs = torch.tensor([[5, EOT, 6, EOS, 7], [5, 6, 7, 8, 9]])
    assert count_tokens(seqs, EOS, EOT).tolist() == [2, 5]


def test_early_stop_saves_forwards(model):
    """A model that always proposes EOS confidently at the first generated position: with early stop the
    rest of the canvas is filled after one forward."""

    class EosFirst(torch.nn.Module):
        config = type("C", (), dict(mask_token_id=MASK, eos_token_id=EOS, eot_token_id=None, pad_token_id=PAD,
                                     vocab_size=64, max_sequence_length=None))()

        def forward(self, input_ids, attention_mask=None):
            logits = torch.zeros(*input_ids.shape, 64)
            logits[:, :, 7] = 1.0
            logits[:, 3, EOS] = 50.0
            return type("O", (), {"logits": logits})()

    ids = torch.tensor([[5, 6, 7]])
    out = decode(EosFirst(), ids, scheduler=ThresholdScheduler(0.9), gen_length=12, block_length=4, early_stop_eos=True)
    assert out.stats.nfe.tolist() == [1] and out.tokens[0].tolist() == [EOS] * 12 and out.stats.tokens.tolist() == [0]
    slow = decode(EosFirst(), ids, scheduler=ThresholdScheduler(0.9), gen_length=12, block_length=4)
    assert slow.stats.nfe.tolist() == [12]


def test_bad_input(model):
    p = prompts()[0][None]
    cases = [
        (dict(gen_length=10, block_length=4), "multiple of block_length"),
        (dict(gen_length=8, block_length=4, steps=3), "divisible by the number of blocks"),
        (dict(gen_length=200, block_length=8, steps=200), "exceeds the model's context"),
        (dict(gen_length=8, block_length=8, steps=8, cache="paged"), "cache must be one of"),
        (dict(gen_length=8, block_length=8, steps=8, temperature=-1.0), "temperature must be"),
        (dict(gen_length=8, block_length=8, steps=8, guidance_scale=0.5),
         r"guidance_scale must be a finite number >= 1 \(1 disables guidance; LLaDA's cfg_scale w is guidance_scale w \+ 1\)"),
        (dict(gen_length=8, block_length=8), "steps must be an integer >= 1"),
        (dict(gen_length=8, block_length=True, steps=8), "block_length must be an integer >= 1"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            decode(model, p, scheduler=LLaDAScheduler(), **kwargs)
    for bad in (0.0, 1.5, -0.1, float("nan"), True):
        for rule in (ThresholdScheduler, ContiguousScheduler):
            with pytest.raises(ValueError, match="threshold must be a finite number in \\(0, 1\\]"):
                rule(threshold=bad)
    with pytest.raises(ValueError, match="strategy must be one of"):
        make_scheduler("greedy")
    with pytest.raises(ValueError, match="remasking must be"):
        LLaDAScheduler(remasking="high_confidence")


def test_scheduler_config_round_trip(tmp_path):
    sched = ThresholdScheduler(threshold=0.8)
    sched.save_pretrained(tmp_path)
    assert ThresholdScheduler.from_pretrained(tmp_path).config.threshold == 0.8
