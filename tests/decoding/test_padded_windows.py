"""Padded window rows and idle slots are safe by construction (issue 28, item 22).

A compiled speculative step pads every window to a width of the window set, and keeps finished samples in their
slots (idle, width 1); an eager decode that streams requests keeps idle slots too. The rows past a sample's own
width read token-buffer positions nothing wrote for them (past ``N`` for an idle slot). The one-row pass used to
write -1 (nothing sampled) there, and the next wider pass fed it to the embedding: an IndexError eagerly, an
inductor "index out of bounds" assertion compiled. Now the buffer holds only token ids and padded rows feed token
0, whatever the buffer holds past a window."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import vispec.decoding.sjd as sjd
from vispec.decoding import decode
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

from helpers import tiny_gpt

SAMPLING = SamplingConfig(temperature=0.9, top_k=12, guidance_scale=2.0)
VOCAB = 16
#: window 1 between wider ones, so one-row passes run while some samples are idle and a wider pass follows
SCRIPT = (1, 4, 1, 2, 8, 1, 16, 1, 2)


class ScriptedChooser:
    """A window chooser that runs ``script`` in turn (capped at what the batch needs: eagerly a width outside the
    window set, which a compiled decode pads up), so eager and compiled decodes make the same choices."""

    def __init__(self, script: tuple[int, ...]):
        self.script, self.passes = script, 0

    def prefers_ar(self, num_tokens: int) -> bool:
        return False

    def choose(self, need: int, longest: int, live: int, remaining: Optional[int] = None) -> int:
        window = self.script[self.passes % len(self.script)]
        self.passes += 1
        return min(window, need)

    def must_sync(self) -> bool:
        return True

    def record(self, *args, **kwargs) -> None:
        pass


def _model():
    return tiny_gpt(vocab_size=VOCAB, block_size=16, num_classes=3, dim=32, std=0.3).to(torch.float64)


def _decode(model, requests: int, spec: str = "mc-sjd:window=auto", **kwargs):
    condition = LlamaGenCondition(class_labels=torch.arange(requests) % 3)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(requests)]
    return decode(model, condition, num_tokens=16, sampling=SAMPLING, decoding=spec, generator=gens, grid_width=4, **kwargs)


def _scripted(monkeypatch, script=SCRIPT):
    monkeypatch.setattr(sjd, "_chooser", lambda *args: ScriptedChooser(script))


def _watch_embedding(monkeypatch, model) -> list[torch.Tensor]:
    """Every token tensor the model's windows feed (eager)."""
    seen = []
    original = model.forward_window

    def forward_window(state, tokens, *args, **kwargs):
        seen.append(tokens.clone())
        return original(state, tokens, *args, **kwargs)

    monkeypatch.setattr(model, "forward_window", forward_window)
    return seen


@pytest.mark.parametrize("spec", ["mc-sjd:window=auto", "sjd:window=auto", "mc-sjd-gumbel:window=auto"])
def test_streamed_idle_slots_survive_one_row_passes(monkeypatch, spec):
    """Streaming keeps idle slots eagerly: one-row passes between wider ones used to feed -1 to the embedding."""
    _scripted(monkeypatch)
    model = _model()
    seen = _watch_embedding(monkeypatch, model)
    streamed = _decode(model, requests=3, spec=spec, max_batch_size=2)
    assert all(int(t.min()) >= 0 and int(t.max()) < VOCAB for t in seen)
    assert int(streamed.tokens.min()) >= 0 and int(streamed.tokens.max()) < VOCAB
    assert set(streamed.stats.windows) > {1}  # one-row and wider passes both ran


def test_what_lies_past_a_window_changes_nothing(monkeypatch):
    """Out-of-range ids written past every slot's window and known drafts (and past N in idle slots) before
    each pass: the same tokens as a clean buffer, and the model sees only ids in the vocabulary."""
    _scripted(monkeypatch)
    model = _model()
    clean = _decode(model, requests=3, max_batch_size=2)
    original = sjd.sjd_step

    def poisoned(step, batch, width_pad, longest):
        n, count = batch.n, batch.state["draft_count"]
        width = torch.where(batch.live, (step.job.num_tokens - n).clamp(max=step.window), 1)
        used = torch.maximum(n + count, n - 1 + width)  # the first position no real row reads
        past = torch.arange(batch.tokens.shape[1])[None, :] >= used[:, None]
        batch.tokens.masked_fill_(past, -1)
        batch.tokens.masked_fill_(past & (torch.arange(batch.tokens.shape[1]) % 2 == 0), VOCAB + 7)
        return original(step, batch, width_pad, longest)

    monkeypatch.setattr(sjd, "sjd_step", poisoned)
    seen = _watch_embedding(monkeypatch, model)
    dirty = _decode(model, requests=3, max_batch_size=2)
    assert all(int(t.min()) >= 0 and int(t.max()) < VOCAB for t in seen)
    assert torch.equal(clean.tokens, dirty.tokens)
    assert torch.equal(clean.stats.nfe, dirty.stats.nfe)


def test_idle_slots_keep_their_buffer_on_commit(monkeypatch):
    """A pass samples nothing for idle slots (-1); committing leaves their buffer as it was."""
    _scripted(monkeypatch, (1,))
    commits = []
    original = sjd.RaggedBatch.commit

    def commit(self, num_accepted, next_token):
        before = self.tokens.clone()
        original(self, num_accepted, next_token)
        commits.append((self.live.clone(), before, self.tokens.clone(), next_token.clone()))

    monkeypatch.setattr(sjd.RaggedBatch, "commit", commit)
    _decode(_model(), requests=3, max_batch_size=2)
    idle_passes = [(live, before, after, token) for live, before, after, token in commits if not bool(live.all())]
    assert idle_passes and any(bool((token[~live] < 0).any()) for live, _, _, token in idle_passes)
    for live, before, after, _ in idle_passes:
        assert torch.equal(before[~live], after[~live])
        assert int(after.min()) >= 0


@pytest.fixture(scope="module")
def model16():
    """One float64 model for the compiled tests (compiled graphs are kept per model: fewer compilations)."""
    return _model()


@pytest.mark.slow
def test_compiled_scripted_windows_match_eager_at_batch_16(monkeypatch, model16):
    """Batch 16, compiled: widths padded up to the window set (1, 2, 4, 8, 16), idle slots kept, one-row
    passes between wider ones; float64, so the compiled graphs' rounding flips no token: the same tokens as eager."""
    _scripted(monkeypatch)
    eager = _decode(model16, requests=16)
    compiled = _decode(model16, requests=16, compile=True)
    assert torch.equal(eager.tokens, compiled.tokens)
    assert torch.equal(eager.stats.nfe, compiled.stats.nfe)
    assert {1, 2, 4, 8, 16} <= set(compiled.stats.windows)
