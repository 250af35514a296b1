r"""SJD-PAC, exact: speculative Jacobi decoding with a token tree at each rejection and the tail kept after it.

SJD-PAC (Kang et al., CVPR 2026, arXiv 2603.18599) observes that about half of SJD's passes commit a single
token: a rejection invalidates every later draft. It adds two things to SJD:

* **adaptive continuation**: every draft of the window is verified, not only those before the first
  rejection; a slot's output (its draft if accepted, else a residual sample) is distributed as this pass's
  ``P_j`` and stays the draft of its position for the next pass. This is MC-SJD's maximal coupling
  (So et al., arXiv 2510.24211; :data:`vispec.decoding.speculative.MAXIMAL`), which the main chain below runs;
* **proactive drafting**: the window is a token tree. Below the pending token (the root, depth 0), each node
  of the first ``D - 1`` levels has ``K`` children (``tree_width`` K, ``tree_depth`` D; the paper's code
  defaults to 3 and 3), and the main path (rank-0 child at every level) continues as a chain to the window's
  ``L`` slots: ``1 + K + ... + K^(D-1)`` tree slots, ``M = L - (tree slots - D)`` main-path slots. The
  candidates at depth ``d`` are the same ``K`` tokens under every parent: rank 0 is the main draft of that
  position, ranks ``1 .. K-1`` are drawn without replacement from that draft's ``q`` (the ``P`` row it was
  drawn from), excluding it. No extra forward: they come from distributions the last pass computed.

Composed with MC-SJD's Gumbel coupling (``"sjd-pac-gumbel"``, :data:`PAC_GUMBEL`): the main path's next drafts are
Gumbel-max samples of this pass's ``P`` rows with noise fixed per absolute position (the GUMBEL stream, draw 0)
instead of coupled outputs; the tree and its verification are unchanged. What verification needs of a main
draft is MC-SJD's Gumbel argument (the draft is distributed as the ``P`` row it was computed from, and the
position's fixed noise decides nothing committed before the pass that commits the position); the composition
is certified by the same enumeration tests as the maximal variant.

One pass (every sample at once, each with its own tree, cache length and noise; :func:`pac_step`):

1. fill the main path's missing drafts (:mod:`vispec.decoding.drafts`, one-hot ``q``); lay out the tree;
2. one forward with the tree mask (``forward_window(..., parents=)``; position ``prefix + depth``);
3. the main path is verified as MC-SJD maximal verifies a chain (:func:`~vispec.decoding.speculative.verify_window`):
   its acceptances decide the chain below the tree, its coupled outputs are the next drafts;
4. every tree node above the leaves verifies its ``K`` children by recursive rejection sampling
   (:func:`vispec.kernels.multi_verify.rrs`, a PyTorch reference and a Triton kernel: candidate ``i`` accepted with probability
   ``min(1, r̄(x_i) / q_i(x_i))``, ``r ← max(0, r̄ - q_i)`` on a rejection, ``q_i = q`` without the earlier
   candidates, renormalised); the first accepted candidate is the node's child on the path;
5. the path: the root, then each node's accepted child (a slot is on it iff it and all its ancestors were
   accepted by their parents; :func:`vispec.protocol.tree_ancestors`); it ends at depth ``e``. Committed:
   its ``e`` tokens and one more: the residual sample of the node where it ends (after all its candidates),
   or a fresh sample of ``P`` at a leaf (the bonus token; at the main path's last row, the chain's bonus:
   keyed by the pass under the maximal coupling, the position's fixed noise under Gumbel's);
6. the cache keeps the path (``rollback(keep=e + 1, path=)``); the main path's coupled outputs (Gumbel: its
   fixed-noise samples) after depth ``e`` become the next drafts with ``q := P``, and the next tree's siblings
   are drawn from those ``q``.

Exactness. Each node's verification is the recursion whose output is distributed as the target given the
path above it, provided every candidate is distributed as its ``q_i`` given everything verification has
seen (:mod:`vispec.kernels.multi_verify`, proof there). Rank 0 is a coupled output: given the window it was
computed from, it is distributed as the ``P`` row recorded as its ``q`` (the MC-SJD argument; that window is
not part of the new path's history, and its noise is not reused); ranks ``1 ..`` are a Gumbel-top-k draw
from ``q`` without rank 0 with their own noise stream (``SIBLING``), so the candidate tuple is a draw
without replacement from ``q``. Verification noise is keyed by the verified position (rank ``k``: word ``k``
of the ACCEPT stream), shared by same-depth nodes of which at most one is on the path, and no committed
decision reuses noise another committed decision used. tests/exactness/test_exactness.py checks the joint
distribution against enumeration.

What differs from the paper's released sampler (``scheduler/sjd_pac_iteration_lumina_mgpt.py``): its
siblings are samples of the residual ``max(0, P - q_old)`` of the last pass at their position, verified as draws
without replacement from ``P``; among siblings it commits the longest accepted path, not the first accepted
candidate; with every main draft accepted its next root comes from its uniform padding distribution instead of
``P``; one generator for the batch (batch 1 only) and global RNG for drafts. The sibling drafting alone makes it
inexact: it is a negative control in tests/exactness/test_exactness.py (``sibling_law``), whose exact output
joint tests/pac_chain_reference.py computes (TV 0.011 from the AR joint on the tiny test GPT with K 3, D 3,
window 13; 0.025 with K 2, D 3, window 10). The other two are not modelled. Here every sample has its own keyed
noise, so outputs do not depend on the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from vispec.decoding.acceptance import AcceptanceRule
from vispec.decoding.ar import decode_ar, time_ar_passes
from vispec.decoding.common import DecodeJob, condition_size, resolve_grid_width, start_decoding
from vispec.decoding.compiled import announce_compile, compiled, compiled_before
from vispec.decoding.config import AUTO_WINDOW, DecodingConfig
from vispec.decoding.drafts import init_draft_tokens, source_rows
from vispec.decoding.speculative import MAXIMAL, Coupling, RaggedBatch, verify_window
from vispec.decoding.shapes import Shape, ShapeChooser, calibration_shapes, candidate_shapes, load_shape_rates
from vispec.decoding.sjd import SJDStep, single_token_step, sjd_step
from vispec.decoding.windows import WindowStats, cost_key, load_step_costs
from vispec.kernels import race
from vispec.kernels.multi_verify import rrs
from vispec.kernels.philox import Stream
from vispec.kernels.target import Target
from vispec.kernels.verify import SampleRequest
from vispec.outputs import DecodeOutput
from vispec.protocol import SpeculativeARModel, tree_ancestors


@dataclass(frozen=True)
class TreeLayout:
    """The slots of an SJD-PAC window (module docstring), the same for every sample and pass.

    Slots ``0 .. main - 1`` are the main path (slot ``s`` at depth ``s``); the other tree slots follow in
    breadth-first order, so a parent always precedes its children."""

    branching: int  # K
    levels: int  # D: tree levels, the root included
    main: int  # M: slots on the main path
    parents: Tensor  # [L] parent slot, -1 for the root
    depth: Tensor  # [L]
    rank: Tensor  # [L] rank among its siblings (0: the main candidate)
    ancestors: Tensor  # [L, L] bool, tree_ancestors(parents)
    internal: Tensor  # [I] tree slots with K children (depth <= D - 2)
    internal_index: Tensor  # [L] a slot's index in ``internal``, -1 if it has no K children
    parent_internal: Tensor  # [L] index in ``internal`` of the slot's parent, -1 for the root and the chain
    side_leaf: Tensor  # [L] bool: depth D - 1, off the main path

    @property
    def width(self) -> int:
        return int(self.parents.shape[0])

    def to(self, device: Union[str, torch.device]) -> "TreeLayout":
        """The layout with its tensors on ``device`` (moved once per decode, not every pass)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})


