"""Certified exactness of AR, SJD (every initialisation), MC-SJD (both couplings) and draft-model SD,
and of the relaxed acceptance rules at their exact settings (LANTERN with k = 0 or δ = 0, GSD with
groups of one).

Protocol (visual-ar spec §15): on a tiny random GPT (vocabulary 4, 6 tokens of a 3x3 grid, window 3,
CFG 2.0, temperature 0.9, top-k 3, top-p 0.9, fp32), enumerate the exact AR joint over all 4**6
sequences, draw ``n`` whole sequences with each decoder, and run Pearson's chi-square test of the
empirical joint against the exact one (cells with expected count < 5 pooled).

Sample size: for a true joint at total-variation distance ``δ`` from the exact one, the chi-square
divergence is at least ``4 δ²``, so the statistic is (asymptotically) non-central chi-square with
non-centrality ``λ >= 4 n δ²``. ``required_samples`` picks the smallest ``n`` (in steps of 1024) whose
power against ``δ = 0.03`` is at least 0.99 at level ``α = 1e-3``; the tests use at least that.

Negative controls: the same test must reject a decoder whose rejection step resamples from ``p``
instead of the residual ``max(0, p - q)`` (the bias of Lumina-mGPT 2.0's SJD).

SJD-PAC is also certified analytically: tests/pac_chain_reference.py propagates its state through every random
choice of a pass and must give the AR joint to rounding; with the paper's sibling drafting it gives that drafting's
exact output joint, its TV from the AR joint, and the distribution the decoder's negative control must match.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from scipy import stats

import vispec.kernels.verify as verify_module
from vispec.decoding import DecodingConfig, decode
from vispec.decoding.pac import tree_layout
from vispec.decoding.shapes import Shape
from vispec.decoding.windows import ChooserSettings, WindowStats
from vispec.kernels.verify import Drafts, accept_reference, noise_race, sample_reference
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

from chi_square import ALPHA, POWER, TV_DETECT, chi_square_vs_exact, pooled_cells, required_samples  # noqa: F401
from helpers import exact_conditionals, exact_joint, sequence_index, tiny_gpt
from pac_chain_reference import exact_sibling_law, pac_chain_joint

NUM_TOKENS = 6
WINDOW = 3
CLASS_LABEL = 1
SAMPLING = SamplingConfig(temperature=0.9, top_k=3, top_p=0.9, guidance_scale=2.0)
EXACT_METHODS = ["ar", "sjd-random", "sjd-horizontal", "sjd-vertical", "mc-sjd-maximal", "mc-sjd-gumbel", "sd"]
# relaxed rules at settings where they must reduce to the exact rule (they still run their own code path)
EXACT_RELAXED = ["sjd-horizontal+lantern:k=0", "mc-sjd-maximal+lantern:k=3,delta=0", "sjd-random+gsd:d_thr=0",
                 "sd+lantern:k=3,delta=0"]


@pytest.fixture(scope="module")
def setup():
    model = tiny_gpt()
    seqs, joint = exact_joint(model, CLASS_LABEL, NUM_TOKENS, SAMPLING)
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    return model, joint, required_samples(joint)


def drafter_model():
    """A different, smaller random GPT over the same vocabulary: a poor drafter, so rejections are common."""
    return tiny_gpt(seed=7, dim=16, n_layer=1)


CODEBOOK = torch.randn(4, 3, generator=torch.Generator().manual_seed(11))  # a random VQ codebook for LANTERN


def sample_sequences(model, method: str, n: int, seed: int) -> tuple[torch.Tensor, float]:
    """``n`` sequences in one ragged batch; window 3 so drafts are re-initialised mid-sequence.
    ``method`` is a decoder label, optionally ``+acceptance`` (e.g. ``"sd+lantern:k=3,delta=0"``)."""
    label, _, acceptance = method.partition("+")
    condition = LlamaGenCondition(class_labels=torch.full((n,), CLASS_LABEL, dtype=torch.long))
    gen = torch.Generator().manual_seed(seed)
    decoding = DecodingConfig.parse(label, window=WINDOW)
    out = decode(model, condition, num_tokens=NUM_TOKENS, sampling=SAMPLING, decoding=decoding, generator=gen, grid_width=3,
                 acceptance=acceptance or None, codebook=CODEBOOK, drafter=drafter_model() if label.startswith("sd") else None)
    return out.tokens, float(out.stats.tokens_per_forward.mean())


def test_sample_size_is_derived_and_enumeration_is_nontrivial(setup):
    model, joint, n = setup
    entropy = float(-(joint[joint > 0] * joint[joint > 0].log()).sum())
    print(f"\nexact joint: support {int((joint > 0).sum())} of {joint.numel()}, entropy {entropy:.2f} nats; required n = {n}")
    assert (joint > 0).sum() > 50  # not a near-deterministic model
    assert n >= 1024


@pytest.mark.parametrize("method", EXACT_METHODS + EXACT_RELAXED)
def test_decoder_matches_exact_joint(setup, method):
    model, joint, n = setup
    tokens, tpf = sample_sequences(model, method, n, seed=1234)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\n{method}: n={n} chi2={statistic:.1f} p={p_value:.4f} TV={tv:.4f} tokens/forward={tpf:.3f}")
    assert p_value > ALPHA, f"{method} deviates from the exact AR joint (p={p_value:.2e}, TV={tv:.4f})"


def _residual_from_target(p, q):
    """Deliberately wrong: resample from p instead of max(0, p - q)."""
    return p.clone()


# step costs that make the window chooser switch with the acceptance it sees (its choices depend on outcomes)
AUTO_COSTS = {1: [(0, 1.0)], 2: [(0, 1.5)], 4: [(0, 2.4)], 8: [(0, 4.0)], 16: [(0, 7.0)]}


# the shape chooser's costs (by cost label, vispec.decoding.shapes): nearly flat, so wide shapes pay; as the samples
# near their 6 tokens the widest useful window shrinks, and the chooser moves between trees and chains of 8, 4 and 2
# rows, which of them by the rates the committed history shows
SHAPE_COSTS = {"ar": [(0, 1.0)], "chain:2": [(0, 1.05)], "chain:4": [(0, 1.1)], "tree:4": [(0, 1.12)], "chain:8": [(0, 1.15)],
               "tree:8": [(0, 1.17)]}
# SJD-PAC's windows and shapes, forced in turn (one pass each): trees of both widths and depths, chains, AR
SHAPE_SCRIPT = (Shape(4, 3, 2), Shape(1), Shape(8, 2, 3), Shape(2), Shape(8, 3, 2), Shape(4, 2, 2), Shape(8))


def _switch_every_pass(costs: Optional[dict] = None, script: tuple = ()) -> WindowStats:
    """Fixed step costs (the returned measurements start from them; default :data:`AUTO_COSTS`), fresh acceptance
    tables and one-pass blocks: the chooser decides every pass from the acceptance it has seen so far (or, with
    ``script``, runs those shapes in turn)."""
    return WindowStats(starting_costs=costs or AUTO_COSTS,
                       settings=ChooserSettings(block=1, settle=0, maturity=10**9, margin=0.0, shape_script=script))


def sample_adaptive(model, method: str, n: int, seed: int, max_batch_size=None,
                    window_stats: Optional[WindowStats] = None) -> tuple[torch.Tensor, dict]:
    """Like :func:`sample_sequences` but with the spec's own window (``auto``) and optional streaming; returns the
    passes per window (per shape for the shape-choosing decoders)."""
    condition = LlamaGenCondition(class_labels=torch.full((n,), CLASS_LABEL, dtype=torch.long))
    out = decode(model, condition, num_tokens=NUM_TOKENS, sampling=SAMPLING, decoding=method,
                 generator=torch.Generator().manual_seed(seed), grid_width=3, max_batch_size=max_batch_size,
                 window_stats=window_stats)
    return out.tokens, out.stats.shapes or out.stats.windows


@pytest.mark.parametrize("method,max_batch_size,script", [
    ("sjd-random:window=auto", None, ()), ("mc-sjd-maximal:window=auto", None, ()), ("mc-sjd-gumbel:window=auto", 300, ()),
    ("sjd-horizontal:window=3", 257, ()), ("sjd-pac:window=auto", 600, ()), ("sjd-pac-gumbel:window=auto", 300, ()),
    ("auto", None, ()), ("auto-gumbel", 600, ()), ("auto", None, SHAPE_SCRIPT)])
def test_adaptive_windows_and_streaming_match_exact_joint(setup, method, max_batch_size, script):
    """Windows (shapes: AR, chains, trees) chosen per pass from running acceptance or forced to change every pass, and
    requests streamed through fewer slots, stay exact."""
    model, joint, n = setup
    shapes = method.startswith(("sjd-pac", "auto"))
    stats = _switch_every_pass(SHAPE_COSTS if shapes else None, script)
    tokens, windows = sample_adaptive(model, method, n, seed=4321, max_batch_size=max_batch_size, window_stats=stats)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\n{method} (slots {max_batch_size or n}{', scripted' if script else ''}): n={n} chi2={statistic:.1f} "
          f"p={p_value:.4f} TV={tv:.4f} passes={windows}")
    if "auto" in method:
        assert len(windows) > 1, "the chooser never switched windows; the test would not cover adaptive windows"
    if shapes:
        assert any(label.startswith("tree") for label in windows), "no pass ran a tree"
    if method.startswith("auto"):
        assert len(windows) >= 3 and any(label.startswith("chain") for label in windows), windows
    assert p_value > ALPHA, f"{method} deviates from the exact AR joint (p={p_value:.2e}, TV={tv:.4f})"


@pytest.mark.parametrize("method", ["sjd-horizontal", "mc-sjd-maximal", "sd", "mc-sjd-maximal:window=auto", "auto"])
def test_negative_control_fails(setup, method, monkeypatch):
    model, joint, n = setup
    monkeypatch.setattr(verify_module, "residual_weights", _residual_from_target)  # the one exact residual
    if "auto" in method:
        stats = _switch_every_pass(SHAPE_COSTS if method == "auto" else None)
        tokens, _ = sample_adaptive(model, method, n, seed=1234, window_stats=stats)
    else:
        tokens, _ = sample_sequences(model, method, n, seed=1234)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\nnegative control {method} (resample from p): n={n} chi2={statistic:.1f} p={p_value:.2e} TV={tv:.4f}")
    assert p_value < ALPHA, "the exactness test failed to detect a wrong residual"


@pytest.mark.parametrize("method", EXACT_METHODS[1:])
def test_greedy_matches_ar_token_for_token(method):
    model = tiny_gpt(vocab_size=32, block_size=64, num_classes=5, std=0.6, seed=3)
    condition = LlamaGenCondition(class_labels=torch.arange(5))
    greedy = SamplingConfig(temperature=0.0, guidance_scale=3.0)
    reference = decode(model, condition, num_tokens=64, sampling=greedy, decoding="ar")
    drafter = tiny_gpt(vocab_size=32, block_size=64, num_classes=5, std=0.6, seed=3) if method == "sd" else None  # a perfect drafter
    out = decode(model, condition, num_tokens=64, sampling=greedy, decoding=method, drafter=drafter)
    assert torch.equal(out.tokens, reference.tokens)
    assert int(out.stats.nfe.sum()) < 5 * 64, "greedy Jacobi decoding should save forward passes on this model"


@pytest.mark.parametrize("dense_q", [False, True])
def test_single_verification_acceptance_rate_is_one_minus_tv(dense_q):
    """P[accept] = Σ min(p, q) = 1 - TV(p, q), and the coupled output is distributed as p."""
    gen = torch.Generator().manual_seed(7)
    vocab, trials = 8, 200_000
    p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, 0)
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, 0)
    if not dense_q:  # a one-hot draft on a fixed token: acceptance = p(token)
        token = int(torch.argmax(q))
        q = torch.nn.functional.one_hot(torch.tensor(token), vocab).double()
    drafts = torch.multinomial(q.float(), trials, replacement=True, generator=gen)
    rows = Drafts(drafts, q[None] if dense_q else None, torch.zeros(trials, dtype=torch.long) if dense_q else None)
    p_rows = p.expand(trials, vocab)
    accepted = accept_reference(p_rows, rows, torch.rand(trials, generator=gen, dtype=torch.float64),
                                torch.ones(trials, dtype=torch.bool))
    noise = torch.empty(trials, vocab, dtype=torch.float64).exponential_(generator=gen)
    residual, _ = sample_reference(p_rows, ~accepted, None, rows, noise_race(noise, noise))
    coupled = torch.where(accepted, drafts, residual)
    assert not bool((coupled < 0).any())
    rate = float(accepted.double().mean())
    expected = 1.0 - 0.5 * float((p - q).abs().sum())
    half_width = 3.29 * (expected * (1 - expected) / trials) ** 0.5  # 99.9% binomial interval
    print(f"\nacceptance {rate:.4f} vs 1 - TV = {expected:.4f} (± {half_width:.4f})")
    assert abs(rate - expected) <= half_width
    counts = torch.bincount(coupled, minlength=vocab).double()
    p_value = stats.chisquare(counts.numpy(), (p * trials).numpy()).pvalue
    assert p_value > ALPHA, f"coupled outputs do not follow p (p={p_value:.2e})"


# ---- token edits from a step callback: the decode continues from the edited prefix, exactly -------------

EDIT_METHODS = ["ar", "sjd-horizontal", "mc-sjd-maximal", "sd"]


def _edit_prefix(joint: torch.Tensor, seqs_vocab: int) -> torch.Tensor:
    """A likely sequence whose first token is not the likeliest first token (so most samples' prefixes change)."""
    seqs = torch.tensor(list(__import__("itertools").product(range(seqs_vocab), repeat=NUM_TOKENS)))
    first_marginal = torch.zeros(seqs_vocab, dtype=joint.dtype).index_add_(0, seqs[:, 0], joint)
    other = seqs[:, 0] != int(first_marginal.argmax())
    return seqs[other][int(joint[other].argmax())]


def sample_with_edit(model, method: str, n: int, seed: int, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences whose first step callback rewrites every committed token to ``prefix``; returns the
    tokens and each sample's committed count at the edit."""
    at_edit = []

    def rewrite(progress):
        if at_edit:
            return None
        at_edit.append(progress.num_committed.clone())
        tokens = progress.tokens.clone()
        decided = tokens >= 0
        tokens[decided] = prefix.expand_as(tokens)[decided]
        return {"tokens": tokens}

    condition = LlamaGenCondition(class_labels=torch.full((n,), CLASS_LABEL, dtype=torch.long))
    out = decode(model, condition, num_tokens=NUM_TOKENS, sampling=SAMPLING, decoding=DecodingConfig.parse(method, window=WINDOW),
                 generator=torch.Generator().manual_seed(seed), grid_width=3, callback=rewrite,
                 drafter=drafter_model() if method == "sd" else None)
    return out.tokens, at_edit[0]


def chi_square_given_prefixes(tokens, committed, joint, prefix, vocab) -> tuple[float, float]:
    """Pearson's test of each sample's tail against the exact AR conditional given its edited prefix
    (``prefix[:c]``, ``c`` its committed count at the edit): groups of equal ``c`` are tested against their
    own conditional (cells with expected count < 5 pooled within the group) and the statistics summed."""
    index = sequence_index(tokens, vocab)
    all_seqs = torch.tensor(list(__import__("itertools").product(range(vocab), repeat=NUM_TOKENS)))
    statistic, dof = 0.0, 0
    for c in committed.unique().tolist():
        group = committed == c
        assert bool((tokens[group, :c] == prefix[:c]).all()), "the edited tokens were not kept"
        cond = torch.where((all_seqs[:, :c] == prefix[:c]).all(dim=1), joint, torch.zeros_like(joint))
        cond = cond / cond.sum()
        size = int(group.sum())
        counts = torch.bincount(index[group], minlength=joint.numel()).double()
        ids = pooled_cells(cond * size)
        cells = int(ids.max()) + 1
        observed = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids, counts)
        expected = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids, cond * size)
        keep = expected > 0
        statistic += float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        dof += int(keep.sum()) - 1
    return statistic, float(stats.chi2.sf(statistic, max(dof, 1)))


