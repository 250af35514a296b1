"""Exact self-speculative decoding of a masked diffusion LM: the stepwise sampler's own tokens, several steps per
forward.

The stepwise reference (:mod:`vispec.dllm.loop` without caches or early rules; for ``strategy="llada"`` with one
token per step, LLaDA's ``generate()``) is a deterministic function of the model's logits and of keyed noise: at
step ``t`` a row with canvas ``x_t`` runs the model, ``ℓ_t = f(x_t)``, and its policy commits

    x_{t+1} = S_t(ℓ_t, x_t)

where ``S_t`` (the scheduler's ``step`` on the row's block, with the per-row state: block, step in block, masked
count at block start) draws its Gumbel noise from Philox keyed by (row seed, position, ``t``). Self-speculation
(in the spirit of SSD, Gao et al., arXiv 2510.04147, "Self Speculative Decoding for Diffusion LLMs") drafts the next
``k - 1`` steps by applying the *same* rule to the *stale* logits ``ℓ_t``:

    c_0 = S_t(ℓ_t, x_t) = x_{t+1}              (exact)
    c_d = S_{t+d}(ℓ_t, c_{d-1}),  d = 1..k-1   (drafts of x_{t+d+1})

and verifies the whole chain with **one** batched forward of the ``k`` canvases ``c_0 .. c_{k-1}``. ``c_0`` is
exact, so ``S_{t+1}(f(c_0), c_0)`` is the reference's ``x_{t+2}``; if it equals ``c_1``, ``c_1`` is exact and its
logits give the next step, and so on. With ``j`` leading matches, ``c_j = x_{t+j+1}`` is the new exact canvas and
its logits (already computed) start the next round: every forward advances ``j + 1`` reference steps, ``1 <= j + 1
<= k``. Nothing is approximated: a canvas's logits are used only once the canvas is proven to be the reference's,
and every committed step is ``S`` applied to the reference's own logits with the reference's own noise key (the
step index ``t``, not the forward count). So the output is the stepwise sampler's **token for token, at every
temperature and for every seed**, which implies the same law over outputs (certified by enumeration in
``tests/dllm/test_self_speculation.py`` and, for block-causal models, ``tests/dllm/test_block_causal_speculation.py``,
beside token equality on the embedded models).

Exact for every policy whose step is a function of (logits, canvas, per-row step state, keyed noise): the LLaDA
quota (``llada``; low-confidence or random remasking), Dream's schedule (:class:`~vispec.dllm.DreamScheduler`),
threshold, factor, entropy bound, contiguous and Learn2PD's filter, each reproducing *its own* stepwise run. With
``early_stop_eos`` the EOS fill after each step is part of ``S``. Not combinable (they change which logits a step
sees, so the result would not be any stepwise run's): the dKV cache (its refresh points follow forwards, not
steps), end-of-text prediction, Prophet's early commit, AdaBlock, and ``compile=True`` (lanes change count forward
to forward).

**Over a block cache** (``cache="prefix"`` or ``"dual"``, Fast-dLLM's caches; :mod:`vispec.dllm.caches`) the
reference is the stepwise sampler *with that cache*: a block's first step is a full forward that also caches every
position's K/V (the refresh), and its later steps forward only ``x[block_start:]`` (prefix) or the block (dual)
against them. Its logits at step ``t`` are therefore ``f_c(x_t)``, a function of the canvas and of the cache made at
the block's start, which every step of the block shares; so the argument above holds with ``f_c`` for ``f`` as long
as a chain stays in its block. A chain ends where its canvas completes the block (the next step is the next block's
refresh, which no draft can stand for); the verifying forward runs the ``k`` canvases' *spans* against the row's
cache in one call per block in flight, so verifying ``k`` drafts costs ``k`` block-sized forwards, not ``k`` full
ones; a lane whose exact canvas starts a new block runs the reference's own refresh forward before its next round.

**Block-causal models** (LLaDA2 layout; :class:`BlockCausalSpeculativeLoop`, over :mod:`vispec.dllm.block_causal`):
the reference is the stepwise block-causal loop with the same cache (``"prefix"``, LLaDA2's exact cache of finished
blocks, or ``"none"``), and ``S`` is its step (:class:`~vispec.dllm.block_causal.BlockCausalRule`: the policy on the
row's block, keyed by the row's step count, early stop at EOS, and the block-end rule; the editing policy's T2T edits
and post steps included, since its step is a function of the logits, the canvas and keyed noise too). A block's
logits depend only on the finished blocks and the block itself, and a draft differs from the exact canvas only inside
the block, so the rounds above run unchanged with chains that end at the block's end: a block starts with the
reference's own first forward (with ``"prefix"``, the previous block and this one, writing the previous block's K/V
into the row's cache), and the ``k`` canvases are verified as ``k`` rows of the block against copies of the row's
cached prefix in one call per block in flight (without a cache, ``k`` forwards of the canvas up to the block's end).
A lane's state (canvas, block, counters, early stop) must match as a whole for a draft to be verified.

Cost: a forward over ``k`` canvases (their spans, over a block cache). ``nfe`` counts model calls (one per row per call, as SSD counts verification
forwards); ``stats.extra["canvases"]`` counts the canvas rows forwarded (the compute), ``stats.extra["steps"]``
the reference steps taken (the stepwise run's NFE). Each row keeps its own chain and noise; rows leave the
forwards when they finish, so a row's tokens are those it gets alone, and equal to the stepwise run's.

Float caveat: the verifying forward runs ``k`` canvases per row in one batch where the stepwise run forwards one;
a model whose logits change in the last bit with the batch's size (some GPU kernels) can flip exact ties and
near-ties. On the CPU the embedded models give equal tokens (tested).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from vispec.dllm.block_causal import is_block_causal
from vispec.dllm.caches import Guidance
from vispec.dllm.checks import check_decode_inputs
from vispec.dllm.draft_length import DraftLengthChooser, model_chooser
from vispec.dllm.loop import decode_output, eos_filled
from vispec.dllm.options import SelfSpeculation  # noqa: F401 - defined with the options, documented here
from vispec.dllm.callback import report_progress
from vispec.dllm.schedulers import UnmaskingScheduler, UnmaskNoise
from vispec.dllm.tokens import TokenIds, token_masks
from vispec.outputs import DecodeOutput, StepCallback
from vispec.sampling import STATUS_NAN, STATUS_OK, raise_status

if TYPE_CHECKING:
    from vispec.dllm.options import UnmaskingOptions

__all__ = ["SelfSpeculation", "SpeculativeLoop", "self_drafting_limit"]


@dataclass
class Lanes:
    """Canvases following the stepwise reference, one per lane (all ``[R]`` / ``[R, L]`` tensors).

    ``row``: the batch row a lane belongs to; ``canvas``: its generated canvas; ``block``: the block it decodes
    (``K`` once done); ``step``: the step within the block; ``masked0``: the block's masked count when it started
    (the quota policies' ``M``); ``draws``: the reference steps taken so far (the noise key, and the stepwise run's
    NFE); ``done``: no block left to decode.
    """

    row: Tensor
    canvas: Tensor
    block: Tensor
    step: Tensor
    masked0: Tensor
    draws: Tensor
    done: Tensor

    def take(self, index: Tensor) -> "Lanes":
        return type(self)(*(getattr(self, name)[index] for name in self.__dataclass_fields__))

    @staticmethod
    def cat(parts: list["Lanes"]) -> "Lanes":
        kind = type(parts[0])
        return kind(*(torch.cat([getattr(p, name) for p in parts]) for name in kind.__dataclass_fields__))

    def matches(self, other: "Lanes") -> Tensor:
        """``[R]`` bool: lane ``i``'s whole state (canvas, block, counters) equals ``other``'s lane ``i``'s."""
        same = torch.ones_like(self.done)
        for name in self.__dataclass_fields__:
            equal = getattr(self, name) == getattr(other, name)
            same &= equal.flatten(1).all(dim=1) if equal.dim() > 1 else equal
        return same


