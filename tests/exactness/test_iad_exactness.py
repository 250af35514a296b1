"""Certified exactness of input-guided aggressive decoding (IAD: drafts copied from a source image,
``init="source"``), alone (``"iad"``) and composed with MC-SJD's coupling and SJD-PAC's tree.

Protocol as tests/exactness/test_exactness.py (Pearson's chi-square of ``n`` decoded sequences against the
enumerated AR joint, ``n`` from the power calculation against TV 0.03 at level 1e-3), on two models:

* the tiny random LlamaGen GPT (vocabulary 4, 6 tokens, window 3), each sample drafting from one of three
  sources: the joint's most likely sequence (drafts mostly accepted), a fixed other sequence (mostly
  rejected), and one with holes (``-1``: no source token there, horizontal fallback);
* a tiny random Chameleon in Lumina-mGPT 2.0's dual-panel layout (image-to-image): the prompt holds the
  source panel after an image prefix declaring twice the rows, end-of-row tokens are forced, guidance keeps
  the panel in the unconditional branch; the drafts are the source panel itself, end-of-row tokens included.

The source only changes the drafts, which are deterministic (one-hot ``q``), so every sample must follow the
exact joint whatever its source. Negative control: the same test rejects IAD whose rejection step resamples
from ``p`` instead of the residual ``max(0, p - q)``.
"""

from __future__ import annotations

import pytest
import torch

import vispec.kernels.verify as verify_module
from vispec.decoding import DecodingConfig, decode
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.models.unified import ImageLayout, UnifiedTokenModel
from vispec.models.unified_families import chameleon_backbone

from chi_square import ALPHA, chi_square_vs_exact, required_samples
from helpers import exact_joint, tiny_gpt
from test_exactness import CLASS_LABEL, NUM_TOKENS, SAMPLING, WINDOW
from test_exactness_unified import (COLS, HEAD_SCALE, NUM_CODES, PROMPT, ROWS, chi_square_vs_exact as unified_chi_square,
                                    exact_joint_unified, required_samples as unified_required_samples)
from unified_helpers import BOI, CODE0, EOI, EOL, RES0, tiny_chameleon

# the source only enters through the draft initialisation, which every decoder shares: the GPT certifies IAD and
# MC-SJD's coupled re-drafting from the source, the dual-panel model IAD under forced end-of-row tokens (SJD-PAC
# and MC-SJD-Gumbel with source drafts passed both models too when run: README, "Exactness, certified")
GPT_METHODS = ["iad", "mc-sjd-maximal:init=source"]
PANEL_METHODS = ["iad"]


def _window(label: str) -> DecodingConfig:
    config = DecodingConfig.parse(label)
    return config if label.startswith("sjd-pac") else DecodingConfig.parse(label, window=WINDOW)


# ---- the tiny LlamaGen GPT ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_setup():
    model = tiny_gpt()
    seqs, joint = exact_joint(model, CLASS_LABEL, NUM_TOKENS, SAMPLING)
    mode = seqs[int(joint.argmax())]
    sources = torch.stack([mode, torch.tensor([3, 0, 3, 1, 2, 0]), torch.tensor([-1, 2, -1, -1, 1, -1])])
    return model, joint, required_samples(joint), sources


def sample_gpt(model, label: str, n: int, seed: int, sources: torch.Tensor) -> tuple[torch.Tensor, float]:
    condition = LlamaGenCondition(class_labels=torch.full((n,), CLASS_LABEL, dtype=torch.long))
    source = sources[torch.arange(n) % sources.shape[0]]
    out = decode(model, condition, num_tokens=NUM_TOKENS, sampling=SAMPLING, decoding=_window(label),
                 generator=torch.Generator().manual_seed(seed), grid_width=3, source=source)
    return out.tokens, float(out.stats.tokens_per_forward.mean())


@pytest.mark.parametrize("method", GPT_METHODS)
def test_iad_matches_exact_joint(gpt_setup, method):
    model, joint, n, sources = gpt_setup
    tokens, tpf = sample_gpt(model, method, n, seed=4321, sources=sources)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\n{method}: n={n} chi2={statistic:.1f} p={p_value:.4f} TV={tv:.4f} tokens/forward={tpf:.3f}")
    assert p_value > ALPHA, f"{method} deviates from the exact AR joint (p={p_value:.2e}, TV={tv:.4f})"