@pytest.mark.parametrize("method", EDIT_METHODS)
def test_callback_edits_continue_exactly_from_the_edited_prefix(setup, method):
    model, joint, n = setup
    prefix = _edit_prefix(joint, model.image_vocab_size)
    tokens, committed = sample_with_edit(model, method, n, seed=99, prefix=prefix)
    statistic, p_value = chi_square_given_prefixes(tokens, committed, joint, prefix, model.image_vocab_size)
    print(f"\n{method} with an edit to {prefix.tolist()}: committed at the edit {committed.unique().tolist()}, "
          f"chi2={statistic:.1f} p={p_value:.4f}")
    assert p_value > ALPHA, f"{method}: tokens after an edit deviate from the exact conditional (p={p_value:.2e})"


@pytest.mark.parametrize("method", ["ar", "mc-sjd-maximal"])
def test_negative_control_edit_without_rewinding_the_cache_fails(setup, method, monkeypatch):
    """The same test must reject a decoder that rewrites the tokens but keeps the cache of the old ones."""
    import vispec.decoding.ar as ar_module
    import vispec.decoding.speculative as speculative_module

    def keep_old_cache(model, state, tokens, cached, keep):
        return None

    monkeypatch.setattr(ar_module, "refeed", keep_old_cache)
    monkeypatch.setattr(speculative_module, "refeed", keep_old_cache)
    model, joint, n = setup
    prefix = _edit_prefix(joint, model.image_vocab_size)
    tokens, committed = sample_with_edit(model, method, n, seed=99, prefix=prefix)
    statistic, p_value = chi_square_given_prefixes(tokens, committed, joint, prefix, model.image_vocab_size)
    print(f"\nnegative control {method}: chi2={statistic:.1f} p={p_value:.2e}")
    assert p_value < ALPHA, "the edit test failed to detect a decoder that keeps the old prefix's cache"


