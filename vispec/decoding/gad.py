"""GAD for images: a non-autoregressive block drafter, verified exactly by the target, over a ragged batch.

Generalized Aggressive Decoding (Ge et al., arXiv 2205.10350) drafts a block of tokens with one forward of a
non-autoregressive model and verifies the block with one forward of the autoregressive target. Here the
drafter is :class:`vispec.models.gad_drafter.GADDrafter` (bidirectional, masked, class-conditional) and the
verification is exact speculative sampling (Leviathan et al. 2023), the draft-model path of
:func:`vispec.decoding.speculative.verify_window` (coupling ``DRAFT_MODEL``). Each round, for every sample
``b`` with ``n`` committed tokens ``x_{<n}`` and ``γ_b = min(γ, N - n - 1)`` drafts (``γ = window - 1``; the
bonus position ``n + γ_b`` stays in the image):

1. **draft** (``passes`` drafter forwards for the whole batch, :func:`draft_groups`): the block's slots split into
   groups ``[S_p, S_{p+1})``, drafted left to right. Pass ``p`` shows the drafter the committed prefix *extended by
   the earlier passes' drafts* ``d_{<S_p}`` as its context and masks at the rest of the block, ``n + S_p ..
   n + γ_b - 1``; its raw logits for the group's positions are processed exactly like the target's
   (:func:`vispec.kernels.target.window_target`: CFG with the drafter's own null-class branch, temperature, top-k,
   top-p, the position processors) into ``q_i``, and ``d_i ~ q_i`` is drawn for each ``i`` of the group, by the
   exponential race on the DRAFT noise stream keyed by ``(seed_b, position n + i, DRAFT, round)`` (``round``: the
   sample's target-forward count; each position is drawn once a round, in its group's pass, so the key is
   unique), the stream draft-model decoding (``"sd"``) draws from. ``passes=1`` (the
   default) is GAD's single forward; ``passes = γ`` drafts autoregressively, one token per forward;
2. **verify** (one target forward on ``[z, d_1 .. d_γ]``, ``z = x_{n-1}``): row ``j`` gives
   ``P_j = p(. | x_{<n}, d_{<=j})``; keep ``d_{j+1}`` with probability ``min(1, P_j(d_{j+1}) / q_j(d_{j+1}))`` while
   every earlier draft was kept; at the first rejection ``m`` sample the residual ``∝ max(0, P_m - q_m)``, or with
   every draft kept the bonus token from ``P_γ``.

Exactness: the proof of speculative sampling needs, at each row ``j``, that the draft ``d_{j+1}`` be distributed as
the ``q_j`` the row is verified with *given everything the verification has conditioned on so far*, i.e. the
prefix ``x_{<n}`` and ``d_{<=j}``; ``q_j`` itself may be any function of those. Here ``q_j`` is computed from
``x_{<n}`` and the drafts of the earlier groups, ``d_{<S_p}`` with ``S_p <= j`` (a subset of ``d_{<=j}``: within a
group the drafts are independent, across groups each sees only drafts to its left), and ``d_{j+1}`` is drawn from
it with noise used by no other draw (its own position's key). So given ``x_{<n}, d_{<=j}``, ``d_{j+1} ~ q_j``, and
row ``j`` outputs a token distributed as ``P_j`` (accepted draft or residual); every committed token is
``~ p(. | committed prefix)``, as for AR sampling (certified by ``tests/exactness``, one and several passes). A
drafter whose ``q_j`` saw a draft at or right of slot ``j + 1`` would break this (the draft would be correlated with
its own proposal's choice). With a lossy rule (``+budget``, ``+lantern``, ...) the relaxed test of
:mod:`vispec.decoding.acceptance` is used instead and the TV is measured, as for ``"sd"``.

Cost: ``passes`` drafter forwards and one target forward per round whatever ``γ`` (a sample whose block is too
short for the later groups skips them: ``drafter_nfe`` counts only the passes that drafted for it); the drafter
keeps no cache (its input is the last ``context`` tokens before the group and the block's masks,
:mod:`vispec.models.gad_drafter`), so samples at any pace share its forwards and continuous batching needs
nothing from it. ``stats.nfe`` counts target forwards (prefill included); ``stats.extra["drafter_nfe"]`` the
drafter forwards each sample took part in.
"""

from __future__ import annotations

from typing import Any

import torch

