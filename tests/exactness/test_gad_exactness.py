"""Certified exactness of GAD (``decoding="gad"``, :mod:`vispec.decoding.gad`): a masked block drafter proposes
``d_1 .. d_k`` independently from one forward, or in several passes each conditioned on the drafts left of it
(``passes``), and the target verifies them by exact speculative sampling.

Protocol as ``test_exactness.py`` (its module docstring): a tiny random GPT (vocabulary 4, 6 tokens of a 3x3 grid,
CFG 2.0, temperature 0.9, top-k 3, top-p 0.9), the exact AR joint over all 4**6 sequences by enumeration, ``n``
whole sequences per decoder (``n`` from the power calculation against TV 0.03 at level 1e-3) and Pearson's
chi-square test. The drafter is a tiny random :class:`~vispec.models.gad_drafter.GADDrafter` whose proposals are
far enough from the target that rejections (and residual samples) are common, near enough that about half the
drafts are kept, and, with strong attention and MLP weights, depend on the context it is shown: for the multi-pass
drafter, on the earlier passes' drafts (the constructor's small init gives nearly the same ``q`` whatever the
context; with these weights one pass and two passes give different sequences for 12% of the seeds).

Negative controls, which the same test must reject:

* the rejection step resamples from ``p`` instead of the residual ``max(0, p - q)``;
* the verification is handed a ``q`` other than the one the drafts were sampled from (uniform), so the ratio test
  ``min(1, p / q)`` and the residual are computed for the wrong proposal.
"""

from __future__ import annotations

import pytest
import torch

import vispec.decoding.gad as gad_module
import vispec.kernels.verify as verify_module
from vispec.decoding import DecodingConfig, decode
from vispec.models.gad_drafter import GADDrafter
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

from chi_square import ALPHA, chi_square_vs_exact, required_samples
from helpers import exact_joint, tiny_gpt

pytestmark = pytest.mark.slow

NUM_TOKENS = 6
CLASS_LABEL = 1
SAMPLING = SamplingConfig(temperature=0.9, top_k=3, top_p=0.9, guidance_scale=2.0)


@pytest.fixture(scope="module")
def setup():
    model = tiny_gpt()
    _, joint = exact_joint(model, CLASS_LABEL, NUM_TOKENS, SAMPLING)
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    return model, joint, required_samples(joint)


def gad_drafter(attention: str = "bidirectional") -> GADDrafter:
    """A random block drafter over the tiny GPT's vocabulary, classes and grid (blocks up to 4; context 3, or the
    whole prefix when causal) whose ``q`` moves with its context (module docstring)."""
    torch.manual_seed(17)
    drafter = GADDrafter(vocab_size=4, dim=16, n_layer=1, n_head=2, num_classes=3, block_size=9, max_block=4,
                         context=0 if attention == "causal" else 3, attention=attention).eval()
    torch.nn.init.normal_(drafter.output.weight, std=0.15)
    torch.manual_seed(4)
    for name, weight in drafter.named_parameters():
        if name.startswith("layers.") and weight.dim() == 2:  # attention and MLP matrices
            torch.nn.init.normal_(weight, std=0.3)
    torch.nn.init.normal_(drafter.tok_embeddings.weight, std=1.0)
    return drafter


def sample_gad(model, spec: str, n: int, seed: int, max_batch_size=None,
               attention: str = "bidirectional") -> tuple[torch.Tensor, float, float]:
    condition = LlamaGenCondition(class_labels=torch.full((n,), CLASS_LABEL, dtype=torch.long))
    label, _, acceptance = spec.partition("+")
    out = decode(model, condition, num_tokens=NUM_TOKENS, sampling=SAMPLING, decoding=DecodingConfig.parse(label),
                 acceptance=acceptance or None, generator=torch.Generator().manual_seed(seed), grid_width=3,
                 drafter=gad_drafter(attention), max_batch_size=max_batch_size)
    accepted = float(out.stats.accepted_drafts.sum()) / float((out.stats.nfe - 1).sum())
    return out.tokens, float(out.stats.tokens_per_forward.mean()), accepted


# one certificate (CI time), streamed through fewer slots than requests (slots refilled mid-decode): the multi-pass
# drafter with groups of 2 and 2 drafts, the first group drafted independently from the prefix (what a single pass
# does), the second from the prefix and the first group's drafts, clipped to fewer drafts at the image's end. The
# plain batch is the same code path, and the budget rule at δ = 0 equals the exact rule token for token
# (tests/decoding/test_gad.py). These passed this test too when run: one pass, window 3 (p = 0.459), window 5
# (p = 0.643, slots refilled), window 4 + budget δ = 0 (p = 0.728), all with a drafter of near-constant q (no
# attention re-init); with this drafter, window 5 in one pass (p = 0.152) and with passes=3,groups=doubling
# (groups 1, 1, 2; p = 0.091).
@pytest.mark.parametrize("spec,max_batch_size,attention", [("gad:window=5,passes=2", 700, "bidirectional"),
                                                            ("gad:window=5,passes=2,groups=doubling", None, "causal")])
def test_gad_matches_exact_joint(setup, spec, max_batch_size, attention):
    model, joint, n = setup
    tokens, tpf, accepted = sample_gad(model, spec, n, seed=2024, max_batch_size=max_batch_size, attention=attention)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\n{spec} ({attention} drafter): n={n} chi2={statistic:.1f} p={p_value:.4f} TV={tv:.4f} tokens/forward={tpf:.3f} "
          f"accepted drafts/pass={accepted:.3f}")
    assert accepted > 0.1, "the drafter's proposals were (almost) never accepted: the test would not cover verification"
    assert p_value > ALPHA, f"{spec} deviates from the exact AR joint (p={p_value:.2e}, TV={tv:.4f})"


def _residual_from_target(p, q):
    """Deliberately wrong: resample from p instead of max(0, p - q)."""
    return p.clone()


def _verify_with_other_q(original):
    """Deliberately wrong: verify against a uniform q, not the q the drafts were sampled from."""
    def verify(target, rule, drafts, num_drafts, width, draws, coupling, *, q=None, **kwargs):
        if q is not None:
            q = torch.full_like(q, 1.0 / q.shape[-1])
        return original(target, rule, drafts, num_drafts, width, draws, coupling, q=q, **kwargs)
    return verify


@pytest.mark.parametrize("broken", ["residual_from_p", "other_q"])
def test_gad_negative_controls_fail(setup, broken, monkeypatch):
    model, joint, n = setup
    if broken == "residual_from_p":
        monkeypatch.setattr(verify_module, "residual_weights", _residual_from_target)
    else:
        monkeypatch.setattr(gad_module, "verify_window", _verify_with_other_q(gad_module.verify_window))
    # a sixteenth of the certificate's samples: these errors are large (TV 0.37, 0.83), a smaller run only makes
    # failing harder, and each still fails with p ≈ 0
    tokens, _, _ = sample_gad(model, "gad:window=4,passes=2", n // 16, seed=2024)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\nnegative control {broken}: n={n // 16} chi2={statistic:.1f} p={p_value:.2e} TV={tv:.4f}")
    assert p_value < ALPHA, f"the exactness test failed to detect a broken verification ({broken})"