@functools.lru_cache(maxsize=None)
def tree_layout(window: int, branching: int, levels: int) -> TreeLayout:
    """The window layout of ``window`` slots with ``branching`` K and ``levels`` D (module docstring)."""
    paths = [()]  # a node is its ranks from the root: the main path is all zeros
    for depth in range(1, levels):
        paths += [p + (r,) for p in paths if len(p) == depth - 1 for r in range(branching)]
    main_tree = [p for p in paths if not any(p)]
    side = [p for p in paths if any(p)]
    main = window - len(side)
    if main < levels:
        raise ValueError(f"a window of {window} slots cannot hold the tree of {len(paths)} slots "
                         f"(tree_width {branching}, tree_depth {levels})")
    order = sorted(main_tree, key=len) + [(0,) * d for d in range(levels, main)] + side  # chain slots as zero paths
    slot_of = {p: i for i, p in enumerate(order)}
    parents = [-1] + [slot_of[p[:-1]] for p in order[1:]]
    depth = [len(p) for p in order]
    rank = [p[-1] if p else 0 for p in order]
    internal = [slot_of[p] for p in paths if len(p) <= levels - 2]
    internal_index = {s: i for i, s in enumerate(internal)}
    parent_internal = [internal_index.get(q, -1) if d <= levels - 1 else -1 for q, d in zip(parents, depth)]
    slot_internal = [internal_index.get(slot, -1) for slot in range(len(order))]
    parents_t = torch.tensor(parents, dtype=torch.long)
    return TreeLayout(branching, levels, main, parents_t, torch.tensor(depth), torch.tensor(rank),
                      tree_ancestors(parents_t), torch.tensor(internal, dtype=torch.long),
                      torch.tensor(slot_internal, dtype=torch.long),
                      torch.tensor(parent_internal, dtype=torch.long),
                      torch.tensor([d == levels - 1 and any(p) for p, d in zip(order, depth)]))