from vispec.checks import check_int
from vispec.decoding.acceptance import AcceptanceRule, TVTracker
from vispec.decoding.common import DecodeJob, select_condition, start_decoding
from vispec.decoding.config import DecodingConfig
from vispec.decoding.speculative import DRAFT_MODEL, Coupling, RaggedBatch, verify_window
from vispec.kernels.philox import Stream
from vispec.kernels.target import window_target
from vispec.kernels.verify import SampleRequest
from vispec.outputs import DecodeOutput
from vispec.protocol import SpeculativeARModel


def check_gad_drafter(drafter: Any, model: SpeculativeARModel, num_tokens: int, window: int, guidance: bool) -> None:
    """Refuse a drafter that cannot propose for ``model`` before any work, each error naming ``drafter``."""
    if drafter is None:
        raise ValueError("decoding 'gad' needs a block drafter (drafter=...), e.g. the embedded tiny-c2i gad_drafter")
    if not callable(getattr(drafter, "propose", None)) or not hasattr(drafter, "config"):
        raise ValueError(f"drafter for 'gad' must be a masked block drafter with propose() (GADDrafter), got "
                         f"{type(drafter).__name__}")
    if drafter.image_vocab_size != model.image_vocab_size:
        raise ValueError(f"drafter vocabulary ({drafter.image_vocab_size}) differs from the target's ({model.image_vocab_size})")
    if drafter.num_image_tokens < num_tokens:
        raise ValueError(f"drafter covers {drafter.num_image_tokens} image tokens, fewer than the {num_tokens} decoded")
    if window - 1 > drafter.config.max_block:
        raise ValueError(f"window {window} drafts {window - 1} tokens, more than the drafter's max_block "
                         f"({drafter.config.max_block}); use window <= {drafter.config.max_block + 1}")
    if guidance and not drafter.has_unconditional:
        raise ValueError("guidance_scale != 1 needs the drafter's unconditional branch, but the drafter has no null class")


