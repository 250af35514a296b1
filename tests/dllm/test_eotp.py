"""End-of-text prediction (Learn2PD, arXiv 2509.25188; spec dllm.md §5.4): ``decode(..., eotp=True)``.

A plain reference loop that physically truncates the sequence is the yardstick at batch 1 (tiny-mdlm, no
cache); a left-padded batch gives every row its tokens and NFE alone under every cache; constructed logits
pin the cut (after the first accepted EOS, else after the most confident masked EOS prediction) and the
forward widths that follow from it.
"""

from __future__ import annotations

import pytest
import torch

from vispec.dllm import LLaDAScheduler, ThresholdScheduler, decode, make_scheduler
from vispec.dllm.eotp import end_of_text_cut, truncate

PROMPTS = ["sort the numbers : 5 3 9 3 1", "reverse the letters : k d m a", "how many marbles does she have ?",
           "sort the numbers : 4 1"]


@pytest.fixture(scope="module")
def pipe(tiny_mdlm):
    return tiny_mdlm  # conftest.py


@torch.no_grad()
def eotp_reference(model, prompt, *, gen_length, block_length, rule, steps=None, threshold=0.9):
    """EoTP written plainly: one unpadded prompt, Python loops, the sequence physically cut.

    ``rule="llada"``: the LLaDA quota (``steps`` in total), top-n by ``softmax(ℓ)[x̂]`` in the logits' own
    precision (ties: the lowest position; in float32 several EOS positions round to exactly 1.0);
    ``rule="threshold"``: every masked block position with float64 confidence ``>= threshold``
    and the most confident one. After each step: an EOS among the committed positions cuts the sequence
    after the first of them; otherwise the masked position whose candidate is EOS with the highest float64
    confidence does. Returns ``(tokens [gen_length], forwards)``; dropped positions read as EOS.
    """
    mask, eos, vocab = model.config.mask_token_id, model.config.eos_token_id, model.config.vocab_size
    seq = torch.cat([prompt, torch.full((gen_length,), mask, dtype=torch.long)])
    start0 = len(prompt)
    forwards = 0
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks if steps else None
    for k in range(num_blocks):
        lo, hi = start0 + k * block_length, min(start0 + (k + 1) * block_length, len(seq))
        if lo >= len(seq):
            break
        count = int((seq[lo:hi] == mask).sum())
        i = 0
        while bool((seq[lo:hi] == mask).any()):
            if per_block is not None and i >= per_block:
                break
            logits = model(seq[None]).logits[0]
            forwards += 1
            proposal = logits.double().clone()
            proposal[:, mask] = float("-inf")
            proposal[:, vocab:] = float("-inf")
            cand = proposal.argmax(dim=-1)
            conf64 = torch.softmax(logits.double(), dim=-1).gather(-1, cand[:, None]).squeeze(-1)
            masked = [j for j in range(lo, hi) if seq[j] == mask]
            if rule == "llada":
                quota = count // per_block + (1 if i < count % per_block else 0)
                native = torch.softmax(logits, dim=-1).gather(-1, cand[:, None]).squeeze(-1)
                chosen = sorted(masked, key=lambda j: (-float(native[j]), j))[:quota]  # ties: the lowest position
            else:
                chosen = [j for j in masked if conf64[j] >= threshold]
                best = max(masked, key=lambda j: (float(conf64[j]), -j))
                chosen = sorted(set(chosen) | {best})
            for j in chosen:
                seq[j] = cand[j]
            hits = sorted(j for j in chosen if seq[j] == eos)
            if hits:
                seq = seq[: hits[0] + 1]
            else:
                predicted = [j for j in range(start0, len(seq)) if seq[j] == mask and cand[j] == eos]
                if predicted:
                    seq = seq[: max(predicted, key=lambda j: (float(conf64[j]), -j)) + 1]
            hi = min(hi, len(seq))
            i += 1
    out = torch.full((gen_length,), eos, dtype=torch.long)
    out[: len(seq) - start0] = seq[start0:]
    return out, forwards