#: the main path under MC-SJD's Gumbel coupling: next drafts by Gumbel-max with noise fixed per position (the
#: GUMBEL stream, draw 0); every rejected row still gets its residual sample, since the path may end at any
#: main row the chain rejected (its residual is the committed token there). Every row samples ``P``, not only
#: those after the chain's first rejection: the tree's float64 test decides the path, and where it rejects a
#: draft the chain's test (in the logits' dtype) kept, the rows after the path still need their next drafts.
PAC_GUMBEL = Coupling(every_rejection=True, fresh="every", fixed_noise=True)
PAC_COUPLINGS = {"maximal": MAXIMAL, "gumbel": PAC_GUMBEL}


@dataclass(frozen=True)
class PACStep:
    """What a step needs besides the batch: fixed for a whole decode."""

    model: Any
    job: DecodeJob
    rule: AcceptanceRule
    tree: TreeLayout  # this pass's window
    levels: int  # the decode's D (siblings are kept for every level of the largest tree)
    branching: int  # the decode's K (siblings are drawn for the widest tree; a narrower one uses the first ones)
    coupling: Coupling  # the main path's: MAXIMAL (the paper's continuation) or PAC_GUMBEL
    init: str
    grid_width: int
    vocab: int


def _candidates(step: PACStep, batch: RaggedBatch, main_tokens: Tensor, main_width: Tensor) -> tuple[Tensor, Tensor]:
    """``(tokens, valid)`` ``[B, D, K]``: the candidates at each depth (rank 0: the main draft; ranks ``1 ..``:
    the siblings drawn last pass, valid where that draft has a dense ``q``). Depth 0 is unused."""
    tree = step.tree
    levels, branching = tree.levels, tree.branching
    depth = torch.arange(levels, device=main_tokens.device)
    main = main_tokens[:, :levels]  # the main draft of depth d
    side = batch.state["side_ids"][:, : levels - 1, : branching - 1] - 1  # [B, D-1, K-1], -1: none
    none = torch.full((side.shape[0], 1, side.shape[2]), -1, dtype=side.dtype, device=side.device)
    side = torch.cat([none, side], dim=1)  # depth 0 (the root) has no siblings
    tokens = torch.cat([main[:, :, None], side], dim=2)
    reachable = depth[None, :] < main_width[:, None]  # the position exists in this sample's window
    dense = (depth[None, :] - 1) < batch.state["draft_count"][:, None]
    valid = reachable[:, :, None] & torch.cat([torch.ones_like(tokens[:, :, :1], dtype=torch.bool),
                                              (side >= 0) & dense[:, :, None]], dim=2)
    return torch.where(valid, tokens, -1), valid


def sibling_law(q: Tensor, old_q: Callable[[], Tensor]) -> Tensor:
    """The weights siblings are drawn from (without the main draft, without replacement): the main draft's own
    ``q``, which is what verification assumes. (``old_q()``: the law the position's previous draft came from,
    computed only if asked for; the paper's sampler draws from the residual ``max(0, q - old_q)`` instead, a
    negative control in the tests.)"""
    return q


def _draw_siblings(step: PACStep, batch: RaggedBatch, q: Tensor, main_tokens: Tensor, count: Tensor) -> Tensor:
    """``[B, D-1, K-1]`` next pass's siblings (token + 1; 0: none): for depth ``d``, a Gumbel-top-(K-1) draw
    from ``q[:, d-1]`` without the main draft ``main_tokens[:, d-1]``, keyed by (position, SIBLING, pass)."""
    batch_size, vocab = q.shape[0], q.shape[-1]
    levels = max(step.levels - 1, 1)
    siblings = max(step.branching - 1, 1)
    if step.levels == 1 or step.branching == 1:
        return torch.zeros(batch_size, levels, siblings, dtype=torch.long, device=q.device)
    depth = torch.arange(1, step.levels, device=q.device)
    weights = q[:, : step.levels - 1].to(torch.float64)  # [B, D-1, V]
    first = main_tokens[:, : step.levels - 1]
    weights = weights.scatter(-1, first[..., None], 0.0)
    positions = (batch.n - 1)[:, None] + depth[None, :]  # the new root is at n - 1
    rows = batch_size * (step.levels - 1)
    seeds = batch.seeds[:, None].expand(-1, step.levels - 1).reshape(rows)
    draws = batch.nfe[:, None].expand(-1, step.levels - 1).reshape(rows)
    noise = race.exponentials_for(seeds, positions.reshape(rows), torch.full_like(seeds, int(Stream.SIBLING)), draws, vocab)
    keys = weights.reshape(rows, vocab) / noise.to(torch.float64)
    top, index = keys.topk(step.branching - 1, dim=-1)  # decreasing: a sequential draw without replacement
    valid = (top > 0).view(batch_size, step.levels - 1, -1) & ((depth - 1)[None, :] < count[:, None])[..., None]
    return torch.where(valid, index.view(batch_size, step.levels - 1, -1) + 1, 0)