# ---- SJD-PAC (tree drafts, recursive rejection sampling) ---------------------------------------------------

# trees that cover the top-k support (K = 3) and narrower ones; windows from the bare tree to a chain past it
# (window 10 with K = 2, D = 3: a main path of 6, the whole sequence)
PAC_METHODS = ["sjd-pac:window=13", "sjd-pac:window=10,tree_width=2,tree_depth=3", "sjd-pac:window=8,tree_width=2,tree_depth=2",
               "sjd-pac:window=6,tree_width=4,tree_depth=2", "sjd-pac-gumbel:window=13"]  # Gumbel: also streamed, auto


def sample_pac(model, spec: str, n: int, seed: int, max_batch_size=None) -> tuple[torch.Tensor, dict]:
    condition = LlamaGenCondition(class_labels=torch.full((n,), CLASS_LABEL, dtype=torch.long))
    out = decode(model, condition, num_tokens=NUM_TOKENS, sampling=SAMPLING, decoding=spec,
                 generator=torch.Generator().manual_seed(seed), grid_width=3, max_batch_size=max_batch_size)
    passes = out.stats.nfe - 1
    return out.tokens, {"tokens/forward": float(out.stats.tokens_per_forward.mean()),
                        "single-token passes": float(out.stats.extra["single_passes"].sum() / passes.sum())}