@pytest.mark.parametrize("rule,steps", [("llada", 32), ("llada", 16), ("threshold", None)])
def test_batch_of_one_equals_physical_truncation(pipe, rule, steps):
    cut_short = 0
    for text in PROMPTS:
        ids, _ = pipe.prepare_input_ids(prompt=[text])
        expected, forwards = eotp_reference(pipe.model, ids[0], gen_length=32, block_length=8, rule=rule, steps=steps)
        out = decode(pipe.model, ids, scheduler=make_scheduler(rule), gen_length=32, block_length=8, steps=steps,
                     eotp=True)
        assert out.tokens[0].tolist() == expected.tolist(), text
        assert out.stats.nfe.tolist() == [forwards]
        length = int(out.stats.extra["canvas_length"][0])
        assert (out.tokens[0, length:] == pipe.model.config.eos_token_id).all()
        cut_short += length < 32
    assert cut_short >= 3  # the prompts do end early: the test exercises truncation


def _gens(n, base=20):
    return [torch.Generator().manual_seed(base + i) for i in range(n)]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "dkv"])
@pytest.mark.parametrize("strategy,steps,temperature", [("llada", 32, 0.0), ("threshold", None, 0.8)])
def test_batch_with_padding_equals_one_by_one(pipe, tiny_mdlm64, cache, strategy, steps, temperature):
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    assert not mask.all()  # left padding in the batch
    kwargs = dict(gen_length=32, block_length=8, steps=steps, cache=cache, temperature=temperature, eotp=True)
    batched = decode(tiny_mdlm64, ids, mask, scheduler=make_scheduler(strategy), generator=_gens(len(PROMPTS)),
                     **kwargs)
    assert (batched.stats.extra["canvas_length"] < 32).sum() >= 2
    for i, text in enumerate(PROMPTS):
        alone_ids, _ = pipe.prepare_input_ids(prompt=[text])
        alone = decode(tiny_mdlm64, alone_ids, scheduler=make_scheduler(strategy), generator=[_gens(len(PROMPTS))[i]],
                       **kwargs)
        assert torch.equal(batched.tokens[i], alone.tokens[0]), (cache, strategy, i)
        assert batched.stats.nfe[i] == alone.stats.nfe[0]
        assert batched.stats.extra["canvas_length"][i] == alone.stats.extra["canvas_length"][0]


def test_eotp_saves_forwards_and_keeps_the_text(pipe):
    """Truncation only drops what follows the end of the text: the text before the first EOS is the plain
    decode's on these prompts, with far fewer forwards."""
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS[:2])
    plain = decode(pipe.model, ids, mask, scheduler=LLaDAScheduler(), gen_length=32, block_length=8, steps=32)
    eotp = decode(pipe.model, ids, mask, scheduler=LLaDAScheduler(), gen_length=32, block_length=8, steps=32, eotp=True)
    assert (eotp.stats.nfe < plain.stats.nfe).all()
    assert torch.equal(eotp.stats.tokens, plain.stats.tokens)
    assert eotp.labels == {"scheduler": "LLaDAScheduler", "cache": "none", "eotp": True}


class _Stub(torch.nn.Module):
    """A model whose logits are fixed per generated position: ``table [L, V]`` (the prompt's rows unused); it
    records the width of every forward."""

    def __init__(self, table, prompt_len, mask=60, eos=1, vocab=64):
        super().__init__()
        self.table, self.prompt_len, self.widths = table, prompt_len, []
        self.config = type("C", (), dict(mask_token_id=mask, eos_token_id=eos, eot_token_id=None, pad_token_id=0,
                                         vocab_size=vocab, max_sequence_length=None))()

    def forward(self, input_ids, attention_mask=None):
        self.widths.append(input_ids.shape[1])
        batch, width = input_ids.shape
        logits = torch.zeros(batch, width, self.table.shape[1])
        logits[:, self.prompt_len:] = self.table[: width - self.prompt_len]
        return type("O", (), {"logits": logits})()


def _table(length, vocab=64, eos=1):
    table = torch.zeros(length, vocab)
    table[:, 7] = 2.0  # every position mildly prefers token 7
    return table


def test_an_accepted_eos_cuts_right_after_it():
    table = _table(12)
    table[5, 1] = 30.0  # position 5: EOS, certain (committed at the first step)
    table[9, 1] = 30.0  # a later EOS that must not matter: the first committed one cuts
    stub = _Stub(table, prompt_len=3)
    out = decode(stub, torch.tensor([[5, 6, 7]]), scheduler=ThresholdScheduler(0.9), gen_length=12, block_length=12,
                 eotp=True)
    assert out.stats.extra["canvas_length"].tolist() == [6]
    assert out.tokens[0].tolist() == [7] * 5 + [1] * 7
    assert stub.widths[0] == 15 and set(stub.widths[1:]) == {3 + 6}  # every later forward: the cut canvas only