def test_iad_drafts_from_the_mode_are_accepted_more(gpt_setup):
    """The source is what IAD drafts: copying the joint's mode commits more tokens per forward than copying a
    sequence the model rarely writes (behaviour, not timing: forwards are counted)."""
    model, _, _, sources = gpt_setup
    _, from_mode = sample_gpt(model, "iad", 2048, seed=1, sources=sources[:1])
    _, from_other = sample_gpt(model, "iad", 2048, seed=1, sources=sources[1:2])
    print(f"\ntokens/forward: source = mode {from_mode:.3f}, source = another sequence {from_other:.3f}")
    assert from_mode > from_other


def _residual_from_target(p, q):
    """Deliberately wrong: resample from p instead of max(0, p - q)."""
    return p.clone()


def test_negative_control_fails(gpt_setup, monkeypatch):
    model, joint, n, sources = gpt_setup
    monkeypatch.setattr(verify_module, "residual_weights", _residual_from_target)
    tokens, _ = sample_gpt(model, "iad", n // 8, seed=4321, sources=sources)  # TV 0.18: an eighth still fails it at p ≈ 0
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\nnegative control iad (resample from p): n={n // 8} chi2={statistic:.1f} p={p_value:.2e} TV={tv:.4f}")
    assert p_value < ALPHA, "the exactness test failed to detect a wrong residual"


# ---- a dual-panel unified model with forced end-of-row tokens -----------------------------------------------

def dual_panel_model() -> UnifiedTokenModel:
    """tests/exactness/test_exactness_unified.py's model, with the image prefix declaring two panels."""
    chameleon = tiny_chameleon(0, 2)
    with torch.no_grad():
        chameleon.lm_head.weight.mul_(HEAD_SCALE)
    layout = ImageLayout(rows=ROWS, cols=COLS, num_codes=NUM_CODES, code_offset=CODE0, eol_id=EOL,
                         prefix=(BOI, RES0 + 2 * ROWS, RES0 + COLS), suffix=(EOI,))
    return UnifiedTokenModel(chameleon_backbone(chameleon, layout), layout, cfg_mode="image_start")


SOURCE_CODES = torch.tensor([[[2, 0], [1, 3]]])  # the source panel's 2 x 2 codes


@pytest.fixture(scope="module")
def panel_setup():
    model = dual_panel_model()
    source = model.layout.tokens_of_codes(SOURCE_CODES)  # [1, 6]: codes and end-of-row tokens
    panel = tuple(model.layout.model_ids(source)[0].tolist())
    _, joint = exact_joint_unified(model, PROMPT, SAMPLING, panel)
    return model, joint, unified_required_samples(joint), source


@pytest.mark.parametrize("method", PANEL_METHODS)
def test_iad_on_the_dual_panel_layout_matches_exact_joint(panel_setup, method):
    model, joint, n, source = panel_setup
    rows = source.expand(n, -1)
    condition = model.condition([PROMPT] * n, source=rows)
    out = decode(model, condition, num_tokens=model.layout.num_tokens, sampling=SAMPLING, decoding=_window(method),
                 generator=torch.Generator().manual_seed(99), grid_width=model.layout.row_length, source=rows)
    statistic, p_value, tv = unified_chi_square(out.tokens, joint, model.layout.vocab_size)
    tpf = float(out.stats.tokens_per_forward.mean())
    print(f"\ndual panel {method}: n={n} chi2={statistic:.1f} p={p_value:.4f} TV={tv:.4f} tokens/forward={tpf:.3f}")
    assert p_value > ALPHA, f"{method} deviates from the exact AR joint (p={p_value:.2e}, TV={tv:.4f})"


def test_the_panel_conditions_the_model(panel_setup):
    """The source panel reaches the model: the exact joint with it differs from the one without it."""
    model, joint, _, _ = panel_setup
    _, without = exact_joint_unified(model, PROMPT, SAMPLING)
    assert 0.5 * float((joint - without).abs().sum()) > 0.05
