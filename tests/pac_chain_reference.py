"""The exact output distribution of SJD-PAC (maximal coupling), by propagating its state through every random
choice of every pass: an independent reference for :mod:`vispec.decoding.pac`, written from its module docstring
with plain Python floats (no tensors, no keyed noise).

A state is the committed tokens and the main-path drafts; a draft is ``(token, context of its q, old law)``: its
``q`` is the target of the position given that context (a row the last pass computed), and ``old law`` is what a
sibling law may ask for (the law of the draft that position had in the pass before; ``None`` where it had none).
One pass with ``n`` committed tokens, ``R = N - n`` left and ``M`` main-path slots:

1. ``w = min(R, M)`` main rows; drafts after the known ones are initialised (one-hot ``q``); depth ``d`` (position
   ``n + d - 1``) has candidates: the main draft, then for ``d <= D - 1`` with a dense draft up to ``K - 1``
   siblings, drawn in order without replacement from ``sibling_law(q, old)`` with the main draft removed (until no
   weight is left);
2. the root (depth 0) and every node of depth ``<= D - 2`` verify their children by recursive rejection sampling
   against the node's target (:func:`rrs_outcomes`); the main path's nodes below the tree verify the next main
   draft as a chain (one stage of the same recursion);
3. the path ends at a node: a rejection there commits its residual sample; a node with nothing to verify (a leaf,
   the last main row, a node whose children lie past the sequence) commits a sample of its target;
4. the main rows after the path's end give the next drafts: slot ``s`` (position ``n + s``) is the maximal
   coupling of this pass's draft there against the main-path target (the draft if kept, else a residual sample);
   the last main row, which had no draft, gives a sample of its target. Their ``q`` is that target.

Decisions at different positions, and the candidates of a node against each other, use independent randomness;
the next drafts depend only on verification at positions after the committed path (the decoder's keyed noise has
that structure: see :mod:`vispec.decoding.pac`). With the exact sibling law (``q`` itself) the result equals the
AR joint (tests/exactness/test_exactness.py).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Callable, Optional

Dist = list  # a distribution over the vocabulary, as a list of floats
Law = Optional[tuple]  # ("q", context) a dense law, ("one-hot", token), or None: no draft there


def normalised(weights: Dist) -> Dist:
    total = sum(weights)
    return [w / total for w in weights] if total > 0 else [0.0] * len(weights)


def one_hot(token: int, vocab: int) -> Dist:
    return [float(v == token) for v in range(vocab)]


def support(dist: Dist) -> list:
    return [(v, w) for v, w in enumerate(dist) if w > 0]


def without_replacement_draws(weights: Dist, count: int) -> list:
    """``[(tokens, probability)]``: ordered draws of up to ``count`` tokens without replacement from ``weights``,
    stopping early when no weight is left."""
    out = []

    def draw(prefix: tuple, left: Dist, probability: float) -> None:
        total = sum(left)
        if len(prefix) == count or total <= 0:
            out.append((prefix, probability))
            return
        for v, w in support(left):
            rest = list(left)
            rest[v] = 0.0
            draw(prefix + (v,), rest, probability * w / total)

    draw((), list(weights), 1.0)
    return out


def rrs_outcomes(p: Dist, q_base: Dist, candidates: tuple) -> tuple[list, Dist]:
    """Recursive rejection sampling (:mod:`vispec.kernels.multi_verify`) of ``candidates`` drawn in order without
    replacement from ``q_base``: ``([probability that rank i is accepted], law of the residual sample, weighted by
    the probability that every candidate is rejected)``."""
    residual, reach, accepted, drawn = normalised(p), 1.0, [], set()
    for x in candidates:
        q_i = normalised([0.0 if v in drawn else w for v, w in enumerate(q_base)])
        a = min(1.0, residual[x] / q_i[x])
        accepted.append(reach * a)
        left = [max(0.0, r - q) for r, q in zip(residual, q_i)]
        if a < 1 and sum(left) > 0:
            residual = normalised(left)
        reach *= 1 - a
        drawn.add(x)
    return accepted, [reach * r for r in residual]


def coupled_output(p: Dist, q: Dist, draft: int) -> Dist:
    """The maximal coupling's output at a slot: the draft kept with probability ``min(1, p/q)``, else a sample of
    ``max(0, p - q)``."""
    keep = min(1.0, p[draft] / q[draft])
    residual = normalised([max(0.0, a - b) for a, b in zip(p, q)])
    out = [(1 - keep) * r for r in residual]
    out[draft] += keep
    return out


def exact_sibling_law(q: Dist, old: Callable[[], Dist]) -> Dist:
    """What :func:`vispec.decoding.pac.sibling_law` draws siblings from: the draft's own ``q``."""
    return q