class SpeculativeLoop:
    """One self-speculative decode (module docstring): the rows' exact canvases and the draft-verify rounds."""

    def __init__(self, model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], options: "UnmaskingOptions",
                 ids: TokenIds, scheduler: UnmaskingScheduler, seeds: Tensor, callback: Optional[StepCallback],
                 chooser: Optional[DraftLengthChooser] = None):
        batch, self.prompt_len = input_ids.shape
        device, L = input_ids.device, options.gen_length
        self._setup(model, input_ids, options, ids, scheduler, seeds, callback, chooser)
        self.prompt = input_ids
        self.key_mask = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):  # one read-back, before the loop
            self.key_mask = torch.cat([attention_mask.to(device).bool(),
                                       torch.ones(batch, L, dtype=torch.bool, device=device)], dim=1)
        self.guidance = Guidance(options.guidance_scale, self.prompt_len, ids.mask)
        self.num_blocks, self.block_length = options.num_blocks, options.block_length
        self.offsets = torch.arange(self.block_length, device=device)
        self.tokens = torch.full((batch, L), ids.mask, dtype=torch.long, device=device)
        self.reported = torch.zeros_like(self.tokens, dtype=torch.bool)  # decided at the last callback
        self.per_block = options.cache in ("prefix", "dual")  # logits are then each lane's block's, [R, Lb, V]
        self.kv: Any = None  # over a block cache: every row's K/V from its current block's refresh (2B rows guided)

    def _setup(self, model: Any, input_ids: Tensor, options: "UnmaskingOptions", ids: TokenIds,
               scheduler: UnmaskingScheduler, seeds: Tensor, callback: Optional[StepCallback],
               chooser: Optional[DraftLengthChooser] = None) -> None:
        """The state of the draft-verify rounds, whatever the model's layout. ``per_block`` (set by the layout): the
        logits of a forward are each lane's block's, ``[R, Lb, V]``, so a chain ends where its canvas leaves its block
        and a lane that starts a block runs the reference's block-start forward (:meth:`refresh`); otherwise they are
        the whole generated canvas's, ``[R, L, V]``, and chains cross blocks. ``chooser``: ``speculative="auto"``'s,
        the one :func:`vispec.dllm.decode` consulted before choosing this loop (built here if not given)."""
        batch, device = input_ids.shape[0], input_ids.device
        self.model, self.options, self.ids, self.scheduler, self.seeds, self.callback = (
            model, options, ids, scheduler, seeds, callback)
        speculation = options.speculative
        self.chooser = None  # speculative="auto": the draft length of every round (vispec.dllm.draft_length)
        if speculation.auto:
            self.chooser = chooser or model_chooser(model, batch, device, options, scheduler)
        self.k = speculation.max_draft_length if speculation.auto else speculation.draft_length
        self.round_stats: tuple[int, Tensor, Tensor] = (0, input_ids[:0, 0], input_ids[:0, 0])  # see _round
        self.slots: Optional[Tensor] = None  # the last chains' canvases' (lane, depth) (_draft)
        self.nfe = torch.zeros(batch, dtype=torch.long, device=device)
        self.canvases = torch.zeros(batch, dtype=torch.long, device=device)
        self.steps = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished_at = torch.full((batch,), float("nan"), dtype=torch.float64)
        self.masks: Optional[tuple] = None
        self.nan = torch.zeros((), dtype=torch.bool, device=device)
        self.calls, self.interrupted, self.start_time = 0, False, time.perf_counter()

    # ------------------------------------------------------------------ the reference's state machine
    def start(self) -> Lanes:
        """Every row's lane before its first step: the first block with a masked position."""
        batch = self.tokens.shape[0]
        rows = torch.arange(batch, device=self.tokens.device)
        zeros = torch.zeros(batch, dtype=torch.long, device=self.tokens.device)
        lanes = Lanes(rows, self.tokens.clone(), zeros - 1, zeros, zeros, zeros.clone(), zeros.bool())
        return self._next_block(lanes, torch.ones(batch, dtype=torch.bool, device=self.tokens.device))

    def _next_block(self, lanes: Lanes, moving: Tensor) -> Lanes:
        """Lanes ``moving`` go to their next block holding a masked position (``done`` when there is none)."""
        per_block = (lanes.canvas == self.ids.mask).view(lanes.canvas.shape[0], self.num_blocks, -1).sum(dim=-1)
        blocks = torch.arange(self.num_blocks, device=per_block.device)
        later = (blocks > lanes.block[:, None]) & (per_block > 0)
        has_later = later.any(dim=1)
        nxt = torch.where(has_later, later.long().argmax(dim=1), torch.full_like(lanes.block, self.num_blocks))
        lanes.block = torch.where(moving, nxt, lanes.block)
        lanes.step = torch.where(moving, torch.zeros_like(lanes.step), lanes.step)
        count = per_block.gather(1, nxt.clamp(max=self.num_blocks - 1)[:, None]).squeeze(1)
        lanes.masked0 = torch.where(moving, count, lanes.masked0)
        lanes.done = lanes.done | (moving & ~has_later)
        return lanes

    def reference_step(self, lanes: Lanes, logits: Tensor, source: Optional[Tensor] = None) -> Lanes:
        """``S_t``: the stepwise run's step on every (not done) lane, from the logits of the generated positions:
        lane ``i`` reads ``logits[source[i]]`` (``[L, V]``; its own, or when drafting the stale logits of its chain's
        exact canvas; ``source`` None: ``logits`` has one row per lane). Returns new lanes (the inputs are kept)."""
        index = lanes.block[:, None] * self.block_length + self.offsets  # [R, Lb] the block's positions
        if source is None:
            source = torch.arange(index.shape[0], device=index.device)
        if self.per_block:  # the logits are already the lanes' blocks' (a chain stays in its block)
            block_logits = logits[source]
        else:
            block_logits = logits[source[:, None], index]  # [R, Lb, V]: only the block is gathered
        if self.options.logits_eos_inf:
            block_logits[..., self.ids.eos] = float("-inf")
        sample = lanes.canvas.gather(1, index)
        out = self.scheduler.step(block_logits, lanes.step, sample, mask_token_id=self.ids.mask,
                                  temperature=float(self.options.temperature),
                                  noise=UnmaskNoise(self.seeds[lanes.row], index, lanes.draws),
                                  num_masked_at_block_start=lanes.masked0, proposal_mask=self.masks[0],
                                  confidence_mask=self.masks[1])
        canvas = lanes.canvas.scatter(1, index, out.prev_sample)
        if self.options.early_stop_eos:
            canvas = eos_filled(canvas, self.ids.eos, self.ids.mask)
        new = Lanes(lanes.row, canvas, lanes.block, lanes.step + 1, lanes.masked0, lanes.draws + 1, lanes.done)
        left = (canvas.gather(1, index) == self.ids.mask).any(dim=1)
        finished_block = ~left
        if self.scheduler.fixed_steps:  # the stepwise loop runs steps_per_block steps of a block, then moves on
            finished_block |= new.step >= self.scheduler.steps_per_block
        return self._next_block(new, finished_block)

    # ------------------------------------------------------------------ the model
    def forward(self, lanes: Lanes) -> Tensor:
        """``[R, L, V]`` logits of the lanes' generated positions: one batched model call (guided: both branches)."""
        ids = torch.cat([self.prompt[lanes.row], lanes.canvas], dim=1)
        mask = None if self.key_mask is None else self.key_mask[lanes.row]
        ids, mask = self.guidance.inputs(ids, mask)
        return self._checked(self.guidance.mix(self.model(ids, attention_mask=mask).logits[:, self.prompt_len:]))

    def refresh(self, lanes: Lanes) -> Tensor:
        """Over a block cache: the reference's block-start forward for ``lanes`` (one per row, each at step 0 of its
        block): a full forward that caches every position's K/V for their rows (kept in :attr:`kv`, replacing the
        rows' previous block's), returning ``[R, Lb, V]`` logits of each lane's block."""
        ids = torch.cat([self.prompt[lanes.row], lanes.canvas], dim=1)
        mask = None if self.key_mask is None else self.key_mask[lanes.row]
        ids, mask = self.guidance.inputs(ids, mask)
        out = self.model.compute_kv_cache(ids, attention_mask=mask)
        where = self._kv_rows(lanes.row)
        if self.kv is None:  # every row's slot, filled as rows start blocks
            self.kv = out.kv_cache.select(torch.zeros(self._kv_size(), dtype=torch.long, device=ids.device))
        for mine, theirs in zip(self.kv.keys + self.kv.values, out.kv_cache.keys + out.kv_cache.values):
            mine[where] = theirs
        for name in ("input_ids", "positions", "key_mask"):
            mine = getattr(self.kv, name)
            if mine is not None:
                mine[where] = getattr(out.kv_cache, name)
        index = lanes.block[:, None] * self.block_length + self.offsets + self.prompt_len
        logits = self.guidance.mix(out.logits.gather(1, self._expand(index, out.logits)))
        return self._checked(logits)

    def span(self, lanes: Lanes) -> Tensor:
        """Over a block cache: ``[R, Lb, V]`` logits of each lane's block from the cached step's forward (the span
        ``x[block_start:]`` for prefix, the block for dual) against its row's cache; one model call per block in
        flight (rows in different blocks have different spans)."""
        blocks = lanes.block.unique().tolist()  # one read-back per verifying round; a few blocks at most
        parts, order = [], []
        for block in blocks:
            group = (lanes.block == block).nonzero().squeeze(1)
            rows = lanes.row[group]
            ids = torch.cat([self.prompt[rows], lanes.canvas[group]], dim=1)
            mask = None if self.key_mask is None else self.key_mask[rows]
            ids, _ = self.guidance.inputs(ids, mask)
            start = self.prompt_len + block * self.block_length
            end = ids.shape[1] if self.options.cache == "prefix" else start + self.block_length
            cache = self.kv.select(self._kv_rows(rows))  # a copy: the span writes its K/V into it
            out = self.model.forward_span(ids[:, start:end], start, cache).logits[:, : self.block_length]
            parts.append(self.guidance.mix(out))
            order.append(group)
        logits = torch.cat(parts)[torch.argsort(torch.cat(order))]
        return self._checked(logits)

    def _kv_rows(self, rows: Tensor) -> Tensor:
        """The cache rows of batch ``rows``: theirs, and with guidance their unconditional branch's too."""
        return torch.cat([rows, rows + self.tokens.shape[0]]) if self.guidance.guided else rows

    def _kv_size(self) -> int:
        return self.tokens.shape[0] * (2 if self.guidance.guided else 1)

    @staticmethod
    def _expand(index: Tensor, logits: Tensor) -> Tensor:
        """``index [R, W]`` for gathering ``[R, W, V]`` from ``logits`` (guided: ``2R`` rows, the index repeated)."""
        if logits.shape[0] != index.shape[0]:
            index = torch.cat([index, index])
        return index[:, :, None].expand(-1, -1, logits.shape[-1])

    def _checked(self, logits: Tensor) -> Tensor:
        self.nan |= torch.isnan(logits).any()
        if self.masks is None:
            self.masks = token_masks(self.model, logits.shape[-1], self.ids, logits.device,
                                     self.options.confidence_eos_eot_inf, self.options.suppress_mask_token)
        return logits

    def _charge(self, lanes: Lanes) -> None:
        """One NFE for every row the call serves, one canvas per lane."""
        self.canvases.index_add_(0, lanes.row, torch.ones_like(lanes.row))
        served = torch.zeros_like(self.nfe, dtype=torch.bool)
        served[lanes.row] = True
        self.nfe += served.long()

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Draft ``k - 1`` steps from each row's current logits, verify every canvas in one forward, keep the
        longest verified chain (module docstring)."""
        lanes = self.start()
        self._finish(lanes.take(lanes.done.nonzero().squeeze(1)))
        lanes = lanes.take((~lanes.done).nonzero().squeeze(1))
        if lanes.row.numel() == 0:
            return
        self._charge(lanes)
        logits = self.refresh(lanes) if self.per_block else self.forward(lanes)
        while lanes.row.numel() and not self.interrupted:
            if self.chooser is not None:
                self.k = self.chooser.choose(lanes.row.numel())
            lanes, logits = self._round(lanes, logits)
            raise_status(torch.where(self.nan, STATUS_NAN, STATUS_OK))
            if self.chooser is not None:
                self.chooser.record(*self.round_stats)

    def _round(self, lanes: Lanes, logits: Tensor) -> tuple[Lanes, Tensor]:
        """One draft-verify round for the live ``lanes`` (exact canvases, one per row) and their ``logits``."""
        chain, table = self._draft(lanes, logits)
        # every canvas with a step left is forwarded, in one call (over a cache: those whose next step is a cached
        # step of the block their chain began in; a canvas that starts a new block is refreshed if it is picked)
        left = ~chain.done
        if self.per_block:
            left &= chain.block == lanes.block[self.slots[:, 0]]
        todo = left.nonzero().squeeze(1)
        verified = logits[:0]
        if todo.numel():
            forwarded = chain.take(todo)
            self._charge(forwarded)
            self.calls += 1
            verified = self.span(forwarded) if self.per_block else self.forward(forwarded)
        matches = self._verify(chain, table, todo, verified)
        accepted = matches.long().cumprod(dim=1).sum(dim=1)  # leading verified drafts
        self.round_stats = (todo.numel(), accepted, (table[:, 1:] >= 0).sum(dim=1))  # canvases, verified, drafted
        pick = table.gather(1, accepted[:, None]).squeeze(1)  # the deepest exact canvas of each chain
        exact = chain.take(pick)
        self._finish(exact.take(exact.done.nonzero().squeeze(1)))
        keep = (~exact.done).nonzero().squeeze(1)
        row_in_verified = torch.full((chain.row.numel(),), -1, dtype=torch.long, device=logits.device)
        row_in_verified[todo] = torch.arange(todo.numel(), device=logits.device)
        advanced = torch.zeros_like(self.steps)
        advanced[lanes.row] = accepted + 1
        new_lanes = exact.take(keep)
        self._report(new_lanes, advanced)
        source = row_in_verified[pick[keep]]
        if not self.per_block:
            return new_lanes, verified[source]
        fresh = source < 0  # the exact canvas starts a block: the reference's refresh forward gives its logits
        logits = torch.empty((keep.numel(), self.block_length, logits.shape[-1]), dtype=logits.dtype,
                             device=logits.device)
        logits[~fresh] = verified[source[~fresh]]
        starting = fresh.nonzero().squeeze(1)
        if starting.numel():
            refreshed = new_lanes.take(starting)
            self._charge(refreshed)
            with self.chooser.untimed() if self.chooser is not None else nullcontext():
                logits[starting] = self.refresh(refreshed)  # the stepwise loop's own refresh: no draft length's cost
        return new_lanes, logits

    def _draft(self, lanes: Lanes, logits: Tensor) -> tuple[Lanes, Tensor]:
        """The chains ``c_0 = S_t(ℓ_t, x_t)`` (exact) and ``c_d = S_{t+d}(ℓ_t, c_{d-1})`` (drafts on the stale
        logits), ``d < k``, a chain ending early once its canvas is complete. Returns every canvas (concatenated by
        depth) and ``table [n, k + 1]``: the index of lane ``i``'s depth-``d`` canvas, -1 where there is none; keeps
        its inverse, :attr:`slots` ``[canvases, 2]``: each canvas's (lane, depth)."""
        n = lanes.row.numel()
        table = torch.full((n, self.k + 1), -1, dtype=torch.long, device=logits.device)
        src = torch.arange(n, device=logits.device)  # the lane each canvas of this depth belongs to
        parts = [self.reference_step(lanes, logits)]
        table[:, 0] = src
        slots = [torch.stack([src, torch.zeros_like(src)], dim=1)]
        count = n
        for depth in range(1, self.k):  # k is small: a loop over depths, batched over rows
            going = ~parts[-1].done
            if self.per_block:  # a chain ends where its canvas completes the block (module docstring)
                going &= parts[-1].block == lanes.block[src]
            live = going.nonzero().squeeze(1)
            if live.numel() == 0:
                break
            src = src[live]
            parts.append(self.reference_step(parts[-1].take(live), logits, src))
            table[src, depth] = torch.arange(count, count + live.numel(), device=logits.device)
            slots.append(torch.stack([src, torch.full_like(src, depth)], dim=1))
            count += live.numel()
        self.slots = torch.cat(slots)
        return Lanes.cat(parts), table

    def _verify(self, chain: Lanes, table: Tensor, todo: Tensor, verified: Tensor) -> Tensor:
        """``[n, k]`` bool: the reference's step from canvas ``d``'s own logits gives canvas ``d + 1`` (so, when every
        earlier one matched, canvas ``d + 1`` is the stepwise run's)."""
        matches = torch.zeros(table.shape[0], self.k, dtype=torch.bool, device=table.device)
        if todo.numel() == 0:
            return matches
        lane, depth = self.slots[todo].unbind(dim=1)  # of _draft
        successor = table[lane, depth + 1]
        truth = self.reference_step(chain.take(todo), verified)
        has = successor >= 0
        same = torch.zeros_like(has)
        same[has] = truth.take(has).matches(chain.take(successor[has]))
        matches[lane, depth] = same
        return matches

    def _finish(self, lanes: Lanes) -> None:
        """Rows whose exact canvas is complete: their tokens, reference steps and finish time."""
        if lanes.row.numel() == 0:
            return
        self._record(lanes)
        self.finished_at[lanes.row.cpu()] = time.perf_counter() - self.start_time

    def _record(self, lanes: Lanes) -> None:
        """The rows' state from their exact lanes: canvas and reference steps."""
        self.tokens[lanes.row] = lanes.canvas
        self.steps[lanes.row] = lanes.draws

    def _answer(self) -> Tensor:
        """``[B, L]`` the rows' generated canvases, as the step callback sees them."""
        return self.tokens

    def _report(self, lanes: Lanes, advanced: Tensor) -> None:
        """The live rows' exact canvases, and the step callback after every verifying forward (no edits: they would
        change the reference). ``details``: ``block`` (the lowest block still decoding), ``rows``,
        ``transfer_index [B, L]`` (committed since the last callback), ``reference_steps [B]`` (the stepwise run's
        steps so far) and ``advanced [B]`` (the steps this forward verified)."""
        self._record(lanes)
        if self.callback is None:
            return
        answer = self._answer()
        decided = answer != self.ids.mask
        block = torch.full_like(self.steps, self.num_blocks)
        block[lanes.row] = lanes.block
        details = {"block": int(block.min()), "rows": lanes.row.clone(), "transfer_index": decided & ~self.reported,
                   "reference_steps": self.steps.clone(), "advanced": advanced.clone()}
        edit, self.interrupted = report_progress(self.callback, self.calls - 1, answer, decided, details)
        if self.interrupted:
            return
        self.reported = decided
        if edit:
            raise ValueError("a step callback cannot edit the canvas or the guidance under self-speculative decoding "
                             "(the output is the stepwise run's by construction); return None")

    # ------------------------------------------------------------------ result
    def output(self) -> DecodeOutput:
        labels = {"scheduler": type(self.scheduler).__name__, "cache": self.options.cache,
                  "speculative": self._speculation_label()}
        return decode_output(self, self.tokens, labels, {"steps": self.steps.cpu(), "canvases": self.canvases.cpu()})

    def _speculation_label(self) -> dict:
        if self.chooser is None:
            return {"draft_length": self.k}
        return {"draft_length": "auto", "rounds_by_draft_length": dict(sorted(self.chooser.chosen.items()))}


