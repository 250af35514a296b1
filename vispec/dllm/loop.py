"""The block loop of :func:`vispec.dllm.decode`: rounds of blocks, the policy's commits, and the rules.

:class:`_BlockLoop` holds one decode's state: the canvas, each row's block, NFE, noise keys and the forwards
(:mod:`vispec.dllm.forward`). Rules that end rows early or move block boundaries run after each forward (all
off by default; they compose with each other, with every policy and every cache, and keep every row's tokens
and NFE those it gets alone):

* ``eotp=True``: end-of-text prediction (Learn2PD, arXiv 2509.25188; :mod:`vispec.dllm.early_commit`).
  After each step a row's canvas may be cut after an EOS; the dropped tail reads as EOS and is never
  computed again: each forward is only as wide as the longest surviving canvas among its rows, every
  row's own dropped positions are hidden from the keys (for a bidirectional model exactly a physical
  truncation: the positions before the cut keep their RoPE ids), cached K/V keep the same mask, and the
  blocks past a row's cut cost it nothing. The EOS predictions are read where the forward computed
  logits: the whole surviving canvas without a cache, at refreshes and under ``"prefix"`` / ``"dkv"``
  (whose steps compute every masked position), only the block on ``"dual"`` block steps.
* ``early_commit=ProphetRule(...)``: Prophet (arXiv 2508.19982). A row whose mean top-2 logit gap over
  its answer region clears the progress-dependent threshold commits all its masked positions (every
  block) to this forward's candidates and stops. It is judged only on forwards that computed every
  masked position of the row (no cache, ``"prefix"``, ``"dkv"``, refreshes; ``"dual"`` block steps only
  once nothing is masked past the block), so it adds no forward.
* ``adaptive_block=AdaptiveBlocks(...)``: AdaBlock (arXiv 2509.26432; :mod:`vispec.dllm.blocks`). Each
  row's next block ends at a confident delimiter predicted by the forward that starts it (a full forward:
  the cache refresh under a cache), else after ``block_length`` positions. Rows decode their ``r``-th
  blocks in round ``r`` and wait for each other between rounds, so refreshes stay shared; under
  ``"prefix"`` / ``"dual"`` the rows of each distinct block get their own copy of the cache and their own
  span forward (one forward per group; each still counts one NFE per row it serves).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.dllm.blocks import AdaptiveBlocks, to_canvas, window_index, window_logits, window_tokens
from vispec.dllm.callback import StopDecoding, _apply_edit
from vispec.dllm.early_commit import ProphetRule, end_of_text_cut, top2_gap, truncate
from vispec.dllm.forward import _Forward, _token_masks
from vispec.dllm.schedulers import UnmaskingScheduler, UnmaskNoise
from vispec.kernels.unmask import RowNoise, unmask_candidates
from vispec.outputs import DecodeOutput, DecodeProgress, DecodeStats, StepCallback, committed_view
from vispec.sampling import STATUS_NAN, STATUS_OK, raise_status


def _decided_eos(block: Tensor, dropped: Tensor, eos_id: int) -> Tensor:
    """``block [G, W, V]`` with the window positions ``dropped [G, W]`` (past the row's canvas cut) set to logits
    that put probability 1 on EOS: a dropped position is decided, whether or not this forward happened to compute
    it (at batch > 1 it does for rows with a shorter canvas than the longest). Policies never commit there (the
    token is not the mask); Learn2PD's filter reads its confidence, which is then 1, as for an EOS the row has
    committed, independently of the batch's composition."""
    certain = torch.zeros_like(block[:1, :1])
    certain[..., eos_id] = 1e4  # softmax in float32: exactly one-hot
    return torch.where(dropped[..., None], certain, block)


class _Cuts:
    """End-of-text truncation state (:mod:`vispec.dllm.early_commit`): each row's canvas length, on the device
    and mirrored on the host (one read-back per forward), and the key mask that hides the dropped tails."""

    def __init__(self, prompt_mask: Tensor, gen_length: int):
        batch, self.prompt_len = prompt_mask.shape
        device = prompt_mask.device
        self.length = torch.full((batch,), gen_length, dtype=torch.long, device=device)
        self.host = torch.full((batch,), gen_length, dtype=torch.long)
        self.padded = ~prompt_mask.all(dim=1).cpu()
        self.visible = torch.cat([prompt_mask, torch.ones(batch, gen_length, dtype=torch.bool, device=device)], dim=1)
        self.positions = torch.arange(self.visible.shape[1], device=device)

    def width(self, rows_h: Tensor) -> int:
        """The forward's width: prompt plus the longest surviving canvas among ``rows_h``."""
        return self.prompt_len + int(self.host[rows_h].max())

    def key_mask(self, rows_h: Tensor, extent: int) -> Optional[Tensor]:
        """``[B, N]`` key mask for a forward of ``rows_h`` over ``extent`` keys, None when it would hide nothing
        (no padding, no row's canvas shorter than the keys), so an unpadded row alone takes the unmasked path."""
        if not bool((self.padded[rows_h] | (self.host[rows_h] + self.prompt_len < extent)).any()):
            return None
        return self.visible & (self.positions < self.prompt_len + self.length[:, None])

    def update(self, rows: Tensor, rows_h: Tensor, length: Tensor) -> None:
        self.length[rows] = length
        self.host[rows_h] = length.cpu()


class _BlockLoop:
    """One decode's state and its semi-autoregressive loop (:func:`vispec.dllm.decode`).

    Rounds: in round ``r`` every row decodes its ``r``-th block ``[start, end)`` (generated positions; fixed:
    ``[r Lb, (r + 1) Lb)`` for all rows; adaptive: from where its last block ended, AdaBlock's length) and rows
    wait for each other between rounds, so caches refresh together. Within a round, step ``i`` forwards every
    row whose block still has masks (one forward, or one per group of rows sharing a span when adaptive blocks
    run under the prefix / dual cache), lets the policy commit inside each row's block, then applies the
    optional rules: Prophet's early commit and end-of-text truncation.
    """

    def __init__(self, x: Tensor, forward: _Forward, scheduler: UnmaskingScheduler, seeds: Tensor, *, model: Any,
                 gen_length: int, block_length: int, temperature: float, mask_id: int, eos_id: Optional[int],
                 eot_id: Optional[int], logits_eos_inf: bool, confidence_eos_eot_inf: bool, suppress_mask_token: bool,
                 early_stop_eos: bool, callback: Optional[StepCallback], cuts: Optional[_Cuts],
                 early_commit: Optional[ProphetRule], adaptive_block: Optional[AdaptiveBlocks]):
        self.x, self.forward, self.scheduler, self.seeds, self.model = x, forward, scheduler, seeds, model
        self.gen_length, self.block_length, self.temperature = gen_length, block_length, float(temperature)
        self.mask_id, self.eos_id, self.eot_id = mask_id, eos_id, eot_id
        self.logits_eos_inf, self.confidence_eos_eot_inf = logits_eos_inf, confidence_eos_eot_inf
        self.suppress_mask_token, self.early_stop_eos, self.callback = suppress_mask_token, early_stop_eos, callback
        self.cuts, self.early_commit, self.adaptive = cuts, early_commit, adaptive_block
        batch, device = x.shape[0], x.device
        self.prompt_len = x.shape[1] - gen_length
        self.positions = torch.arange(gen_length, device=device)
        self.nfe = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished_at = torch.full((batch,), float("nan"), dtype=torch.float64)
        self.masked_at_start = torch.zeros(batch, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)  # each row's block, generated positions
        self.ends = torch.zeros(batch, dtype=torch.long, device=device)
        self.starts_h, self.ends_h = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
        self.fixed_block: Optional[tuple[int, int]] = None  # the round's block when every row shares it
        self.splits: Optional[dict] = None  # (start, end) -> _Forward: adaptive blocks under prefix / dual caches
        self.early = torch.zeros(batch, dtype=torch.bool, device=device)  # rows Prophet finished
        self.blocks = torch.zeros(batch, dtype=torch.long, device=device)  # blocks decoded per row
        self.masks: Optional[tuple] = None
        self.nan = torch.zeros((), dtype=torch.bool, device=device)  # NaN logits seen so far (read once a round)
        self.global_step, self.interrupted, self.start_time = 0, False, time.perf_counter()

    # ------------------------------------------------------------------ rounds
    def run(self) -> None:
        index = 0
        while not self.interrupted and self._round(index):
            raise_status(torch.where(self.nan, STATUS_NAN, STATUS_OK))  # one read-back per round
            index += 1

    def _round(self, index: int) -> bool:
        """Round ``index`` (class docstring); False when there was nothing left to decode."""
        if self.adaptive is None:
            if index == self.gen_length // self.block_length:
                return False
            start = index * self.block_length
            self.fixed_block = (start, start + self.block_length)
            self.starts.fill_(start)
            self.ends.fill_(start + self.block_length)
            self.masked_at_start = (self.x[:, self.prompt_len + start: self.prompt_len + start + self.block_length]
                                    == self.mask_id).sum(dim=1)
            cap = self.scheduler.steps_per_block if self.scheduler.fixed_steps else self.block_length
        else:  # the next block starts where the last one ended; its end comes from the round's first forward
            self.starts, self.starts_h = self.ends.clone(), self.ends_h.clone()
            cap = self.scheduler.steps_per_block if self.scheduler.fixed_steps else self.gen_length
        self.splits = None
        ran = False
        for step in range(cap):  # adaptive policies commit >= 1 token per step: a block's width always suffices
            masked = self.x[:, self.prompt_len:] == self.mask_id
            if not (self.adaptive is not None and step == 0):  # adaptive: every row with masks starts a block
                masked &= (self.positions >= self.starts[:, None]) & (self.positions < self.ends[:, None])
            rows = masked.any(dim=1).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            ran = True
            for group, forward in self._groups(rows, step):
                self._advance(group, forward, step, index)
                if self.interrupted:
                    return True
        return ran or self.adaptive is None

    def _groups(self, rows: Tensor, step: int) -> list[tuple[Tensor, _Forward]]:
        """The forwards of a step: one for all ``rows``, or one per block when adaptive blocks split the cache."""
        if self.splits is None or step == 0:
            return [(rows, self.forward)]
        rows_h = rows.cpu()
        groups = []
        for (start, end), forward in self.splits.items():
            pick = (self.starts_h[rows_h] == start) & (self.ends_h[rows_h] == end)
            if bool(pick.any()):
                groups.append((rows[pick.to(rows.device)], forward))
        return groups

    def _split(self, rows: Tensor) -> None:
        """After the round's refreshing forward: rows with different blocks get separate prefix / dual caches."""
        rows_h = rows.cpu()
        keys = torch.stack([self.starts_h[rows_h], self.ends_h[rows_h]], dim=1).unique(dim=0).tolist()
        if len(keys) == 1:
            return
        self.splits = {}
        for start, end in keys:
            pick = (self.starts_h[rows_h] == start) & (self.ends_h[rows_h] == end)
            self.splits[(start, end)] = self.forward.split(rows[pick.to(rows.device)])
        self.forward.cache, self.forward.cache_rows = None, None  # the next round refreshes anyway

    # ------------------------------------------------------------------ one forward
    def _advance(self, rows: Tensor, forward: _Forward, step: int, index: int) -> None:
        """One forward for ``rows`` (sorted), the policy's commit in each row's block, and the rules."""
        P = self.prompt_len
        rows_h = rows.cpu() if self.cuts is not None or self.adaptive is not None else None
        choose_blocks = self.adaptive is not None and step == 0
        rules = self.cuts is not None or self.early_commit is not None or self.adaptive is not None
        logits, first = self._forward(rows, rows_h, forward, step, whole=rules)  # the rules read beyond the block
        canvas = self.x[rows, P:]
        masked = canvas == self.mask_id
        computed = (self.positions >= first) & (self.positions < first + logits.shape[1])
        candidates = confidence = None
        if self.cuts is not None or self.early_commit is not None or choose_blocks:
            candidates, confidence = self._candidates(logits, first, masked & computed, rows)
        if step == 0:
            self.blocks[rows] += 1
        if choose_blocks:
            self._choose_blocks(rows, rows_h, forward, masked, candidates, confidence)
        out, accepted, canvas = self._commit(logits, first, rows, rows_h, canvas, step)
        if self.cuts is not None:
            canvas = self._truncate(rows, rows_h, accepted, canvas, candidates, confidence)
            masked &= self.positions < self.cuts.length[rows][:, None]  # the dropped tail is no longer the row's
        if self.early_commit is not None:
            fire = self._prophet(logits, first, rows, masked, computed)
            fill = fire[:, None] & (canvas == self.mask_id)
            canvas = torch.where(fill, candidates, canvas)
            self.early[rows] |= fire
            if self.cuts is not None:  # an EOS among the early-committed tokens ends the canvas too
                canvas = self._truncate(rows, rows_h, fill, canvas, None, None)
        self.x[rows, P:] = canvas
        self.nfe[rows] += 1
        if self.early_stop_eos:
            _fill_after_eos(self.x, rows, P, self.eos_id, self.mask_id)
        done = rows[~(self.x[rows, P:] == self.mask_id).any(dim=1)]
        self.finished_at[done.cpu()] = time.perf_counter() - self.start_time
        self.global_step += 1
        if self.callback is not None:
            self._report(rows, out, step, index, logits.shape[-1])

    def _choose_blocks(self, rows: Tensor, rows_h: Tensor, forward: _Forward, masked: Tensor, candidates: Tensor,
                       confidence: Tensor) -> None:
        """AdaBlock (:meth:`AdaptiveBlocks.block_ends`) from the round's first, full forward: the rows' block ends,
        their masked counts (the quota policies' ``M``), and under the prefix / dual cache one cache per block."""
        L = self.gen_length
        cut = self.cuts.length[rows] if self.cuts is not None else torch.full_like(rows, L)
        ends = self.adaptive.block_ends(self.starts[rows], cut, L, self.block_length, candidates, confidence)
        self.ends[rows] = ends
        self.ends_h[rows_h] = ends.cpu()
        in_block = (self.positions >= self.starts[rows][:, None]) & (self.positions < ends[:, None])
        self.masked_at_start[rows] = (masked & in_block).sum(dim=1)
        if forward.cache_mode in ("prefix", "dual"):
            self._split(rows)

    def _forward(self, rows: Tensor, rows_h: Optional[Tensor], forward: _Forward, step: int,
                 whole: bool) -> tuple[Tensor, int]:
        """Logits ``[R, T, V]`` of the generated positions ``[first, first + T)`` and ``first``.

        ``whole``: everything the forward computes after the prompt (full forwards: the surviving canvas;
        prefix: from the block on; dual: the block; dKV: the canvas, zeros where a cached committed position
        was not recomputed), else the (fixed) block only. End-of-text truncation cuts the forward to the
        longest surviving canvas among ``rows`` and hides each row's own dropped tail from the keys.
        """
        P, N = self.prompt_len, self.x.shape[1]
        first_step = step == 0 or forward.cache_rows is None
        width = N if self.cuts is None else self.cuts.width(rows_h)
        span = not first_step and forward.cache_mode != "none"
        x_width = width
        if span and forward.cache_mode == "dkv" and forward.cache is not None:
            x_width = forward.cache.seq_len  # dKV compares the canvas with its cached tokens position by position
        if self.cuts is not None:
            extent = forward.cache.seq_len if span and forward.cache is not None else x_width
            forward.set_key_mask(self.cuts.key_mask(rows_h, extent))
        if self.adaptive is None:
            start, end = P + self.fixed_block[0], P + self.fixed_block[1]
        else:  # a span forward serves rows of one block (split forwards); a full forward needs only `whole`
            start, end = P + int(self.starts_h[rows_h[0]]), P + int(self.ends_h[rows_h[0]])
        if not whole:
            lo, hi = start, min(end, width)
        elif span and forward.cache_mode in ("prefix", "dual"):
            lo, hi = start, (width if forward.cache_mode == "prefix" else min(end, width))
        else:
            lo, hi = P, width
        logits = forward.block_logits(self.x[:, :x_width], rows, lo, hi, first_step=first_step)
        self.nan |= torch.isnan(logits).any()
        if self.logits_eos_inf:  # as LLaDA: EOS is gone from the logits, for the proposal and the confidence
            logits[..., self.eos_id] = float("-inf")
        if self.masks is None:
            self.masks = _token_masks(self.model, logits.shape[-1], self.mask_id, self.eos_id, self.eot_id,
                                      self.x.device, self.confidence_eos_eot_inf, self.suppress_mask_token)
        return logits, lo - P

    def _commit(self, logits: Tensor, first: int, rows: Tensor, rows_h: Optional[Tensor], canvas: Tensor,
                step: int) -> tuple[Any, Tensor, Tensor]:
        """The policy's step on each row's block window; returns its output, the ``[R, L]`` positions that count
        as accepted for end-of-text prediction, and the canvas after the commit."""
        L = self.gen_length
        if self.adaptive is None:
            width = self.block_length
        else:
            width = int((self.ends_h[rows_h] - self.starts_h[rows_h]).max())
        index, valid = window_index(self.starts[rows], self.ends[rows], width)
        local = None if self.adaptive is not None else self.fixed_block[0] - first
        if local is not None and local >= 0 and local + width <= logits.shape[1]:
            block = logits[:, local: local + width]  # every row shares the block: a view, no copy
        else:
            block = window_logits(logits, first, index, valid)
        if self.cuts is not None and bool((self.cuts.host[rows_h] < self.gen_length).any()):
            block = _decided_eos(block, index >= self.cuts.length[rows][:, None], self.eos_id)
        sample = window_tokens(canvas, index, valid, filler=-1)  # -1: never the mask id, so never committed
        noise = UnmaskNoise(self.seeds[rows], index, self.nfe[rows])  # keyed by the generated position
        out = self.scheduler.step(block, step, sample, mask_token_id=self.mask_id, temperature=self.temperature,
                                  noise=noise, num_masked_at_block_start=self.masked_at_start[rows],
                                  proposal_mask=self.masks[0], confidence_mask=self.masks[1])
        written = to_canvas(valid, index, valid, L, False)
        canvas = torch.where(written, to_canvas(out.prev_sample, index, valid, L, -1), canvas)
        accepted = out.accepted if out.accepted is not None else out.transfer_index
        return out, to_canvas(accepted & valid, index, valid, L, False), canvas

    def _truncate(self, rows: Tensor, rows_h: Tensor, accepted: Tensor, canvas: Tensor, candidates: Optional[Tensor],
                  confidence: Optional[Tensor]) -> Tensor:
        """End-of-text prediction (:func:`end_of_text_cut`): the rows' new canvas lengths, and the canvas with the
        dropped tails set to EOS. Without ``candidates`` only an accepted EOS cuts."""
        masked = canvas == self.mask_id
        if candidates is None:
            masked, candidates, confidence = torch.zeros_like(masked), canvas, canvas.double()
        cut = end_of_text_cut(self.cuts.length[rows], accepted, canvas, masked, candidates, confidence, self.eos_id)
        self.cuts.update(rows, rows_h, cut)
        return truncate(canvas, cut, self.eos_id)

    def _candidates(self, logits: Tensor, first: int, want: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``[R, L]`` candidates and their confidences ``softmax(ℓ)[x̂]`` (float64) at the positions ``want``
        (``-1`` / ``-inf`` elsewhere), with the policy's noise keys, so they are the candidates the policy
        draws at those positions in this step."""
        width = logits.shape[1]
        flat = want[:, first: first + width].reshape(-1).nonzero().squeeze(1)
        b, j = flat // width, flat % width
        noise = None
        if self.temperature > 0:
            noise = RowNoise(self.seeds[rows][b], j + first, self.nfe[rows][b])
        cand = unmask_candidates(logits, self.temperature, None, self.masks[0], None, noise=noise, rows=flat)
        tokens = torch.full(want.shape, -1, dtype=torch.long, device=want.device)
        tokens[b, j + first] = cand.tokens
        confidence = torch.full(want.shape, float("-inf"), dtype=torch.float64, device=want.device)
        confidence[b, j + first] = cand.confidence
        return tokens, confidence

    def _prophet(self, logits: Tensor, first: int, rows: Tensor, masked: Tensor, computed: Tensor) -> Tensor:
        """``[R]`` rows whose answer region has converged (:class:`ProphetRule`)."""
        region = self.early_commit.region(masked) & computed
        b, j = region[:, first: first + logits.shape[1]].nonzero(as_tuple=True)
        gap = torch.zeros(region.shape, dtype=torch.float64, device=region.device)
        gap[b, j + first] = top2_gap(logits[b, j], self.masks[0])
        cut = self.cuts.length[rows] if self.cuts is not None else torch.full_like(rows, self.gen_length)
        return self.early_commit.fires(gap, region, masked, cut, computed.expand_as(masked))

    def _report(self, rows: Tensor, out: Any, step: int, index: int, vocab: int) -> None:
        """The step callback (:func:`vispec.dllm.decode`'s ``callback``), and its edit."""
        canvas = self.x[:, self.prompt_len:]
        decided = canvas != self.mask_id
        details = {"block": index, "step_in_block": step, "rows": rows.clone(),
                   "transfer_index": out.transfer_index.clone()}
        if self.adaptive is not None:
            details.update(block_start=self.starts[rows].clone(), block_end=self.ends[rows].clone())
        if self.cuts is not None:
            details["canvas_length"] = self.cuts.length[rows].clone()
        try:
            edit = self.callback(DecodeProgress(step=self.global_step - 1, num_committed=decided.sum(dim=1),
                                                tokens=committed_view(canvas, decided), details=details))
        except StopDecoding:
            self.interrupted = True
            return
        if edit is not None:
            _apply_edit(edit, self.x, self.prompt_len, self.mask_id, vocab, self.forward)
            for part in (self.splits or {}).values():
                part.guidance_scale = self.forward.guidance_scale

    # ------------------------------------------------------------------ result
    def output(self, scheduler: UnmaskingScheduler, cache: str) -> DecodeOutput:
        elapsed = time.perf_counter() - self.start_time
        finished_at = torch.where(torch.isnan(self.finished_at), torch.full_like(self.finished_at, elapsed),
                                  self.finished_at)
        tokens = self.x[:, self.prompt_len:]
        if self.cuts is not None:  # an edit may have touched a dropped tail: it reads as EOS
            tokens = truncate(tokens, self.cuts.length, self.eos_id)
        extra = {}
        labels = {"scheduler": type(scheduler).__name__, "cache": cache}
        if self.cuts is not None:
            extra["canvas_length"] = self.cuts.length.cpu()
            labels["eotp"] = True
        if self.early_commit is not None:
            extra["early_committed"] = self.early.long().cpu()
            labels["early_commit"] = "prophet"
        if self.adaptive is not None:
            extra["blocks"] = self.blocks.cpu()
            labels["adaptive_block"] = True
        if self.interrupted:
            labels["interrupted"] = True
        stats = DecodeStats(nfe=self.nfe.cpu(), tokens=count_tokens(tokens, self.eos_id, self.eot_id).cpu(),
                            latency_s=finished_at, extra=extra)
        method = getattr(scheduler, "strategy", "") or type(scheduler).__name__
        return DecodeOutput(tokens=tokens, stats=stats, method=method, labels=labels)


def _fill_after_eos(x: Tensor, rows: Tensor, prompt_len: int, eos_id: int, mask_id: int) -> None:
    """Early stop: masked positions after each row's first committed EOS become EOS."""
    canvas = x[rows, prompt_len:]
    is_eos = canvas == eos_id
    after = is_eos.long().cumsum(dim=1) - is_eos.long() > 0  # strictly after the first EOS
    x[rows, prompt_len:] = torch.where(after & (canvas == mask_id), torch.full_like(canvas, eos_id), canvas)


def count_tokens(sequences: Tensor, eos_id: Optional[int], eot_id: Optional[int]) -> Tensor:
    """Generated tokens per row before the first EOS, EOS and EoT excluded (spec ``dllm.md`` §16.4)."""
    keep = torch.ones_like(sequences, dtype=torch.bool)
    if eos_id is not None:
        keep &= (sequences == eos_id).long().cumsum(dim=1) == 0
    if eot_id is not None:
        keep &= sequences != eot_id
    return keep.sum(dim=1)
