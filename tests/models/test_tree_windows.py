"""Token-tree windows of the model protocol (``forward_window(..., parents=)``, ``rollback(..., path=)``) on
both model families: every slot's logits equal a chain forward of its root-to-slot path, each sample with
its own tree, with and without guidance, and a kept path continues exactly as if it had been run as a chain."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_gpt
from unified_helpers import tiny_chameleon, tiny_layout, unified_condition

from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.models.unified import UnifiedTokenModel
from vispec.models.unified_families import chameleon_backbone
from vispec.protocol import tree_ancestors, tree_depths, window_visibility

# three samples, three trees of 7 slots (-1: follows the cached prefix); slot order is topological
PARENTS = torch.tensor([
    [-1, 0, 0, 1, 1, 2, 5],     # a root, two children, grandchildren, one great-grandchild
    [-1, 0, 1, 2, 3, 4, 5],     # a chain
    [-1, -1, 0, 1, 0, 2, 3],    # two roots (siblings at depth 0)
])
PREFIX_KEEP = torch.tensor([2, 1, 0])  # a ragged prefix window kept before the tree


def _llamagen():
    model = tiny_gpt(vocab_size=8, block_size=16, num_classes=3, class_dropout_prob=0.1).double()
    return model, LlamaGenCondition(class_labels=torch.tensor([0, 1, 2])), 8


def _unified():
    layout = tiny_layout()
    model = UnifiedTokenModel(chameleon_backbone(tiny_chameleon().double(), layout), layout, cfg_mode="image_start")
    return model, unified_condition(model), model.image_vocab_size - 1  # the last id is the end-of-row token


FAMILIES = {"llamagen": _llamagen, "unified": _unified}


def _path(parents: torch.Tensor, slot: int) -> list[int]:
    out = [slot]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out[::-1]


def _chain_logits(model, condition, guidance, sample, prefix, tokens):
    """Sample ``sample`` alone: its prefix window kept, then ``tokens`` as a chain; all logits of the chain."""
    state, _ = model.prefill(condition.select(torch.tensor([sample])), guidance=guidance, max_new_tokens=12, window=8)
    if prefix.numel():
        model.forward_window(state, prefix[None])
        model.rollback(state, torch.tensor([prefix.numel()]))
    return model.forward_window(state, torch.tensor([tokens]))


def _prefilled(model, condition, guidance, prefix_tokens, validate=True):
    state, _ = model.prefill(condition, guidance=guidance, max_new_tokens=12, window=8, validate=validate)
    model.forward_window(state, prefix_tokens)
    model.rollback(state, PREFIX_KEEP)
    return state


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return FAMILIES[request.param]()


def test_ancestors_depths_and_visibility():
    anc = tree_ancestors(PARENTS)
    assert torch.equal(tree_depths(anc)[0], torch.tensor([0, 1, 1, 2, 2, 2, 3]))
    assert torch.equal(tree_depths(anc)[2], torch.tensor([0, 0, 1, 1, 1, 2, 2]))
    assert torch.equal(anc[1], torch.ones(7, 7, dtype=torch.bool).tril())  # a chain is causal attention
    assert anc[0, 6].nonzero().flatten().tolist() == [0, 2, 5, 6]
    visible = window_visibility(torch.tensor([3, 0, 5]), anc, 14)
    assert visible[0, 6].nonzero().flatten().tolist() == [0, 1, 2, 3, 5, 8, 9]  # prefix 0-2, then slots 0, 2, 5, 6
    chain = window_visibility(torch.tensor([3]), anc[1:2], 14)
    assert torch.equal(chain[0], torch.arange(14)[None] <= (3 + torch.arange(7))[:, None])


@pytest.mark.parametrize("guidance", [False, True])
@pytest.mark.parametrize("validate", [True, False])
def test_tree_logits_equal_the_chain_of_each_path(family, guidance, validate):
    model, condition, vocab = family
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (3, 2), generator=g)
    tokens = torch.randint(vocab, (3, 7), generator=g)
    state = _prefilled(model, condition, guidance, prefix, validate)
    tree = model.forward_window(state, tokens, parents=PARENTS)
    for b in range(3):
        for slot in range(7):
            path = _path(PARENTS[b], slot)
            ref = _chain_logits(model, condition, guidance, b, prefix[b, : PREFIX_KEEP[b]], tokens[b, path].tolist())
            torch.testing.assert_close(tree.cond[b, slot], ref.cond[0, -1], rtol=0, atol=1e-9)
            if guidance:
                torch.testing.assert_close(tree.uncond[b, slot], ref.uncond[0, -1], rtol=0, atol=1e-9)


@pytest.mark.parametrize("guidance", [False, True])
def test_a_kept_path_continues_like_a_chain(family, guidance):
    model, condition, vocab = family
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(vocab, (3, 2), generator=g)
    tokens = torch.randint(vocab, (3, 7), generator=g)
    following = torch.randint(vocab, (3, 2), generator=g)
    state = _prefilled(model, condition, guidance, prefix)
    model.forward_window(state, tokens, parents=PARENTS)
    ends = [6, 4, 5]  # each sample keeps the path to its own node
    paths = [_path(PARENTS[b], ends[b]) for b in range(3)]
    path = torch.zeros(3, 7, dtype=torch.long)
    for b, p in enumerate(paths):
        path[b, : len(p)] = torch.tensor(p)
    model.rollback(state, torch.tensor([len(p) for p in paths]), path=path)
    got = model.forward_window(state, following)
    for b in range(3):
        kept = tokens[b, paths[b]].tolist()
        ref = _chain_logits(model, condition, guidance, b, prefix[b, : PREFIX_KEEP[b]], kept + following[b].tolist())
        torch.testing.assert_close(got.cond[b], ref.cond[0, -2:], rtol=0, atol=1e-9)
        if guidance:
            torch.testing.assert_close(got.uncond[b], ref.uncond[0, -2:], rtol=0, atol=1e-9)


def test_bad_trees_and_paths_are_named(family):
    model, condition, vocab = family
    state = _prefilled(model, condition, False, torch.zeros(3, 2, dtype=torch.long))
    tokens = torch.zeros(3, 7, dtype=torch.long)
    with pytest.raises(ValueError, match="parents must be a long tensor of shape \\[3, 7\\]"):
        model.forward_window(state, tokens, parents=PARENTS[:, :6])
    with pytest.raises(ValueError, match="parents\\[b, j\\] must lie in \\[-1, j - 1\\]"):
        model.forward_window(state, tokens, parents=torch.tensor([[0, 0, 0, 1, 1, 2, 5]] * 3))
    model.forward_window(state, tokens, parents=PARENTS)
    with pytest.raises(ValueError, match="path must hold window slots in \\[0, 6\\]"):
        model.rollback(state, torch.tensor([1, 1, 1]), path=torch.full((3, 7), 7))
    with pytest.raises(ValueError, match="path must be a long tensor of shape \\[3, 7\\]"):
        model.rollback(state, torch.tensor([1, 1, 1]), path=torch.zeros(3, 7))


@pytest.mark.slow
def test_tree_windows_compile_with_fullgraph():
    """A non-validating state: the tree window and the path rollback read nothing back, so they compile whole
    (``fullgraph=True`` raises on a graph break). Logits are float32, whose last bits the compiled kernels'
    reordered sums may change."""
    model, condition, vocab = _llamagen()
    g = torch.Generator().manual_seed(2)
    prefix, tokens = torch.randint(vocab, (3, 2), generator=g), torch.randint(vocab, (3, 7), generator=g)
    path = torch.tensor([[0, 2, 5, 6, 0, 0, 0], [0, 1, 2, 0, 0, 0, 0], [1, 3, 6, 0, 0, 0, 0]])
    keep = torch.tensor([4, 3, 3])

    def step(state, tokens, parents, path, keep):
        logits = model.forward_window(state, tokens, parents=parents)
        model.rollback(state, keep, path=path)
        return logits.cond, model.forward_window(state, tokens[:, :1]).cond

    eager_state = _prefilled(model, condition, True, prefix, validate=False)
    compiled_state = _prefilled(model, condition, True, prefix, validate=False)
    want = step(eager_state, tokens, PARENTS, path, keep)
    got = torch.compile(step, fullgraph=True, dynamic=False)(compiled_state, tokens, PARENTS, path, keep)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