@pytest.mark.parametrize("method", PAC_METHODS)
def test_sjd_pac_matches_exact_joint(setup, method):
    model, joint, n = setup
    tokens, info = sample_pac(model, method, n, seed=2468, max_batch_size=n // 2 if "window=6" in method else None)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\n{method}: n={n} chi2={statistic:.1f} p={p_value:.4f} TV={tv:.4f} {info}")
    assert p_value > ALPHA, f"{method} deviates from the exact AR joint (p={p_value:.2e}, TV={tv:.4f})"


def _published_siblings(q, old_q):
    """SJD-PAC's released sampler: siblings are further samples of the residual max(0, P - q_old) of the last
    pass at their position, yet verified as draws without replacement from q = P."""
    return (q - old_q()).clamp_min(0)


def _siblings_verified_against_unconditioned_q(q, candidates, validate=True):
    """Deliberately wrong: every rank verified against q itself, not q without the earlier candidates."""
    return q.to(torch.float64)[:, None, :].expand(-1, candidates.shape[1], -1) / q.to(torch.float64).sum(-1)[:, None, None]


# the PAC_METHODS configurations as (window, tree_width K, tree_depth D)
PAC_TREES = [(13, 3, 3), (10, 2, 3), (8, 2, 2), (6, 4, 2)]


def pac_chain(model, window: int, branching: int, levels: int, init: str = "horizontal",
              sibling_law=exact_sibling_law) -> torch.Tensor:
    """:func:`pac_chain_reference.pac_chain_joint` on the test model as a ``[V ** N]`` tensor in enumeration order."""
    vocab = model.image_vocab_size
    seqs, probs = exact_conditionals(model, CLASS_LABEL, NUM_TOKENS, SAMPLING)
    table = probs.tolist()
    strides = [vocab ** (NUM_TOKENS - 1 - i) for i in range(NUM_TOKENS)]

    def cond(context: tuple) -> list:
        return table[sum(t * s for t, s in zip(context, strides))][len(context)]

    final = pac_chain_joint(cond, NUM_TOKENS, vocab, branching, levels, tree_layout(window, branching, levels).main,
                            init, sibling_law, track_old=sibling_law is not exact_sibling_law)
    joint = torch.zeros(vocab ** NUM_TOKENS, dtype=torch.float64)
    joint[sequence_index(torch.tensor(list(final.keys())), vocab)] = torch.tensor(list(final.values()), dtype=torch.float64)
    return joint


def published_sibling_law(q: list, old) -> list:
    """:func:`_published_siblings` on the chain's plain lists."""
    return [max(0.0, a - b) for a, b in zip(q, old())]


@pytest.mark.parametrize("window,branching,levels", PAC_TREES)
@pytest.mark.parametrize("init", ["horizontal", "random"])
def test_exact_chain_of_sjd_pac_equals_the_ar_joint(setup, window, branching, levels, init):
    """SJD-PAC is exact analytically: its state propagated through every random choice of every pass (tree,
    recursive rejection sampling, the maximal coupling's next drafts) gives the AR joint to rounding."""
    model, joint, _ = setup
    chain = pac_chain(model, window, branching, levels, init)
    tv = 0.5 * float((chain - joint).abs().sum())
    print(f"\nexact chain of sjd-pac (window {window}, K {branching}, D {levels}, init {init}): TV from the AR joint {tv:.2e}")
    assert abs(float(chain.sum()) - 1.0) < 1e-9 and tv < 1e-9


@pytest.mark.parametrize("window,branching,levels", PAC_TREES)
def test_published_sibling_law_has_a_measured_bias(setup, window, branching, levels):
    """The paper's sibling drafting: the exact TV of the whole decoder's output from the AR joint (chain)."""
    model, joint, _ = setup
    chain = pac_chain(model, window, branching, levels, sibling_law=published_sibling_law)
    tv = 0.5 * float((chain - joint).abs().sum())
    print(f"\nsjd-pac with the published sibling law (window {window}, K {branching}, D {levels}): exact TV of its "
          f"output joint from the AR joint {tv:.4f}")
    assert abs(float(chain.sum()) - 1.0) < 1e-9 and tv > 1e-3


@pytest.mark.parametrize("control", ["published-siblings", "unconditioned-q"])
def test_sjd_pac_negative_controls_fail(setup, control, monkeypatch):
    """The same test rejects the paper's sibling drafting and a verification that ignores the draws
    without replacement: it can see what the tree changes. The paper's drafting runs on the certificate's ``n``
    with K 2, D 3 (window 10: its exact TV, 0.025, is below the test's design TV) and must match the chain's exact
    joint of that drafting; the unconditioned verification on a quarter of it, which only makes rejecting harder."""
    import vispec.decoding.pac as pac_module
    import vispec.kernels.multi_verify as multi_verify_module

    model, joint, n = setup
    if control == "published-siblings":
        monkeypatch.setattr(pac_module, "sibling_law", _published_siblings)
    else:
        monkeypatch.setattr(multi_verify_module, "without_replacement", _siblings_verified_against_unconditioned_q)
        n = max(1024, n // 4 // 1024 * 1024)
    spec = "sjd-pac:window=10,tree_width=2,tree_depth=3" if control == "published-siblings" else "sjd-pac:window=13"
    tokens, info = sample_pac(model, spec, n, seed=2468)
    statistic, p_value, tv = chi_square_vs_exact(tokens, joint, model.image_vocab_size)
    print(f"\nnegative control {control}: n={n} chi2={statistic:.1f} p={p_value:.2e} TV={tv:.4f} {info}")
    assert p_value < ALPHA, f"the exactness test failed to detect {control}"
    if control == "published-siblings":
        chain = pac_chain(model, 10, 2, 3, sibling_law=published_sibling_law)
        statistic, p_chain, tv_chain = chi_square_vs_exact(tokens, chain, model.image_vocab_size)
        print(f"  exact TV of its output joint (chain) {0.5 * float((chain - joint).abs().sum()):.4f}; "
              f"vs the chain's joint: chi2={statistic:.1f} p={p_chain:.4f} TV={tv_chain:.4f}")
        assert p_chain > ALPHA, "the decoder's published-siblings control does not produce the chain's joint"