def pac_step(step: PACStep, batch: RaggedBatch, longest: Optional[int]) -> Tensor:
    """One pass over every slot (steps 1-6 of the module docstring); returns the pass's status."""
    job, model, tree = step.job, step.model, step.tree
    n, live, nfe = batch.n, batch.live, batch.nfe
    draft_count, draft_q = batch.state["draft_count"], batch.state["draft_q"]
    device, width, main = n.device, tree.width, tree.main
    depth, rank = tree.depth, tree.rank
    slot = torch.arange(width, device=device)
    main_width = torch.where(live, (job.num_tokens - n).clamp(max=main), 1)  # main rows, the root included

    # 1. fill the main path's missing drafts; lay the candidates out in the tree
    main_slot = slot[:main]
    main_positions = n[:, None] - 1 + main_slot
    known = n + draft_count
    need_init = (main_slot[None, :] >= 1) & (main_slot[None, :] < main_width[:, None]) & (main_positions >= known[:, None])
    init = init_draft_tokens(step.init, batch.tokens, main_positions, known, step.grid_width, step.vocab, batch.seeds, nfe,
                             source_rows(job.source, batch.ids))
    batch.tokens.scatter_(1, main_positions, torch.where(need_init, init, batch.tokens.gather(1, main_positions)))
    main_tokens = batch.tokens.gather(1, main_positions)  # [B, M]
    candidates, valid = _candidates(step, batch, main_tokens, main_width)  # [B, D, K]
    depth_k = depth.clamp(max=tree.levels - 1) * tree.branching + rank  # a tree slot's (depth, rank) cell
    on_main = slot < main
    tokens = torch.where(on_main, torch.cat([main_tokens, main_tokens[:, :1].expand(-1, width - main)], 1),
                         candidates.flatten(1).gather(1, depth_k.expand(n.shape[0], -1)))
    slot_valid = torch.where(on_main, depth[None, :] < main_width[:, None], valid.flatten(1).gather(1, depth_k.expand(n.shape[0], -1)))
    slot_valid = slot_valid & (live[:, None] | (slot == 0))

    # 2. one forward over the tree; row j gives P for position n + depth(j)
    parents = tree.parents.expand(n.shape[0], -1)
    out = model.forward_window(batch.cache(), tokens.clamp_min(0), longest, parents=parents)
    batch_size, _, vocab = out.cond.shape
    owner = torch.arange(batch_size, device=device)[:, None].expand(-1, width)
    row_sample = torch.where(slot_valid, owner, -1).reshape(-1)
    positions = (n[:, None] + depth[None, :]).reshape(-1)
    flat = lambda x: None if x is None else x.reshape(batch_size * width, vocab)  # noqa: E731
    target = Target(flat(out.cond), flat(out.uncond), positions, row_sample, batch.seeds, job.sampling, job.processors,
                    backend=job.backend, validate=False)

    # 3. the main path as a chain (MC-SJD maximal): chain acceptances, coupled outputs for the next drafts
    drafts = torch.cat([tokens[:, 1:main], torch.full_like(tokens[:, :width - main + 1], -1)], dim=1)
    drafts = torch.where(slot[None, :] < (main_width - 1)[:, None], drafts, -1)
    verified = verify_window(target, step.rule, drafts, main_width - 1, main_width, nfe, step.coupling, q=draft_q,
                             q_dense=slot[None, :] < draft_count[:, None])

    # 4. recursive rejection sampling at every node with K children
    probs = target.probabilities().view(batch_size, width, vocab)
    internal = tree.internal
    inner = internal.shape[0]
    if inner:
        child_depth = depth[internal] + 1
        cand = candidates[:, child_depth]  # [B, I, K]
        dense = (child_depth[None, :] - 1) < draft_count[:, None]
        q_main = draft_q[:, (child_depth - 1).clamp(max=draft_q.shape[1] - 1)].to(torch.float64)
        one_hot = torch.nn.functional.one_hot(cand[..., 0].clamp_min(0), vocab).to(torch.float64)
        q_base = torch.where(dense[..., None], q_main, one_hot).reshape(-1, vocab)
        rows = batch_size * inner
        verified_at = (n[:, None] + depth[internal][None, :]).reshape(rows)
        p_rows = probs[:, internal].reshape(rows, vocab)
        p_rows = torch.where(p_rows.sum(-1, keepdim=True) > 0, p_rows, 1.0)  # rows of absent nodes: any mass
        accepted_rank, rrs_token = rrs(p_rows, q_base, cand.reshape(rows, -1), batch.seeds[:, None].expand(-1, inner).reshape(rows),
                                       verified_at, nfe[:, None].expand(-1, inner).reshape(rows), backend=job.backend,
                                       validate=False)
        accepted_rank, rrs_token = accepted_rank.view(batch_size, inner), rrs_token.view(batch_size, inner)
    else:
        accepted_rank = rrs_token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)

    # 5. the path: each slot accepted by its parent, and all its ancestors too
    parent_internal = tree.parent_internal
    by_tree = accepted_rank.gather(1, parent_internal.clamp_min(0).expand(batch_size, -1)) == rank
    by_chain = verified.accepted.gather(1, (slot - 1).clamp_min(0).expand(batch_size, -1))
    chosen = torch.where(parent_internal >= 0, by_tree, by_chain) | (slot == 0)
    chosen = chosen & slot_valid
    on_path = ~((~chosen)[:, None, :] & tree.ancestors[None]).any(-1)
    e = torch.where(on_path, depth, 0).amax(-1)  # [B] the path's depth
    end = (on_path & (depth[None, :] == e[:, None])).long().argmax(-1)  # [B] the slot it ends at
    path = torch.zeros(batch_size, width + 1, dtype=torch.long, device=device)
    path.scatter_(1, torch.where(on_path, depth, width), slot.expand(batch_size, -1))
    path = path[:, :width]  # path[b, d]: its slot at depth d (d <= e)

    # the committed token after the path: a residual of the node it ends at, or a bonus sample at a leaf
    side_leaf = tree.side_leaf[None, :] & slot_valid
    leaf_fresh = target.sample(SampleRequest(fresh=side_leaf.reshape(-1), fresh_draws=nfe[:, None].expand(-1, width).reshape(-1)))[1]
    leaf_fresh = leaf_fresh.view(batch_size, width)
    end_internal = tree.internal_index[end]  # [B] index of the end node among the internal ones, -1 if none
    main_next = torch.where(end < main_width - 1, verified.coupled.gather(1, end[:, None])[:, 0],
                            verified.fresh.gather(1, end[:, None])[:, 0])
    # the last main row has no candidates below it: its bonus is the chain's (as MC-SJD samples it)
    end_internal = torch.where(end == main_width - 1, -1, end_internal)
    next_token = torch.where(end_internal >= 0, rrs_token.gather(1, end_internal.clamp_min(0)[:, None])[:, 0],
                             torch.where(side_leaf.gather(1, end[:, None])[:, 0], leaf_fresh.gather(1, end[:, None])[:, 0],
                                         main_next))

    # commit the path's tokens and the next one
    at = (n - 1)[:, None] + slot
    write = (slot[None, :] >= 1) & (slot[None, :] <= e[:, None]) & live[:, None]
    batch.tokens.scatter_(1, at, torch.where(write, tokens.gather(1, path), batch.tokens.gather(1, at)))
    n_before = n
    batch.commit(e, next_token)
    batch.state["single_passes"] = batch.state["single_passes"] + (live & (e == 0)).long()

    # 6. keep the path's keys and values; the main path's outputs after e are the next drafts, q := P
    model.rollback(batch.cache(), torch.where(live, e + 1, 0), path=path)
    coupled_tail = slot[None, :] < (main_width - 1)[:, None]
    if step.coupling.fixed_noise:  # Gumbel: every row after the path samples P with its position's fixed noise
        coupled_tail = torch.zeros_like(coupled_tail)
    next_tokens = torch.where(coupled_tail, verified.coupled, verified.fresh)
    at = n_before[:, None] + slot
    write = (slot[None, :] > e[:, None]) & (slot[None, :] < main_width[:, None])
    batch.tokens.scatter_(1, at, torch.where(write, next_tokens, batch.tokens.gather(1, at)))
    count = (main_width - 1 - e).clamp_min(0)
    q_rows = (e[:, None] + 1 + torch.arange(draft_q.shape[1], device=device)).clamp(max=main - 1)
    next_q = probs[:, :main].gather(1, q_rows[..., None].expand(-1, -1, vocab)).to(draft_q.dtype)
    first_drafts = batch.tokens.gather(1, (batch.n[:, None] + torch.arange(max(step.levels - 1, 1), device=device)))

    def old_q() -> Tensor:
        """For sibling_law's controls: the law of the draft this pass verified at each next draft's position
        (slot ``s = e + 1 + i`` holds position ``n + s``, drafted at slot ``s + 1``): its dense ``q`` or one-hot
        on an initialised draft; zeros where this pass had no draft there (the chain's bonus row)."""
        rows = e[:, None] + 1 + torch.arange(draft_q.shape[1], device=device)
        had_draft = (rows + 1 < main_width[:, None])[..., None]
        dense = draft_q.gather(1, rows.clamp(max=draft_q.shape[1] - 1)[..., None].expand(-1, -1, vocab))
        one_hot = torch.nn.functional.one_hot(main_tokens.gather(1, (rows + 1).clamp(max=main - 1)), vocab).to(draft_q.dtype)
        law = torch.where((rows < draft_count[:, None])[..., None], dense, one_hot)
        return torch.where(had_draft, law, torch.zeros_like(law))

    batch.state["side_ids"] = _draw_siblings(step, batch, sibling_law(next_q, old_q), first_drafts, count)
    batch.state["draft_count"], batch.state["draft_q"] = count, next_q
    if "path_rank" in batch.state:  # for the shape chooser: the rank accepted on the committed path at each tree depth
        at_depth = torch.arange(1, batch.state["path_rank"].shape[1] + 1, device=device)
        ranks = rank[path.gather(1, at_depth.clamp(max=width - 1).expand(batch_size, -1))]
        batch.state["path_rank"] = torch.where((at_depth[None, :] <= e[:, None]) & live[:, None], ranks, -1)
    return target.status