def test_a_masked_eos_prediction_cuts_after_the_most_confident_one_and_skips_later_blocks():
    table = _table(16)
    table[9, 1], table[6, 1], table[13, 1] = 3.0, 4.0, 2.5  # uncertain EOS predictions; 6 is the most confident
    stub = _Stub(table, prompt_len=2)
    out = decode(stub, torch.tensor([[5, 6]]), scheduler=LLaDAScheduler(), steps=16, gen_length=16, block_length=4,
                 eotp=True)
    assert out.stats.extra["canvas_length"].tolist() == [7]
    assert out.tokens[0, 7:].tolist() == [1] * 9 and (out.tokens[0, :7] != 60).all()
    assert out.stats.nfe.tolist() == [7]  # 7 positions, one per step; blocks 2 and 3 cost nothing
    assert stub.widths == [18] + [2 + 7] * 6


def test_eos_committed_only_to_meet_the_floor_is_not_accepted():
    """Learn2PD truncates after an *accepted* EOS; an EOS committed as the floor (the most confident masked
    position, below the filter) does not cut. ``accepted`` here: the positions with c >= 0.9."""

    class Filtered(ThresholdScheduler):
        def step(self, model_output, timestep, sample, **kwargs):
            out = super().step(model_output, timestep, sample, **kwargs)
            out.accepted = out.transfer_index & (out.confidence >= 0.9)
            return out

    table = _table(8)
    table[2, 1] = 6.0  # EOS at 2: the most confident (floor) but below 0.9, and the only masked EOS
    eos_conf = torch.softmax(table[2], 0)[1]
    assert 0.5 < eos_conf < 0.9
    out = decode(_Stub(table, 1), torch.tensor([[5]]), scheduler=Filtered(0.9), gen_length=8, block_length=8,
                 eotp=True, temperature=0.0)
    # step 1 commits EOS at 2 (floor, not accepted) and nothing else masked predicts EOS: no cut at all
    assert out.stats.extra["canvas_length"].tolist() == [8] and out.tokens[0, 2] == 1
    plain = decode(_Stub(table, 1), torch.tensor([[5]]), scheduler=ThresholdScheduler(0.9), gen_length=8,
                   block_length=8, eotp=True)
    assert plain.stats.extra["canvas_length"].tolist() == [3]  # without a filter every commit counts


def test_cut_rule_on_constructed_rows():
    inf = float("-inf")
    cut = torch.tensor([6, 6, 6, 4])
    tokens = torch.tensor([[9, 1, 9, 1, 5, 5], [9, 9, 5, 5, 5, 5], [9, 5, 5, 5, 5, 5], [9, 5, 5, 5, 1, 1]])
    accepted = torch.tensor([[0, 1, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]).bool()
    masked = tokens == 5
    candidates = torch.tensor([[-1, -1, -1, -1, 1, 1], [-1, -1, 1, 3, 1, 1], [-1, 3, 3, 3, 3, 3], [-1, 1, 1, 1, 1, 1]])
    confidence = torch.tensor([[inf, inf, inf, inf, .9, .95], [inf, inf, .5, .9, .7, .7], [inf] + [.9] * 5,
                               [inf, .2, .3, .3, .9, .9]], dtype=torch.float64)
    got = end_of_text_cut(cut, accepted, tokens, masked, candidates, confidence, eos_id=1)
    # row 0: first accepted EOS at 1; row 1: masked EOS predictions at 2, 4, 5, the best (0.7, ties: lowest) at 4;
    # row 2: nothing; row 3: the best masked EOS (ties: the lowest, 2) -> 3 (never beyond the current cut 4)
    assert got.tolist() == [2, 5, 6, 3]
    assert truncate(tokens, got, 1)[1].tolist() == [9, 9, 5, 5, 5, 1]


def test_bad_input(pipe):
    ids, _ = pipe.prepare_input_ids(prompt=PROMPTS[:1])
    kw = dict(scheduler=ThresholdScheduler(), gen_length=8, block_length=8)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="eotp must be True or False"):
            decode(pipe.model, ids, eotp=bad, **kw)

    class NoEos(_Stub):
        pass

    stub = NoEos(_table(8), 1)
    stub.config.eos_token_id = None
    with pytest.raises(ValueError, match="eotp needs an eos_token_id"):
        decode(stub, torch.tensor([[5]]), eotp=True, **kw)
    with pytest.raises(ValueError, match="compile=True needs static shapes; eotp"):
        decode(pipe.model, ids, eotp=True, compile=True, **kw)
