"""Prophet's early commit (arXiv 2508.19982; spec dllm.md §6): ``decode(..., early_commit=ProphetRule(...))``.

A stub model with a controllable top-2 logit gap pins when the rule fires (the progress schedule of
thresholds, the answer span); the random tiny LLaDA pins which forwards may judge a row under each cache;
tiny-mdlm shows the NFE it saves and, in a left-padded batch, that every row's tokens and NFE are its own.
"""

from __future__ import annotations

import pytest
import torch

from vispec.dllm import LLaDAScheduler, decode, make_scheduler
from vispec.dllm.prophet import ProphetRule, top2_gap
from vispec.models.llada import LLaDAModelLM

MASK = 60
PROMPTS = ["sort the numbers : 5 3 9 3 1", "reverse the letters : k d m a", "how many marbles does she have ?",
           "sort the numbers : 4 1"]


class GapStub(torch.nn.Module):
    """Every generated position proposes token 7 with a top-2 logit gap ``g`` over token 8, where ``g`` is the
    row's last prompt token / 10 (left padding keeps it at ``prompt_len - 1``); ``span_gap`` overrides the
    gap at some generated positions."""

    def __init__(self, prompt_len, span_gap=None):
        super().__init__()
        self.prompt_len, self.span_gap = prompt_len, span_gap or {}
        self.config = type("C", (), dict(mask_token_id=MASK, eos_token_id=1, eot_token_id=None, pad_token_id=0,
                                         vocab_size=64, max_sequence_length=None))()

    def forward(self, input_ids, attention_mask=None):
        batch, width = input_ids.shape
        gap = input_ids[:, self.prompt_len - 1].double() / 10
        logits = torch.full((batch, width, 64), -10.0, dtype=torch.float64)
        logits[:, :, 8] = 0.0
        logits[:, :, 7] = gap[:, None]
        for pos, value in self.span_gap.items():
            logits[:, self.prompt_len + pos, 7] = value
        return type("O", (), {"logits": logits})()


def _decode(model, ids, mask=None, **kw):
    kw = {"scheduler": LLaDAScheduler(), "steps": 10, "gen_length": 10, "block_length": 10, **kw}
    return decode(model, ids, mask, **kw)


def test_fires_by_the_progress_schedule():
    """One token per step (LLaDA, steps = L = 10): progress before forward k is (k - 1) / 10. A gap of 8 passes
    7.5 at once; 5.5 passes 5.0 from progress 1/3 (4 committed: the 5th forward); 2 never passes 2.5."""
    for last, nfe in ((80, 1), (55, 5), (20, 10)):
        out = _decode(GapStub(3), torch.tensor([[5, 6, last]]), early_commit=ProphetRule())
        assert out.stats.nfe.tolist() == [nfe], last
        assert out.stats.extra["early_committed"].tolist() == [int(nfe < 10)]
        assert out.tokens.tolist() == [[7] * 10] and out.labels["early_commit"] == "prophet"


def test_thresholds_and_progress_boundaries():
    rule = ProphetRule()
    progress = torch.tensor([0.0, 0.3, 1 / 3, 0.5, 2 / 3, 0.99, 1.0])
    assert rule.threshold(progress).tolist() == [7.5, 7.5, 5.0, 5.0, 2.5, 2.5, 2.5]
    custom = ProphetRule(thresholds=(3.0, 1.0), boundaries=(0.5,))
    assert custom.threshold(torch.tensor([0.49, 0.5])).tolist() == [3.0, 1.0]
    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0], [0.0, 9.0, 9.0, 1.0]])
    assert top2_gap(logits, None).tolist() == [2.0, 0.0]
    assert top2_gap(logits, torch.tensor([True, False, False, False])).tolist() == [0.5, 0.0]


def test_fires_on_constructed_rows():
    """Mean gap over the region vs τ(progress); rows with an empty region or an uncomputed masked position are
    not judged."""
    rule = ProphetRule()
    masked = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]).bool()
    gap = torch.tensor([[8.0, 7.0, 9.0, 0.0], [5.0, 5.1, 0.0, 0.0], [9.0] * 4, [9.0] * 4, [9.0] * 4],
                       dtype=torch.float64)
    computed = torch.ones_like(masked)
    computed[4, 3] = False
    cut = torch.full((5,), 4)
    # row 0: mean 8 >= 7.5 at progress 1/4; row 1: mean 5.05 >= 5.0 at progress 1/2; row 2: nothing masked;
    # row 3: mean 9 at progress 0; row 4: one masked position was not computed
    assert rule.fires(gap, masked & computed, masked, cut, computed).tolist() == [True, True, False, True, False]
    assert rule.fires(gap - 0.1, masked, masked, cut, computed).tolist() == [True, False, False, True, False]


def test_answer_span_judges_only_its_positions():
    """Gaps of 9 at generated positions 6 and 7, 1 elsewhere: the whole canvas averages 2.6 < 7.5 at the start,
    and once 6 and 7 (the most confident) are committed the rest averages 1 < 2.5: it never fires. The answer
    span [6, 8) averages 9: it fires at once."""
    stub = GapStub(2, span_gap={6: 9.0, 7: 9.0})
    ids = torch.tensor([[5, 10]])
    assert _decode(stub, ids, early_commit=ProphetRule()).stats.nfe.tolist() == [10]
    assert _decode(stub, ids, early_commit=ProphetRule(answer_span=(6, 8))).stats.nfe.tolist() == [1]


