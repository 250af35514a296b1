"""SJD-PAC (vispec/decoding/pac.py): its spec, its window layout, and how it relates to the chain decoders.
The joint-distribution certificates are in tests/exactness/."""

from __future__ import annotations

import pytest
import torch
from helpers import TREE_LABELS, TREE_SAMPLING, tiny_gpt, tree_decode, tree_gpt

from vispec.decoding import DecodingConfig
from vispec.decoding.pac import tree_layout
from vispec.decoding.shapes import candidate_shapes
from vispec.decoding.windows import ChooserSettings, WindowStats

SAMPLING, LABELS, _run = TREE_SAMPLING, TREE_LABELS, tree_decode


@pytest.fixture(scope="module")
def model():
    return tree_gpt()


def test_spec_defaults_names_and_errors():
    config = DecodingConfig.parse("sjd-pac")
    assert (config.window, config.tree_width, config.tree_depth, config.coupling) == (64, 3, 3, "maximal")
    assert config.name == "sjd-pac" and config.tree_size == 13
    wide = DecodingConfig.parse("sjd-pac:window=32,tree_width=4,tree_depth=2")
    assert wide.name == "sjd-pac:window=32,tree_width=4,tree_depth=2" and DecodingConfig.parse(wide.name) == wide
    assert DecodingConfig.parse("mc-sjd", base=wide).window == 16  # another strategy drops the tree and its window
    gumbel = DecodingConfig.parse("sjd-pac-gumbel:tree_width=4")
    assert (gumbel.coupling, gumbel.tree_width) == ("gumbel", 4) and gumbel.name == "sjd-pac-gumbel:tree_width=4"
    assert DecodingConfig.parse("sjd-pac:coupling=gumbel") == DecodingConfig.parse("sjd-pac-gumbel")
    assert DecodingConfig.parse(gumbel.name) == gumbel
    for spec, words in [("sjd-pac:window=12", "must hold its tree of 13 slots"), ("sjd:tree_width=2", "apply to sjd-pac"),
                        ("sjd-pac+lantern:k=3", "exact rule only"), ("sjd-pac:tree_depth=0", "tree_depth must be"),
                        ("sjd-pac:window=auto,tree_width=8", "the largest window 'auto' picks is 64"),
                        ("sjd-pac:coupling=none", "coupling for strategy")]:
        with pytest.raises(ValueError, match=words):
            DecodingConfig.parse(spec)


def test_smaller_windows_drop_the_deepest_levels():
    """window="auto" runs windows 1, 2, 4, ...: each holds the deepest tree that fits (K = 3: 1, 4, 13 slots)."""
    shapes = {s.rows: (s.levels if s.is_tree else 1, s.main) for s in candidate_shapes(64, 3, 3, every_tree=False)}
    assert shapes == {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 6), 16: (3, 6), 32: (3, 22), 64: (3, 54)}
    for shape in candidate_shapes(64, 3, 3, every_tree=False):  # the decoder's layout agrees with the shape
        layout = tree_layout(shape.rows, shape.branching, shape.levels)
        assert (layout.main, layout.width) == (shape.main, shape.rows)
    assert DecodingConfig.parse("sjd-pac:window=auto").largest_window == 64


@pytest.mark.parametrize("spec", ["sjd-pac:window=auto", "sjd-pac-gumbel:window=auto"])
def test_auto_windows_switch_layouts_and_keep_the_batch_independence(model, spec):
    """Chosen per pass: with one-pass blocks and costs that favour no window, the chooser moves between layouts
    (chains, shallow and full trees); the passes of every window add up, and the histogram accounts for them."""
    costs = {"ar": [(0, 1.0)], "chain:2": [(0, 1.2)], "tree:4": [(0, 1.4)], "tree:8": [(0, 1.6)], "tree:16": [(0, 1.8)]}
    stats = WindowStats(starting_costs=costs, settings=ChooserSettings(block=1, margin=0.0))
    out = _run(model, spec, labels=LABELS * 2, seeds=range(10), window_stats=stats)
    assert len(out.stats.windows) > 1 and sum(out.stats.windows.values()) == int(out.stats.nfe.max()) - 1
    assert out.stats.commits.sum(1).tolist() == (out.stats.nfe - 1).tolist()
    assert out.method == spec and bool((out.tokens >= 0).all())