@torch.no_grad()
def decode_pac(model: SpeculativeARModel, condition: Any, job: DecodeJob, decoding: DecodingConfig,
               rule: AcceptanceRule, window_stats: Optional[WindowStats] = None) -> DecodeOutput:
    """Decode ``job.num_tokens`` tokens per sample with SJD-PAC (module docstring); ``decoding.window`` slots
    per pass, ``decoding.tree_width`` and ``decoding.tree_depth`` shape the tree. ``stats.extra
    ["single_passes"]`` counts each sample's passes that committed one token (the paper's headline figure),
    ``stats.commits`` the passes by tokens committed.

    With ``window="auto"`` (and for ``decoding="auto"``) each pass's shape comes from
    :class:`~vispec.decoding.shapes.ShapeChooser`: AR, or a window of 2, 4, ..., 64 rows holding the deepest tree of
    ``tree_width`` that fits (``"auto"``: any chain, or any tree up to ``tree_width`` and ``tree_depth``; with
    ``compile=True`` one tree per window size, the widest-branching one, so no shape compiles after the calibration),
    by expected committed tokens per second; ``window_stats``: its measurements, kept by the caller; ``stats.shapes`` the passes
    per shape, ``stats.chooser`` its predicted speed-up over AR's passes. A decode its measurements give to AR runs
    :func:`~vispec.decoding.ar.decode_ar`; one they give to a single chain runs it every pass without choosing or
    recording (:meth:`~vispec.decoding.shapes.ShapeChooser.fixed_chain`)."""
    if decoding.strategy not in ("sjd-pac", "auto"):
        raise ValueError(f"decode_pac needs strategy 'sjd-pac' or 'auto', got {decoding.strategy!r}")
    if not rule.lossless:
        raise ValueError(f"sjd-pac verifies its tree with the exact rule only, got {rule.config.name!r}")
    width, depth = decoding.tree_width, decoding.tree_depth
    vocab = getattr(model, "image_vocab_size", None)
    if isinstance(vocab, int) and width > vocab:
        raise ValueError(f"tree_width={width} exceeds the model's {vocab} image tokens: a node's candidates are distinct "
                         f"tokens, so tree_width must be at most {vocab}")
    chooser = _shape_chooser(model, condition, job, decoding, window_stats) if decoding.window == AUTO_WINDOW else None
    if chooser is not None and chooser.needs_ar_decoder():  # the yardstick: calibrating, or due again (shapes.AR_DECODER)
        runs, passes = chooser.ar_timing_runs()
        chooser.note_ar_decoder(time_ar_passes(model, condition, job, chooser.clock, runs=runs, passes=passes), fresh=True)
    # one chain all through, without the chooser's work per pass (shapes.FIXED_CHAIN), or AR, or the chooser; not while
    # this process has shapes to compile: the chooser's decode compiles them all up front, not a later timed one
    coupling = PAC_COUPLINGS[decoding.coupling]
    uncompiled = [] if chooser is None or not job.compile else [  # the chooser's slots are the batch's
        s for s in calibration_shapes(chooser.shapes)
        if chooser.may_run(s) and not compiled_before(_compile_key(s, chooser.slots, coupling))]
    fixed_chain = chooser.fixed_chain() if chooser is not None and coupling is MAXIMAL and not uncompiled else None
    if fixed_chain is None and chooser is not None and chooser.prefers_ar():  # no shape beats AR (exact either way)
        began = chooser.clock()
        out = decode_ar(model, condition, job)
        passes = sum(out.stats.windows.values())
        if job.callback is None and passes and chooser.has_ar_decoder:  # timed as it ran (the prefill included)
            chooser.note_ar_decoder([(job.num_tokens // 2, (chooser.clock() - began) / passes)])
            chooser.finish(model)
        out.method = decoding.method
        out.stats.shapes = {"ar": passes}
        out.stats.chooser = {"predicted_speedup": 1.0, "calibrated": False, "handed_to_ar": True}
        return out
    began = None if fixed_chain is None else chooser.clock()  # a fixed chain is timed as it runs, its prefill included
    steering = None if fixed_chain is not None else chooser  # who chooses and records each pass
    largest = decoding.largest_window
    tree = tree_layout(largest, width, depth) if decoding.strategy == "sjd-pac" else tree_layout(largest, 1, 1)
    levels = max(depth, tree.levels)
    grid_width = resolve_grid_width(model, job.num_tokens, job.grid_width, decoding.init)
    start = start_decoding(model, condition, job, window=largest, grid_width=grid_width)
    q_dtype = torch.float64 if start.logits.cond.dtype == torch.float64 else torch.float32
    zeros = torch.zeros(start.batch, dtype=torch.long, device=start.device)
    state = {
        "draft_count": zeros,  # valid drafts at positions n .. n + draft_count - 1 (on the main path)
        "draft_q": torch.zeros(start.batch, max(tree.main - 1, 1), start.vocab, dtype=q_dtype, device=start.device),
        "side_ids": torch.zeros(start.batch, max(levels - 1, 1), max(width - 1, 1), dtype=torch.long,
                                device=start.device),  # siblings of the main draft at depth d (token + 1; 0: none)
        "single_passes": zeros.clone(),
    }
    if chooser is not None:
        state["path_rank"] = torch.full((start.batch, max(levels - 1, 1)), -1, dtype=torch.long, device=start.device)
    batch = RaggedBatch(start, job, job.num_tokens, largest, caches={"target": (model, start.state)}, state=state,
                        reported=("single_passes",), fixed=job.compile)
    steps: dict[Shape, PACStep] = {}
    run = compiled(pac_step) if job.compile else pac_step
    run_single = compiled(single_token_step) if job.compile else single_token_step
    run_chain = compiled(sjd_step) if job.compile else sjd_step
    chains: dict[Shape, SJDStep] = {}
    single = SJDStep(model, job, rule, coupling, decoding.init, grid_width, start.vocab, 1, None)
    fixed_shape = fixed_chain or (Shape(largest, width, depth) if chooser is None else None)
    timed = fixed_chain is not None and (not job.compile
                                         or compiled_before(_compile_key(fixed_chain, start.batch, coupling)))
    if steering is not None and uncompiled:  # compile every shape this process has not, before any pass is timed
        steering.warm_first(uncompiled)
    used: dict[int, int] = {}
    shapes: dict[str, int] = {}
    while batch.running:
        need = batch.widths(largest)
        shape = fixed_shape or steering.choose(batch.n_host, batch.ids_host, need, batch.longest())
        if shape.is_ar:
            if job.compile:
                announce_compile("the one-token step", _compile_key(shape, start.batch, coupling))
            status = run_single(single, batch, 1, None if job.compile else batch.longest())
            synced = (steering is not None and steering.must_sync()) or batch.finishing_next()
            before = list(zip(batch.n_host, batch.ids_host))
            after = batch.sync(status) if synced else batch.advance(status)
            ranks = None
        elif chooser is not None and not shape.is_tree and coupling is MAXIMAL:
            # a chain is MC-SJD's maximal coupling, whose own step gives the same tokens for less work than the tree
            # step with a one-level tree (tests/decoding/test_pac.py); it draws no siblings, so none are kept
            if shape not in chains:
                chains[shape] = SJDStep(model, job, rule, MAXIMAL, decoding.init, grid_width, start.vocab, shape.rows, None)
            if job.compile:
                announce_compile(f"the MC-SJD step ({shape.label})", _compile_key(shape, start.batch, coupling))
            before = list(zip(batch.n_host, batch.ids_host))
            status = run_chain(chains[shape], batch, shape.rows, None if job.compile else batch.longest())
            batch.state["side_ids"] = torch.zeros_like(batch.state["side_ids"])
            after, synced, ranks = batch.sync(status), True, None
        else:
            if shape not in steps:
                steps[shape] = PACStep(model, job, rule, device_layout(shape.rows, shape.branching, shape.levels, start.device),
                                       levels, width, coupling, decoding.init, grid_width, start.vocab)
            if job.compile:
                announce_compile(f"the SJD-PAC step ({shape.label})", _compile_key(shape, start.batch, coupling))
            before = list(zip(batch.n_host, batch.ids_host))
            status = run(steps[shape], batch, None if job.compile else batch.longest())
            synced = True
            probe = batch.state.get("path_rank") if steering is not None and shape.is_tree else None
            after = batch.sync(status, probe=probe)
            ranks = None if probe is None else batch.probe_host
        used[shape.rows] = used.get(shape.rows, 0) + 1
        shapes[shape.label] = shapes.get(shape.label, 0) + 1
        if steering is not None:
            steering.record(shape, before, after, ranks, synced)
        edited = batch.report(job.callback)
        if edited is not None:  # drafts and siblings made from the old tokens are dropped
            batch.state["draft_count"] = torch.where(edited < job.num_tokens, 0, batch.state["draft_count"])
    out = batch.output(decoding.method, None)
    out.stats.windows = used
    out.stats.shapes = shapes
    if fixed_chain is not None:
        passes = sum(used.values())
        if timed and job.callback is None and passes:
            chooser.note_fixed_chain(fixed_chain.rows, [(job.num_tokens // 2, (chooser.clock() - began) / passes)])
        out.stats.chooser = {"predicted_speedup": chooser.handover_speedup, "calibrated": False, "handed_to_ar": False,
                             "fixed_shape": fixed_chain.label}
    elif chooser is not None:
        out.stats.chooser = {"predicted_speedup": chooser.predicted_speedup(), "calibrated": chooser.calibrated}
    if chooser is not None:
        chooser.finish(model)
    return out


def _compile_key(shape: Shape, batch: int, coupling: Coupling) -> tuple:
    """What makes a compiled graph of an auto decode new (:func:`~vispec.decoding.compiled.announce_compile`): the step
    function that runs ``shape`` (AR's, MC-SJD's chain or SJD-PAC's tree; :func:`decode_pac`'s loop), the batch
    slots and the shape."""
    if shape.is_ar:
        return (single_token_step, batch)
    return (sjd_step if not shape.is_tree and coupling is MAXIMAL else pac_step, batch, shape)


def _shape_chooser(model: SpeculativeARModel, condition: Any, job: DecodeJob, decoding: DecodingConfig,
                   window_stats: Optional[WindowStats]) -> ShapeChooser:
    """The shape chooser of an auto decode (:mod:`vispec.decoding.shapes`): its candidates, its cost key (SJD-PAC's
    steps on this device, dtype, batch slots and compile setting; the cost curve loaded from this machine's cache
    where the caller's ``window_stats`` has none) and its pooled rates (per spec)."""
    stats = WindowStats() if window_stats is None else window_stats
    slots = min(condition_size(condition), job.max_batch_size or condition_size(condition))
    key = ("shapes",) + tuple(cost_key(model, slots, job.compile))
    load_step_costs(stats, model, key)
    shapes = candidate_shapes(decoding.largest_window, decoding.tree_width, decoding.tree_depth,
                              every_tree=decoding.strategy == "auto")
    if job.compile:  # one tree per window size: each further shape would compile (tens of seconds) mid-decode
        shapes = calibration_shapes(shapes)
    rates_key = (decoding.coupling, decoding.init, repr(job.sampling))  # what acceptance depends on besides the model
    load_shape_rates(stats, model, rates_key)  # earlier processes' rates, where this WindowStats has none
    return ShapeChooser(shapes, stats, key, rates_key, slots, job.num_tokens)


@functools.lru_cache(maxsize=None)
def device_layout(window: int, branching: int, levels: int, device: torch.device) -> TreeLayout:
    """:func:`tree_layout` with its tensors on ``device``, made once per device and shape."""
    return tree_layout(window, branching, levels).to(device)