@torch.no_grad()
def self_drafting_limit(model: Any, input_ids: Tensor, options: "UnmaskingOptions", *,
                        scheduler: UnmaskingScheduler, generator: Any = None) -> list[int]:
    """The forwards self-speculation needs per row with an unbounded draft length (``k = ∞``): the acceptance limit of
    self-drafting, where only the stale drafts' agreement with the stepwise run bounds a round.

    Computed without the ``k``-canvas forwards: the stepwise run is decoded once (one forward per step), and at every
    step ``t`` the whole remaining chain is drafted from ``ℓ_t`` (no forward) and compared with the run's canvases,
    giving ``j_t``, the drafts that a verification would accept. The rounds then go ``t -> t + j_t + 1`` from
    ``t = 0``, each costing one forward while a step is left after ``c_0`` (and one forward starts the decode), as
    :class:`SpeculativeLoop` counts. Rows are decoded one at a time (an analysis, not a hot path); ``input_ids``
    ``[B, P]`` unpadded prompts of one length, ``options`` as :func:`vispec.dllm.decode` takes them (its
    ``speculative`` is ignored)."""
    from dataclasses import replace

    from vispec.kernels.philox import per_sample_seeds

    if is_block_causal(model):
        raise ValueError(f"self_drafting_limit analyses the bidirectional block loop; {type(model).__name__} is "
                         "block-causal (decode it with speculative=k and read stats['steps'] and nfe)")
    options = replace(options, speculative=SelfSpeculation(1))
    ids = check_decode_inputs(model, input_ids, None, options, scheduler)
    scheduler.set_timesteps(options.steps, options.gen_length, options.block_length)
    seeds = per_sample_seeds(generator, input_ids.shape[0], input_ids.device)
    limits = []
    for row in range(input_ids.shape[0]):
        loop = SpeculativeLoop(model, input_ids[row: row + 1], None, options, ids, scheduler, seeds[row: row + 1], None)
        lanes = loop.start()
        if bool(lanes.done[0]):
            limits.append(0)
            continue
        logits = loop.forward(lanes)
        truth, drafts = [], []  # truth[i]: the canvas after step i + 1; drafts[t]: c_1, c_2, ... drafted from ℓ_t
        while True:
            exact = loop.reference_step(lanes, logits)
            chain, draft = [], exact
            while not bool(draft.done[0]):
                draft = loop.reference_step(draft, logits)
                chain.append(draft.canvas[0])
            truth.append(exact.canvas[0])
            drafts.append(chain)
            if bool(exact.done[0]):
                break
            lanes, logits = exact, loop.forward(exact)
        steps, t, forwards = len(truth), 0, 1
        while t + 1 < steps:  # a round from the exact canvas after t steps forwards c_0 .. (c_0 has a step left)
            agree = 0
            for d, canvas in enumerate(drafts[t], start=1):
                if t + d >= steps or not torch.equal(canvas, truth[t + d]):
                    break
                agree += 1
            forwards += 1
            t += agree + 1
        limits.append(forwards)
    return limits