def test_layout_main_path_first_then_the_tree_breadth_first():
    tree = tree_layout(16, 3, 3)
    assert tree.main == 6 and tree.width == 16
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4, 0, 0, 1, 1, 6, 6, 6, 7, 7, 7]
    assert tree.depth.tolist() == [0, 1, 2, 3, 4, 5, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert tree.rank.tolist() == [0, 0, 0, 0, 0, 0, 1, 2, 1, 2, 0, 1, 2, 0, 1, 2]
    assert tree.internal.tolist() == [0, 1, 6, 7]  # the nodes with K children: depth <= D - 2
    assert tree.side_leaf.nonzero().flatten().tolist() == list(range(8, 16))
    assert tree_layout(64, 3, 3).main == 54  # the paper's L = 64: 53 drafts on the main path
    assert tree_layout(5, 1, 3).main == 5 and tree_layout(5, 4, 1).main == 5  # K = 1 or D = 1: a chain
    with pytest.raises(ValueError, match="cannot hold the tree of 13 slots"):
        tree_layout(12, 3, 3)


@pytest.mark.parametrize("coupling", ["maximal", "gumbel"])
@pytest.mark.parametrize("chain", ["tree_depth=1", "tree_width=1"])
def test_a_tree_without_branches_is_mc_sjd(model, chain, coupling):
    """With K = 1 or D = 1 the window is a chain and SJD-PAC is MC-SJD with the same coupling, on the same noise:
    the same tokens and passes (the tree code runs for K = 1: recursive rejection with one candidate)."""
    chain_run = _run(model, f"sjd-pac-{coupling}:window=6,{chain}")
    mc = _run(model, f"mc-sjd-{coupling}:window=6")
    assert torch.equal(chain_run.tokens, mc.tokens) and torch.equal(chain_run.stats.nfe, mc.stats.nfe)


@pytest.mark.parametrize("spec", ["sjd-pac:window=16", "sjd-pac-gumbel:window=16"])
def test_outputs_do_not_depend_on_the_batch_or_the_slots(model, spec):
    """Per-sample keyed noise: a sample alone, in a batch, or streamed through fewer slots gives the same tokens."""
    batch = _run(model, spec)
    streamed = _run(model, spec, max_batch_size=2)
    alone = _run(model, spec, labels=[LABELS[3]], seeds=[3])
    assert torch.equal(batch.tokens, streamed.tokens) and torch.equal(batch.stats.nfe, streamed.stats.nfe)
    assert torch.equal(alone.tokens[0], batch.tokens[3])
    assert batch.method == spec and batch.stats.windows == {16: int(batch.stats.nfe.max()) - 1}
    passes = batch.stats.nfe - 1
    single = batch.stats.extra["single_passes"]
    assert bool((single <= passes).all()) and bool((batch.stats.accepted_drafts + passes == 16 - 1).all())


def test_trees_commit_more_tokens_per_pass_than_the_chain(model):
    """On the same main-path length, the side branches can only add accepted tokens: fewer passes overall."""
    chain = _run(model, "sjd-pac:window=6,tree_width=1", labels=LABELS * 4, seeds=range(20))
    tree = _run(model, "sjd-pac:window=16", labels=LABELS * 4, seeds=range(20))  # main path 6 as well
    assert tree_layout(16, 3, 3).main == 6
    assert int(tree.stats.nfe.sum()) < int(chain.stats.nfe.sum())


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["sjd-pac:window=16", "sjd-pac-gumbel:window=16"])
def test_compiled_step_is_fullgraph_and_matches_eager(spec):
    """float64 weights: the compiled graph's rounding cannot flip a sampled token, so tokens are equal."""
    model = tiny_gpt(vocab_size=8, block_size=16, num_classes=3, class_dropout_prob=0.1).double()
    eager = _run(model, spec, labels=[0, 1, 2])
    compiled = _run(model, spec, labels=[0, 1, 2], compile=True)  # fullgraph=True: a break raises
    assert torch.equal(eager.tokens, compiled.tokens) and torch.equal(eager.stats.nfe, compiled.stats.nfe)


@pytest.mark.parametrize("spec", ["ar", "sjd", "mc-sjd:window=8", "sjd-pac:window=16", "sjd-pac-gumbel:window=16"])
def test_commit_histogram_accounts_for_every_pass_and_token(model, spec):
    """``stats.commits[b, k]``: sample b's passes that committed k tokens; the passes sum to nfe - 1 (the
    prefill is not a pass), the tokens to N - 1 (token 0 comes from the prefill), column 1 is single_passes."""
    out = _run(model, spec)
    commits = out.stats.commits
    k = torch.arange(commits.shape[1])
    assert commits[:, 0].eq(0).all()
    assert commits.sum(1).tolist() == (out.stats.nfe - 1).tolist()
    assert (commits * k).sum(1).tolist() == [15] * len(LABELS)
    if spec != "ar":
        assert commits[:, 1].tolist() == out.stats.extra["single_passes"].tolist()