def test_rows_fire_on_their_own_in_a_padded_batch():
    ids = torch.tensor([[0, 0, 5, 80], [0, 5, 6, 55], [5, 6, 7, 20]])
    mask = (ids != 0).long()
    batched = _decode(GapStub(4), ids, mask, early_commit=ProphetRule())
    assert batched.stats.nfe.tolist() == [1, 5, 10]
    for i in range(3):
        row = ids[i][mask[i].bool()][None]
        alone = _decode(GapStub(row.shape[1]), row, early_commit=ProphetRule())
        assert torch.equal(alone.tokens[0], batched.tokens[i]) and alone.stats.nfe[0] == batched.stats.nfe[i]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = LLaDAModelLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=48, vocab_size=61,
                     embedding_size=64, max_sequence_length=96, rope_theta=10000.0, mask_token_id=MASK, eos_token_id=1,
                     eot_token_id=2, pad_token_id=0, bos_token_id=3, init_std=0.3)
    return m.to(torch.float64).eval()


@pytest.mark.parametrize("cache,nfe", [("none", 7), ("prefix", 7), ("dkv", 7), ("dual", 9)])
def test_judged_only_on_forwards_that_computed_every_masked_position(tiny, cache, nfe):
    """τ = 0 from progress 1/2 (always fires when judged): L = 12, blocks of 4, one token per step. With no
    cache, the prefix cache (the span runs to the canvas end) and dKV (every masked position is recomputed) the
    7th forward (6 committed) judges and fires. The dual cache's block steps compute only the block while
    block 3 is still masked: the first forward that judges is block 3's refreshing full forward (the 9th). No
    forward is added."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 60, (3, 5), generator=gen)
    rule = ProphetRule(thresholds=(1e9, 0.0), boundaries=(0.5,))
    out = decode(tiny, ids, scheduler=LLaDAScheduler(), steps=12, gen_length=12, block_length=4, cache=cache,
                 early_commit=rule)
    assert out.stats.nfe.tolist() == [nfe] * 3 and out.stats.extra["early_committed"].tolist() == [1, 1, 1]
    assert not (out.tokens == MASK).any()


@pytest.fixture(scope="module")
def pipe(tiny_mdlm):
    return tiny_mdlm  # conftest.py


@pytest.mark.parametrize("strategy,steps", [("llada", 32), ("threshold", None)])
def test_lowers_nfe_on_tiny_mdlm(pipe, strategy, steps):
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    kw = dict(gen_length=32, block_length=8, steps=steps)
    plain = decode(pipe.model, ids, mask, scheduler=make_scheduler(strategy), **kw)
    for rule in (ProphetRule(), ProphetRule(thresholds=(20.0, 15.0, 10.0))):
        early = decode(pipe.model, ids, mask, scheduler=make_scheduler(strategy), early_commit=rule, **kw)
        assert (early.stats.nfe <= plain.stats.nfe).all() and early.stats.nfe.sum() < plain.stats.nfe.sum(), rule
        assert not (early.tokens == pipe.model.config.mask_token_id).any()
    # the stricter schedule keeps the answers here (tokens before the first EOS) with fewer forwards
    assert torch.equal(early.stats.tokens, plain.stats.tokens)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "dkv"])
@pytest.mark.parametrize("strategy,steps,temperature", [("llada", 32, 0.0), ("threshold", None, 0.8)])
def test_batch_with_padding_equals_one_by_one(pipe, tiny_mdlm64, cache, strategy, steps, temperature):
    model = tiny_mdlm64
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    gens = lambda: [torch.Generator().manual_seed(30 + i) for i in range(len(PROMPTS))]
    kw = dict(gen_length=32, block_length=8, steps=steps, cache=cache, temperature=temperature,
              early_commit=ProphetRule(thresholds=(20.0, 15.0, 10.0)))
    batched = decode(model, ids, mask, scheduler=make_scheduler(strategy), generator=gens(), **kw)
    assert batched.stats.extra["early_committed"].sum() >= 2
    for i, text in enumerate(PROMPTS):
        alone_ids, _ = pipe.prepare_input_ids(prompt=[text])
        alone = decode(model, alone_ids, scheduler=make_scheduler(strategy), generator=[gens()[i]], **kw)
        assert torch.equal(batched.tokens[i], alone.tokens[0]), (cache, strategy, i)
        assert batched.stats.nfe[i] == alone.stats.nfe[0]


def test_bad_input():
    cases = [
        (dict(thresholds=(7.5, 5.0)), "thresholds must have one entry more than boundaries"),
        (dict(thresholds=(7.5, -1.0, 2.5)), "thresholds must be a finite number >= 0"),
        (dict(thresholds=(7.5, float("nan"), 2.5)), "thresholds must be a finite number"),
        (dict(thresholds=7.5), "thresholds must be a tuple"),
        (dict(boundaries=(2 / 3, 1 / 3)), "boundaries must be strictly increasing"),
        (dict(boundaries=(0.0, 0.5)), r"boundaries must be a finite number in \(0, 1\]"),
        (dict(boundaries=(0.5, 1.0)), "boundaries must be strictly increasing in"),
        (dict(answer_span=(4,)), "answer_span must be None or a pair"),
        (dict(answer_span=(4, 4)), "answer_span end must be an integer >= 5"),
        (dict(answer_span=(-1, 4)), "answer_span start must be an integer >= 0"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            ProphetRule(**kwargs)
    stub, ids = GapStub(2), torch.tensor([[5, 10]])
    with pytest.raises(ValueError, match="early_commit must be None or a ProphetRule, got str"):
        _decode(stub, ids, early_commit="prophet")
    with pytest.raises(ValueError, match=r"early_commit.answer_span \(8, 12\) must lie within gen_length \(10\)"):
        _decode(stub, ids, early_commit=ProphetRule(answer_span=(8, 12)))