def draft_groups(gamma: int, passes: int, groups: str = "even") -> list[int]:
    """Boundaries ``0 = S_0 < S_1 < ... < S_passes = gamma`` of the block's groups: pass ``p`` drafts block slots
    ``S_p .. S_{p+1} - 1`` (positions ``n + S_p ..``). ``"even"``: ``S_p = ceil(p gamma / passes)``; ``"doubling"``:
    ``S_p = max(p, ceil(gamma / 2^(passes - p)))``, groups of one token first, then each group twice the one before
    (8 drafts in 4 passes: 1, 1, 2, 4). A sample with fewer drafts ``γ_b`` clips the boundaries to ``γ_b`` (its
    last groups shrink or empty)."""
    check_int("gamma", gamma, minimum=1)
    check_int("passes", passes, minimum=1, maximum=gamma)
    if groups == "even":
        return [-(-p * gamma // passes) for p in range(passes + 1)]
    if groups == "doubling":
        return [0] + [max(p, -(-gamma // 2 ** (passes - p))) for p in range(1, passes + 1)]
    raise ValueError(f"groups must be 'even' or 'doubling', got {groups!r}")


@torch.no_grad()
def decode_gad(model: SpeculativeARModel, drafter: Any, condition: Any, job: DecodeJob, decoding: DecodingConfig,
               rule: AcceptanceRule, coupling: Coupling = DRAFT_MODEL) -> DecodeOutput:
    """Decode ``job.num_tokens`` tokens per sample, ``drafter`` proposing whole blocks for ``model`` (module docstring).

    ``rule`` as in :func:`vispec.decoding.sjd.decode_sjd`; ``coupling`` is the verification's (tests only: the
    draft-model coupling is the one that is exact here)."""
    if decoding.strategy != "gad":
        raise ValueError(f"decode_gad needs strategy 'gad', got {decoding.strategy!r}")
    gamma = decoding.window - 1
    if gamma < 1:
        raise ValueError(f"gad needs window >= 2 (at least one drafted token), got {decoding.window}")
    bounds = draft_groups(gamma, decoding.passes, decoding.groups)  # S_0 .. S_passes
    if job.compile:
        raise ValueError("compile=True supports decoding 'ar', 'sjd' and 'mc-sjd'; 'gad' runs its drafter eagerly "
                         "(use compile=False)")
    num_tokens, sampling = job.num_tokens, job.sampling
    check_gad_drafter(drafter, model, num_tokens, decoding.window, sampling.uses_guidance)
    start = start_decoding(model, condition, job, window=decoding.window, grid_width=num_tokens)
    zeros = torch.zeros(start.batch, dtype=torch.long, device=start.device)
    batch = RaggedBatch(start, job, num_tokens, decoding.window + 1, caches={"target": (model, start.state)},
                        state={"drafter_nfe": zeros}, reported=("drafter_nfe",))
    tv = TVTracker(start.requests, start.device) if not rule.lossless else None
    vocab = start.vocab

    while batch.running:
        n = batch.n
        drafts_b = (num_tokens - n - 1).clamp(min=0, max=gamma)  # γ_b (0 on idle slots, n = N)
        rounds = batch.widths(decoding.window) - 1  # max γ_b over live slots, from the host mirrors
        slot = torch.arange(rounds + 1, device=n.device)
        q = None
        drafts = torch.full((n.shape[0], rounds), -1, dtype=torch.long, device=n.device)
        status = None
        if rounds:
            # 1. the drafter's passes, left to right: pass p drafts block slots S_p .. S_{p+1} - 1 (clipped to γ_b),
            # reading the committed prefix and the earlier passes' drafts (already in batch.tokens) as its context
            q = torch.zeros(n.shape[0] * rounds, vocab, dtype=torch.float32, device=n.device)
            flat_rows = torch.arange(n.shape[0] * rounds, device=n.device).view(-1, rounds)
            labels = select_condition(start.condition, batch.ids)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                if lo >= rounds:
                    break
                width = min(hi, rounds) - lo
                first, last = drafts_b.clamp(max=lo), drafts_b.clamp(max=hi)  # this pass's slots of sample b
                out = drafter.propose(batch.tokens, n + first, drafts_b - first, labels, guidance=sampling.uses_guidance,
                                      validate=False)
                cond = out.cond[:, :width].to(torch.float32)
                uncond = None if out.uncond is None else out.uncond[:, :width].to(torch.float32)
                slots = lo + slot[None, :width]  # block slots S_p .. (rows of samples with an empty group are padding)
                proposal = window_target(cond, uncond, n[:, None] + slots, last - first, batch.seeds, sampling,
                                         job.processors, backend=job.backend, validate=False)
                drafted = slots < last[:, None]  # [B, width]: this pass's drafts (first == lo wherever one exists)
                _, sampled = proposal.sample(SampleRequest(
                    fresh=drafted.reshape(-1), fresh_stream=Stream.DRAFT,
                    fresh_draws=batch.nfe[:, None].expand(-1, width).reshape(-1),
                    store_rows=torch.where(drafted, flat_rows[:, lo:lo + width], -1).reshape(-1), store_out=q))
                drafts[:, lo:lo + width] = torch.where(drafted, sampled.view(-1, width), -1)
                status = proposal.status if status is None else torch.maximum(status, proposal.status)
                batch.state["drafter_nfe"] = batch.state["drafter_nfe"] + (last > first).long()
                at = (n[:, None] + slots).clamp(max=batch.tokens.shape[1] - 1)
                batch.tokens.scatter_(1, at, torch.where(drafted, drafts[:, lo:lo + width], batch.tokens.gather(1, at)))
            q = q.view(n.shape[0], rounds, vocab)

        # 2. one target forward on [z, d_1 .. d_γ]; row j predicts position n + j and verifies d_{j+1}
        positions = n[:, None] - 1 + slot
        out = model.forward_window(batch.cache(), batch.tokens.gather(1, positions), batch.longest())
        target = window_target(out.cond, out.uncond, positions + 1, drafts_b + 1, batch.seeds, sampling, job.processors,
                               backend=job.backend, validate=False)

        # 3. verify (exact speculative sampling with dense q, or the rule's relaxed test)
        row_drafts = torch.cat([drafts, torch.full_like(n[:, None], -1)], dim=1)
        verified = verify_window(target, rule, row_drafts, drafts_b, drafts_b + 1, batch.nfe, coupling, q=q,
                                 q_dense=None if q is None else slot[None, :] < drafts_b[:, None], tv=tv, ids=batch.ids,
                                 num_tokens=num_tokens)

        # 4. commit; 5. keep the target's KV of z, d_1 .. d_m (the drafter keeps nothing)
        batch.commit(verified.num_accepted, verified.next_token)
        model.rollback(batch.cache(), torch.where(batch.live, verified.num_accepted + 1, 0))
        batch.sync(target.status if status is None else torch.maximum(target.status, status))
        batch.report(job.callback)  # edits rewrite the committed tokens; the next proposal reads them afresh

    return batch.output(decoding.method, tv)
