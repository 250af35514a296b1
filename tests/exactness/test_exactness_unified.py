"""Certified exactness on a unified-token model (forced end-of-row tokens, CFG from image start), and
Lumina-mGPT 2.0's SJD rule (``acceptance="lumina"``) as a negative control with its measured bias.

Protocol (visual-ar spec §15, as tests/exactness/test_exactness.py): a tiny random transformers Chameleon wrapped as
a :class:`~vispec.models.unified.UnifiedTokenModel` with a 2 x 2 image of a 4-code codebook, an end-of-row
token after each row (6 decoded tokens, decoder vocabulary V = 5), one text prompt, CFG 2.0 from image
start, temperature 0.9, top-k 3, top-p 0.9, fp32. :func:`exact_joint_unified` enumerates the exact AR joint
over all ``V ** 6`` sequences by full forwards of the transformers model (no cache), with the end-of-row
token forced at every row end and masked elsewhere. Each decoder draws ``n`` whole sequences (window 3, so
windows straddle row ends; Pearson's chi-square against the exact joint, cells with expected count < 5
pooled). ``n`` comes from test_exactness.py's power calculation (power 0.99 against TV 0.03 at level 1e-3);
here most of the ``V ** 6`` sequences have probability 0 (forced end-of-row tokens, top-k, top-p): they are
not cells (test_exactness.py pools them into a cell of expectation 0), and drawing one fails the test outright.

Lumina-mGPT 2.0's rule must be rejected. Its bias is measured three ways: the empirical TV of the decoded
sequences, the TV of one verification's output in closed form (first draft of each pass, averaged exactly
over the decode), and the exact TV of the whole decoder's output: :func:`sjd_chain_joint` propagates SJD's state (committed
tokens, drafts and the contexts their ``q`` came from) through every random choice of a pass, giving the
exact joint of SJD under any acceptance rule. For the exact rule it equals the AR joint (to rounding); for
Lumina's rule the decoded samples must match it. ``VISPEC_LUMINA_TV_SAMPLES=<n>`` sets the sample count of
the bias measurement (default: the power calculation's ``n``), e.g. for samples/lumina-sjd-bias.txt.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import defaultdict
from typing import Callable, Optional

import pytest
import torch
from scipy import stats

from vispec.decoding import DecodingConfig, decode
from vispec.decoding.acceptance import AcceptanceConfig, LuminaRule
from vispec.decoding.rules import build_rule
from vispec.models.unified import ImageLayout, UnifiedTokenModel
from vispec.models.unified_families import chameleon_backbone
from vispec.sampling import SamplingConfig, warp_logits

from helpers import sequence_index
from unified_helpers import BOI, CODE0, EOI, EOL, RES0, tiny_chameleon

ALPHA = 1e-3
POWER = 0.99
TV_DETECT = 0.03
ROWS, COLS, NUM_CODES = 2, 2, 4
HEAD_SCALE = 0.3  # tiny_chameleon's LM head (std 0.5) times this: flat enough that top-k and top-p both bite
PROMPT = [4, 9, 17, 30]
WINDOW = 3
SAMPLING = SamplingConfig(temperature=0.9, top_k=3, top_p=0.9, guidance_scale=2.0)
CHUNK = 32768  # sequences per decode call
EXACT_METHODS = ["ar", "sjd-random", "sjd-horizontal", "sjd-vertical", "mc-sjd-maximal", "mc-sjd-gumbel", "sd"]
# relaxed rules at settings where they must reduce to the exact rule (they still run their own code path)
EXACT_RELAXED = ["sjd-horizontal+lantern:k=0", "mc-sjd-maximal+lantern:k=3,delta=0", "sjd-random+gsd:d_thr=0",
                 "sd+lantern:k=3,delta=0"]
LUMINA = "sjd-random+lumina"  # Lumina-mGPT 2.0's SJD: random initialisation (generate.py) and its rule
CODEBOOK = torch.randn(NUM_CODES + 1, 3, generator=torch.Generator().manual_seed(11))  # for LANTERN


def small_layout() -> ImageLayout:
    return ImageLayout(rows=ROWS, cols=COLS, num_codes=NUM_CODES, code_offset=CODE0, eol_id=EOL,
                       prefix=(BOI, RES0 + ROWS, RES0 + COLS), suffix=(EOI,))


def small_unified(seed: int = 0, layers: int = 2) -> UnifiedTokenModel:
    chameleon = tiny_chameleon(seed, layers)
    with torch.no_grad():
        chameleon.lm_head.weight.mul_(HEAD_SCALE)
    layout = small_layout()
    return UnifiedTokenModel(chameleon_backbone(chameleon, layout), layout, cfg_mode="image_start")


def drafter_model() -> UnifiedTokenModel:
    """A different, smaller random model over the same layout: a poor drafter, so rejections are common."""
    return small_unified(seed=7, layers=1)


# ---- the exact AR distribution by full forwards ---------------------------------------------------------------

@torch.no_grad()
def conditional_table(model: UnifiedTokenModel, prompt: list[int], sampling: SamplingConfig,
                      panel: tuple[int, ...] = ()) -> torch.Tensor:
    """``[V ** (N-1), N, V]`` float64: row ``c`` (the ``c``-th context of length ``N - 1`` in row-major order),
    position ``t``: the processed target of token ``t`` given the context's first ``t`` tokens.

    Full forwards of the transformers model over whole sequences (conditional: prompt, image prefix, ``panel``
    (an image-to-image request's source panel, model ids), tokens; unconditional: image prefix, ``panel``,
    tokens), the layout's rows of the LM head, CFG on raw logits, then the
    end-of-row token forced at every row's last position and masked elsewhere, then temperature, top-k,
    top-p and softmax."""
    layout = model.layout
    vocab, num = layout.vocab_size, layout.num_tokens
    contexts = torch.tensor(list(itertools.product(range(vocab), repeat=num - 1)), dtype=torch.long)
    ids = layout.model_ids(torch.arange(vocab))
    chameleon = model.model

    def logits(head: list[int]) -> torch.Tensor:
        seqs = torch.cat([torch.tensor(head).expand(contexts.shape[0], -1), layout.model_ids(contexts)], dim=1)
        hidden = chameleon.model(input_ids=seqs).last_hidden_state[:, len(head) - 1:]
        return chameleon.lm_head(hidden)[..., ids].double()  # [C, N, V]: position t predicts token t

    cond = logits(list(prompt) + list(layout.prefix) + list(panel))
    uncond = logits(list(layout.prefix) + list(panel))
    guided = uncond + sampling.guidance_scale * (cond - uncond)
    forced = torch.arange(num) % layout.row_length == layout.row_length - 1
    eol = torch.arange(vocab) == layout.num_codes
    guided = guided.masked_fill(~forced[:, None] & eol, float("-inf"))  # end of row masked inside rows
    guided = torch.where(forced[:, None], torch.where(eol, 0.0, float("-inf")).double(), guided)  # forced at row ends
    return warp_logits(guided, sampling).softmax(dim=-1)


def exact_joint_unified(model: UnifiedTokenModel, prompt: list[int], sampling: SamplingConfig,
                        panel: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """All ``V ** N`` decoded sequences and their exact AR probabilities (float64), by enumeration (``panel``: a
    source panel after the image prefix, :func:`conditional_table`)."""
    layout = model.layout
    vocab, num = layout.vocab_size, layout.num_tokens
    table = conditional_table(model, prompt, sampling, panel)
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=num)), dtype=torch.long)
    rows = sequence_index(seqs[:, :-1], vocab)
    joint = table[rows].gather(-1, seqs[..., None]).squeeze(-1).prod(dim=1)
    return seqs, joint


# ---- Pearson's test against an exact joint ----------------------------------------------------------------------

def cell_ids(expected: torch.Tensor, min_expected: float = 5.0) -> torch.Tensor:
    """Cell per sequence: its own if its expected count is >= min_expected, one pooled cell for the other
    possible sequences, -1 for impossible ones (probability 0)."""
    big = expected >= min_expected
    ids = torch.full_like(expected, -1, dtype=torch.long)
    ids[big] = torch.arange(int(big.sum()))
    ids[(expected > 0) & ~big] = int(big.sum())
    return ids


def required_samples(joint: torch.Tensor, tv: float = TV_DETECT, alpha: float = ALPHA, power: float = POWER) -> int:
    """tests/exactness/test_exactness.py's power calculation: the smallest ``n`` (a multiple of 1024) whose
    non-central chi-square power (non-centrality ``4 n tv²``) is at least ``power`` at level ``alpha``."""
    n = 1024
    while True:
        df = int(cell_ids(joint * n).max())  # cells - 1
        critical = stats.chi2.ppf(1 - alpha, df)
        if stats.ncx2.sf(critical, df, 4 * n * tv * tv) >= power:
            return n
        n += 1024


def chi_square_vs_exact(tokens: torch.Tensor, joint: torch.Tensor, vocab: int) -> tuple[float, float, float]:
    """(statistic, p-value, empirical TV) of sampled sequences against the exact joint; a sequence of
    probability 0 gives an infinite statistic and p = 0."""
    n = tokens.shape[0]
    counts = torch.bincount(sequence_index(tokens, vocab), minlength=joint.numel()).double()
    tv = 0.5 * float((counts / n - joint).abs().sum())
    ids = cell_ids(joint * n)
    if float(counts[ids < 0].sum()) > 0:
        return math.inf, 0.0, tv
    cells = int(ids.max()) + 1
    observed = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids[ids >= 0], counts[ids >= 0])
    expected = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids[ids >= 0], joint[ids >= 0] * n)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return statistic, float(stats.chi2.sf(statistic, cells - 1)), tv


# ---- sampling ---------------------------------------------------------------------------------------------------

def sample_sequences(model: UnifiedTokenModel, method: str, n: int, seed: int) -> tuple[torch.Tensor, dict]:
    """``n`` sequences of ``method`` (a decoder label, optionally ``+acceptance``), window 3, in chunks of
    :data:`CHUNK`; returns the tokens and means of tokens/forward and (lossy rules) the measured TV."""
    label, _, acceptance = method.partition("+")
    decoding = DecodingConfig.parse(label) if label.startswith("sjd-pac") else DecodingConfig.parse(label, window=WINDOW)
    drafter = drafter_model() if label.startswith("sd") else None
    tokens, tpf, tv = [], [], []
    for i, lo in enumerate(range(0, n, CHUNK)):
        size = min(CHUNK, n - lo)
        out = decode(model, model.condition([PROMPT] * size), num_tokens=model.layout.num_tokens, sampling=SAMPLING,
                     decoding=decoding, generator=torch.Generator().manual_seed(seed + i), grid_width=model.layout.row_length,
                     acceptance=acceptance or None, codebook=CODEBOOK, drafter=drafter)
        tokens.append(out.tokens)
        tpf.append(out.stats.tokens_per_forward.double())
        if out.stats.tv_mean is not None:
            tv.append(out.stats.tv_mean.double())
    info = {"tokens_per_forward": float(torch.cat(tpf).mean())}
    if tv:
        info["verification_tv"] = float(torch.cat(tv).nanmean())
    return torch.cat(tokens), info


@pytest.fixture(scope="module")
def setup():
    model = small_unified()
    seqs, joint = exact_joint_unified(model, PROMPT, SAMPLING)
    return model, joint, required_samples(joint)


def test_exact_joint_respects_the_layout_and_is_nontrivial(setup):
    model, joint, n = setup
    layout = model.layout
    seqs = torch.tensor(list(itertools.product(range(layout.vocab_size), repeat=layout.num_tokens)))
    support = joint > 0
    eol_at_row_ends = (seqs[:, layout.row_length - 1 :: layout.row_length] == layout.num_codes).all(dim=1)
    eol_elsewhere = (layout.codes(seqs) == layout.num_codes).any(dim=(1, 2))
    entropy = float(-(joint[support] * joint[support].log()).sum())
    print(f"\nexact joint: support {int(support.sum())} of {joint.numel()}, entropy {entropy:.2f} nats; required n = {n}")
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    assert bool(eol_at_row_ends[support].all()) and not bool(eol_elsewhere[support].any())
    assert int(support.sum()) > 50  # top-k 3 of 4 codes: at most 3 ** 4 = 81
    assert n >= 1024


# SJD-PAC's trees (their own windows): branches at a forced row end hold only the forced token
PAC_METHODS = ["sjd-pac:window=13", "sjd-pac:window=8,tree_width=2,tree_depth=2", "sjd-pac-gumbel:window=13"]


@pytest.mark.parametrize("method", EXACT_METHODS + EXACT_RELAXED + PAC_METHODS)
def test_decoder_matches_exact_joint(setup, method):
    model, joint, n = setup
    tokens, info = sample_sequences(model, method, n, seed=1234)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.layout.vocab_size)
    print(f"\n{method}: n={n} chi2={statistic:.1f} p={p_value:.4f} TV={tv:.4f} tokens/forward={info['tokens_per_forward']:.3f}")
    assert p_value > ALPHA, f"{method} deviates from the exact AR joint (p={p_value:.2e}, TV={tv:.4f})"


# ---- Lumina-mGPT 2.0's rule ----------------------------------------------------------------------------------------

def lumina_samples_count(n: int) -> int:
    return int(os.environ.get("VISPEC_LUMINA_TV_SAMPLES", n))


@pytest.fixture(scope="module")
def lumina_run(setup):
    """Sequences of Lumina-mGPT 2.0's SJD (random initialisation, its rule): ``VISPEC_LUMINA_TV_SAMPLES`` of them
    (default: the power calculation's ``n``)."""
    model, _, n = setup
    count = lumina_samples_count(n)
    return (count,) + sample_sequences(model, LUMINA, count, seed=2024)


@pytest.mark.parametrize("method", [LUMINA, "sjd-horizontal+lumina"])
def test_negative_control_lumina_rule_fails(setup, lumina_run, method):
    """The same test rejects SJD with Lumina-mGPT 2.0's verification (resampling from p on rejection)."""
    model, joint, n = setup
    if method == LUMINA:
        n, tokens, info = lumina_run
    else:
        tokens, info = sample_sequences(model, method, n, seed=1234)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.layout.vocab_size)
    init = method.partition("+")[0].removeprefix("sjd-")
    exact_tv = 0.5 * float((chain_joint(model, lumina_accept, lumina_reject(SAMPLING), init) - joint).abs().sum())
    print(f"\nnegative control {method}: n={n} chi2={statistic:.1f} p={p_value:.2e} TV={tv:.4f} "
          f"(exact TV of its output joint: {exact_tv:.4f}) tokens/forward={info['tokens_per_forward']:.3f}")
    assert p_value < ALPHA, f"the exactness test failed to detect Lumina-mGPT 2.0's rule ({method})"


Dist = list  # a distribution over the decoder vocabulary, as a list of floats


def sjd_chain_joint(cond: Callable[[tuple], Dist], num_tokens: int, vocab: int, window: int, init: str,
                    accept: Callable[[Dist, Dist, int], float], reject: Callable[[Dist, Dist, int], Dist],
                    on_first_draft: Optional[Callable[[float, Dist, Dist], None]] = None) -> dict:
    """The exact output distribution ``{sequence: probability}`` of SJD (coupling none) under an acceptance rule.

    ``cond(context)``: the processed target of the token after ``context`` (a tuple); ``accept(p, q, x)``: the
    probability that draft ``x`` with draft distribution ``q`` is kept against ``p``; ``reject(p, q, x)``: the
    distribution a rejected position samples from. A state is (committed tokens, drafts); a draft is
    (token, context of its ``q``), context None for an initialised (one-hot) draft. One pass with ``n``
    committed tokens: window ``W = min(window, N - n)``; the first ``W - 1`` drafts are kept and the missing
    ones initialised (``random``: uniform over the vocabulary; ``horizontal``: the last known token);
    ``P_j = cond(committed + d_1..d_j)``; drafts are verified left to right; on the first rejection (draft
    ``d_{m+1}``) ``d_1..d_m`` and a sample of ``reject(P_m, q_{m+1}, d_{m+1})`` are committed and rows
    ``j > m`` give the next drafts, ``y_j ~ P_j`` with ``q = P_j``; if every draft is kept, they and a bonus
    token from ``P_{W-1}`` are committed. Token 0 comes from ``cond(())``. ``on_first_draft(probability, p, q)``
    is called for every pass's first verification with its target and the draft's stored ``q`` (one-hot for an
    initialised draft), weighted by the probability of reaching it."""

    def support(dist: Dist):
        return [(v, w) for v, w in enumerate(dist) if w > 0]

    states: dict = defaultdict(float)
    for x, w in support(cond(())):
        states[((x,), ())] += w
    final: dict = defaultdict(float)
    while states:
        following: dict = defaultdict(float)
        for (committed, drafts), mass in states.items():
            n = len(committed)
            if n == num_tokens:
                final[committed] += mass
                continue
            width = min(window, num_tokens - n)
            drafts = drafts[: width - 1]
            missing = width - 1 - len(drafts)
            if init == "random":
                inits = [(combo, vocab ** -missing) for combo in itertools.product(range(vocab), repeat=missing)]
            else:
                last = drafts[-1][0] if drafts else committed[-1]
                inits = [((last,) * missing, 1.0)]
            for new, weight in inits:
                window_drafts = drafts + tuple((t, None) for t in new)
                tokens = tuple(t for t, _ in window_drafts)
                targets = [cond(committed + tokens[:j]) for j in range(width)]
                if on_first_draft is not None and width > 1:
                    x, context = window_drafts[0]
                    on_first_draft(mass * weight, targets[0], [float(v == x) for v in range(vocab)] if context is None
                                   else cond(context))
                kept = mass * weight  # probability of reaching this draft with all before it kept
                for j in range(1, width):  # draft d_j = tokens[j - 1] against P_{j-1}
                    x, context = window_drafts[j - 1]
                    q = [float(v == x) for v in range(vocab)] if context is None else cond(context)
                    a = accept(targets[j - 1], q, x)
                    if a < 1:
                        head = committed + tokens[: j - 1]
                        tails = itertools.product(*[support(targets[i]) for i in range(j, width)])
                        tails = [(tuple(y for y, _ in tail), math.prod(w for _, w in tail)) for tail in tails]
                        for r, w_r in support(reject(targets[j - 1], q, x)):
                            for ys, w_y in tails:
                                next_drafts = tuple((y, committed + tokens[:i]) for y, i in zip(ys, range(j, width)))
                                following[(head + (r,), next_drafts)] += kept * (1 - a) * w_r * w_y
                    kept *= a
                    if kept == 0:
                        break
                if kept > 0:
                    for y, w in support(targets[width - 1]):
                        following[(committed + tokens + (y,), ())] += kept * w
        states = following
    return final


def exact_accept(p: Dist, q: Dist, x: int) -> float:
    return min(1.0, p[x] / q[x])


def exact_reject(p: Dist, q: Dist, x: int) -> Dist:
    residual = [max(0.0, a - b) for a, b in zip(p, q)]
    total = sum(residual)
    return [r / total for r in residual]


def lumina_accept(p: Dist, q: Dist, x: int) -> float:
    """sjds.py ``get_acc_criterion_mask``: ``(p(x) / q(x).clamp(min=1e-7)).clamp(max=1)``."""
    return min(1.0, p[x] / max(q[x], 1e-7))


def lumina_reject(sampling: Optional[SamplingConfig]) -> Callable[[Dist, Dist, int], Dist]:
    """sjds.py ``get_reject_sampling_logits`` then ``reject_sampling_single_token`` (the logits processor again:
    here temperature, top-k, top-p; None: not re-applied)."""

    def reject(p: Dist, q: Dist, x: int) -> Dist:
        delta = [max(0.0, a - min(b, 0.99)) for a, b in zip(p, q)]
        total = sum(delta)
        weights = [d / max(total, 1e-10) for d in delta] if total + 1e-7 > 1.0 else list(p)
        if sampling is not None:
            weights = warp_logits(torch.tensor(weights, dtype=torch.float64).log(), sampling).softmax(-1).tolist()
        return weights

    return reject


def lumina_verification_tv(sampling: Optional[SamplingConfig]) -> Callable[[Dist, Dist], float]:
    """TV from ``p`` of one verification's output under Lumina's rule, the draft drawn from ``q``:
    ``P(y) = q(y) a(y) + (Σ_x q(x) (1 - a(x))) R(y)`` (``R`` does not depend on the rejected draft)."""
    reject = lumina_reject(sampling)

    def tv(p: Dist, q: Dist) -> float:
        kept = [qy * lumina_accept(p, q, y) for y, qy in enumerate(q)]
        rejected = sum(q) - sum(kept)
        residual = reject(p, q, 0)
        return 0.5 * sum(abs(k + rejected * r - py) for k, r, py in zip(kept, residual, p))

    return tv


def chain_joint(model: UnifiedTokenModel, accept, reject, init: str = "random", on_first_draft=None) -> torch.Tensor:
    """:func:`sjd_chain_joint` on the test model as a ``[V ** N]`` tensor in enumeration order."""
    layout = model.layout
    vocab, num = layout.vocab_size, layout.num_tokens
    table = conditional_table(model, PROMPT, SAMPLING).tolist()
    strides = [vocab ** (num - 2 - i) for i in range(num - 1)]

    def cond(context: tuple) -> Dist:
        return table[sum(t * s for t, s in zip(context, strides))][len(context)]

    final = sjd_chain_joint(cond, num, vocab, WINDOW, init, accept, reject, on_first_draft)
    joint = torch.zeros(vocab ** num, dtype=torch.float64)
    seqs = torch.tensor(list(final.keys()), dtype=torch.long)
    joint[sequence_index(seqs, vocab)] = torch.tensor(list(final.values()), dtype=torch.float64)
    return joint


def test_exact_chain_of_sjd_equals_the_ar_joint(setup):
    """The chain computation is right (and SJD exact, analytically): with the exact rule it gives the AR joint."""
    model, joint, _ = setup
    for init in ("random", "horizontal"):
        chain = chain_joint(model, exact_accept, exact_reject, init)
        tv = 0.5 * float((chain - joint).abs().sum())
        print(f"\nexact chain of sjd-{init} with the exact rule: TV from the AR joint {tv:.2e}")
        assert abs(float(chain.sum()) - 1.0) < 1e-9 and tv < 1e-9


def test_lumina_rule_bias_is_measured_and_matches_the_exact_chain(setup, lumina_run):
    """Lumina-mGPT 2.0's SJD: exact output joint by the chain computation, its TV from the AR joint, and the
    decoded samples: consistent with the chain's joint, not with the AR joint."""
    model, joint, n = setup
    vocab = model.layout.vocab_size
    tv_of = lumina_verification_tv(SAMPLING)
    first = [0.0, 0.0]  # probability-weighted sum of first-draft TVs, total probability of passes with a draft

    def record(probability: float, p: Dist, q: Dist) -> None:
        first[0] += probability * tv_of(p, q)
        first[1] += probability

    lumina = chain_joint(model, lumina_accept, lumina_reject(SAMPLING), "random", record)
    no_rewarp = chain_joint(model, lumina_accept, lumina_reject(None), "random")
    exact_tv = 0.5 * float((lumina - joint).abs().sum())
    count, tokens, info = lumina_run
    stat_ar, p_ar, tv_ar = chi_square_vs_exact(tokens, joint, vocab)
    stat_chain, p_chain, tv_chain = chi_square_vs_exact(tokens, lumina, vocab)
    print(f"\n{LUMINA} (window {WINDOW}) on the unified model: n={count}"
          f"\n  vs exact AR joint: chi2={stat_ar:.1f} p={p_ar:.2e} empirical TV={tv_ar:.4f}"
          f"\n  exact TV of the decoder's output joint from the AR joint (chain): {exact_tv:.4f}"
          f" (without re-warping the rejected position: {0.5 * float((no_rewarp - joint).abs().sum()):.4f})"
          f"\n  vs the chain's exact Lumina joint: chi2={stat_chain:.1f} p={p_chain:.4f} empirical TV={tv_chain:.4f}"
          f"\n  per-verification TV, first draft of each pass (closed form): exact mean over the chain "
          f"{first[0] / first[1]:.4f}, {first[1]:.3f} such passes per sequence; "
          f"the decoder's TVTracker (every verified row, first or not) {info['verification_tv']:.4f}"
          f"\n  tokens/forward={info['tokens_per_forward']:.3f}")
    assert abs(float(lumina.sum()) - 1.0) < 1e-9
    assert exact_tv > TV_DETECT, "Lumina's rule should be biased beyond the test's design TV on this model"
    assert p_ar < ALPHA
    assert p_chain > ALPHA, "vispec's Lumina rule does not produce the output distribution of Lumina's algorithm"


def test_lumina_rule_definition_and_wiring():
    """The rule's acceptance, rejection weights and closed-form output TV against the formulas of sjds.py and a
    Monte Carlo run of one verification; ``decode`` takes it as a ``+lumina`` spec or an ``acceptance`` argument."""
    gen = torch.Generator().manual_seed(3)
    vocab = 6
    p = torch.softmax(torch.randn(4, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    dense = torch.softmax(torch.randn(2, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 4]), vocab).double()
    q = torch.cat([dense, one_hot])
    rule = build_rule("lumina")
    assert isinstance(rule, LuminaRule) and not rule.lossless
    assert AcceptanceConfig.parse("lumina:reprocess=0").name == "lumina:reprocess=0"
    assert DecodingConfig.parse("sjd+lumina").method == "sjd-horizontal+lumina"
    model = small_unified()  # the spec form and the acceptance argument decode the same, and report the TV
    runs = [decode(model, model.condition([PROMPT] * 16), num_tokens=model.layout.num_tokens, sampling=SAMPLING,
                   decoding=spec, acceptance=acceptance, generator=torch.Generator().manual_seed(5))
            for spec, acceptance in (("sjd-random:window=3+lumina", None),
                                     (DecodingConfig.parse("sjd-random", window=3), "lumina"))]
    assert torch.equal(runs[0].tokens, runs[1].tokens) and runs[0].method == runs[1].method == "sjd-random:window=3+lumina"
    assert runs[0].stats.tv_mean is not None and float(runs[0].stats.tv_mean.nan_to_num().max()) > 0
    with pytest.raises(ValueError, match="speculative decoder"):
        decode(model, model.condition([PROMPT]), num_tokens=6, sampling=SAMPLING, decoding="ar", acceptance="lumina")
    with pytest.raises(ValueError, match="'lumina:q_clamp=1.5': q_clamp must"):
        AcceptanceConfig.parse("lumina:q_clamp=1.5")
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    for rows_sampling in (None, sampling):
        reference = [lumina_reject(rows_sampling)(p[r].tolist(), q[r].tolist(), 0) for r in range(4)]
        assert torch.allclose(rule.rejection_distribution(p, q, rows_sampling), torch.tensor(reference, dtype=torch.float64))
    # one-hot drafts: the rejected draft is resampled from p, itself included
    assert torch.allclose(rule.residual_weights(p[2:], None, one_hot), p[2:])
    trials = 200_000
    for r in range(4):
        drafts = torch.multinomial(q[r].float(), trials, replacement=True, generator=gen)
        P, Q = p[r].expand(trials, vocab), q[r].expand(trials, vocab)
        kept = rule.accept(P, drafts, Q, torch.rand(trials, generator=gen, dtype=torch.float64))
        assert abs(float(kept.double().mean()) - float(torch.minimum(p[r], q[r]).sum())) < 0.005
        weights = rule.rejection_distribution(P[~kept], Q[~kept], sampling)
        out = drafts.clone()
        out[~kept] = torch.multinomial(weights, 1, generator=gen).squeeze(1)
        empirical = torch.bincount(out, minlength=vocab).double() / trials
        tv_sim = 0.5 * float((empirical - p[r]).abs().sum())
        assert abs(tv_sim - float(rule.output_tv(p[r : r + 1], q[r : r + 1], sampling))) < 0.01
    assert torch.allclose(rule.output_tv(p[2:], one_hot), p[2:].gather(-1, torch.tensor([[1], [4]])).squeeze(-1)
                          * (1 - p[2:].gather(-1, torch.tensor([[1], [4]])).squeeze(-1)))