def pac_chain_joint(cond: Callable[[tuple], Dist], num_tokens: int, vocab: int, branching: int, levels: int,
                    main: int, init: str = "horizontal",
                    sibling_law: Callable[[Dist, Callable[[], Dist]], Dist] = exact_sibling_law,
                    track_old: bool = False) -> dict:
    """``{sequence: probability}``: the output of SJD-PAC (module docstring) with ``branching`` K, ``levels`` D and
    ``main`` M main-path slots (``vispec.decoding.pac.tree_layout(window, K, D).main``); ``cond(context)`` is the
    processed target after ``context``; ``init``: ``"horizontal"`` (the last known token) or ``"random"``.
    ``sibling_law(q, old)`` gives the weights siblings are drawn from (``old()``: the law of the draft the position
    had in the pass before; zeros where it had none); ``track_old`` keeps that law in the state (only a sibling law
    that uses it needs it)."""

    def law(spec: Law) -> Dist:
        if spec is None:
            return [0.0] * vocab
        return cond(spec[1]) if spec[0] == "q" else one_hot(spec[1], vocab)

    states: dict = defaultdict(float)
    for x, w in support(cond(())):
        states[((x,), ())] += w
    final: dict = defaultdict(float)
    while states:
        following: dict = defaultdict(float)
        for (committed, drafts), mass in states.items():
            if len(committed) == num_tokens:
                final[committed] += mass
                continue
            for outcome, probability in pac_pass(committed, drafts, cond, num_tokens, vocab, branching, levels, main,
                                                  init, sibling_law, law, track_old):
                following[outcome] += mass * probability
        states = following
    return dict(final)


def pac_pass(committed: tuple, drafts: tuple, cond, num_tokens: int, vocab: int, branching: int, levels: int,
             main: int, init: str, sibling_law, law, track_old: bool) -> list:
    """``[((committed', drafts'), probability)]``: every outcome of one pass from a state."""
    n = len(committed)
    width = min(num_tokens - n, main)  # main rows, the root included
    tokens = [t for t, _, _ in drafts]
    count = len(drafts)  # dense drafts at positions n .. n + count - 1
    missing = max(0, width - 1 - count)
    if init == "random":
        inits = [(combo, vocab ** -missing) for combo in itertools.product(range(vocab), repeat=missing)]
    else:
        inits = [(((tokens or list(committed))[-1],) * missing, 1.0)]
    out = []
    for new, init_weight in inits:
        main_tokens = tokens[: width - 1] + list(new)  # main_tokens[k]: the draft at position n + k
        q_main = [cond(drafts[k][1]) if k < count else one_hot(main_tokens[k], vocab) for k in range(width - 1)]
        olds = [drafts[k][2] if k < count else None for k in range(width - 1)]
        # siblings of the main draft at depth d (its index d - 1), every ordered draw
        sibling_choices = []
        for d in range(1, min(levels - 1, width - 1) + 1):
            k = d - 1
            if branching == 1 or k >= count:
                sibling_choices.append([((), 1.0)])
                continue
            weights = list(sibling_law(q_main[k], lambda k=k: law(olds[k])))
            weights[main_tokens[k]] = 0.0
            sibling_choices.append(without_replacement_draws(weights, branching - 1))
        for combo in itertools.product(*sibling_choices):
            weight = init_weight * _prod(w for _, w in combo)
            siblings = [s for s, _ in combo]
            candidates = [(main_tokens[d - 1],) + (siblings[d - 1] if d - 1 < len(siblings) else ())
                          for d in range(1, width)]
            for (path, next_token), p_path in _paths(committed, (), True, candidates, q_main, cond, levels, width):
                e = len(path)
                head = committed + path + (next_token,)
                for next_drafts, p_next in _next_drafts(committed, drafts, main_tokens, q_main, e, width, cond, track_old):
                    out.append(((head, next_drafts), weight * p_path * p_next))
    return out


def _paths(committed: tuple, path: tuple, on_main: bool, candidates: list, q_main: list, cond, levels: int,
           width: int) -> list:
    """``[((path tokens, the committed token after them), probability)]`` from the node ``path``."""
    d = len(path)
    p = cond(committed + path)
    children = d + 1 < width  # the next position lies within the main rows
    if (on_main and d == width - 1) or not children or (not on_main and d == levels - 1):
        return [((path, v), w) for v, w in support(p)]  # a sample of the node's target
    stage = candidates[d] if d <= levels - 2 else candidates[d][:1]  # the tree's candidates, or the chain's draft
    accepted, residual = rrs_outcomes(p, q_main[d], stage)
    out = [((path, v), w) for v, w in support(residual)]
    for rank, (x, a) in enumerate(zip(stage, accepted)):
        if a > 0:
            for outcome, w in _paths(committed, path + (x,), on_main and rank == 0, candidates, q_main, cond, levels,
                                     width):
                out.append((outcome, a * w))
    return out


def _next_drafts(committed: tuple, drafts: tuple, main_tokens: list, q_main: list, e: int, width: int, cond,
                 track_old: bool) -> list:
    """``[(drafts, probability)]``: the main rows after depth ``e`` as the next drafts (module docstring, 4.)."""
    slots = []
    for s in range(e + 1, width):
        context = committed + tuple(main_tokens[:s])
        p = cond(context)
        had_draft = s < width - 1
        dist = coupled_output(p, q_main[s], main_tokens[s]) if had_draft else p
        old = None
        if track_old and had_draft:
            old = ("q", drafts[s][1]) if s < len(drafts) else ("one-hot", main_tokens[s])
        slots.append([((y, context, old), w) for y, w in support(dist)])
    return [(tuple(x for x, _ in combo), _prod(w for _, w in combo)) for combo in itertools.product(*slots)]


def _prod(values) -> float:
    out = 1.0
    for v in values:
        out *= v
    return out
