"""The block loop of :func:`vispec.dllm.decode`, as LLaDA's ``generate``: for each block, for each step, a forward
(:mod:`vispec.dllm.caches`), the policy's commit (:mod:`vispec.dllm.schedulers`), and the rules after it.

:class:`BlockLoop` holds one decode's state: the canvas ``x = [prompt ; mask^L]``, NFE, noise keys, the cache, the
block-boundary provider (:mod:`vispec.dllm.blocks`: fixed blocks or AdaBlock) and the after-step rules
(:mod:`vispec.dllm.view`: end-of-text prediction, :mod:`vispec.dllm.eotp`; Prophet, :mod:`vispec.dllm.prophet`).

Rounds: in round ``r`` every row decodes its ``r``-th block ``[start, end)`` and rows wait for each other between
rounds, so caches refresh together. Within a round, step ``i`` forwards every row whose block still has masks (one
forward, or one per group of rows sharing a span when adaptive blocks run under the prefix / dual cache), lets the
policy commit inside each row's block, then runs the rules. Fixed-step policies (LLaDA's quota) run ``steps / K``
steps per block; adaptive ones run until the block has no mask left. Steps that would commit nothing because a
row's block is already complete are skipped (LLaDA's reference spends forwards on them; the tokens are the same).
Mask tokens in the prompts join the first round (:mod:`vispec.dllm.infill`): its window is ``[the row's prompt masks ;
block 0]``, its forwards return logits from the first prompt mask on, and its masked count includes them.

Every forward counts one NFE for every row it serves, the cache-refreshing full forward included. Each row keeps
its own noise (Philox keyed by its seed, generated position and forward count) and leaves the forward as soon as its
block is complete, so a row's tokens and NFE are those it gets alone. Logits with NaN raise at the end of their
round (one read-back per round).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from vispec.dllm.blocks import AdaptiveBounds, FixedBlocks, to_canvas, window_tokens
from vispec.dllm.cache_modes import cache_class
from vispec.dllm.caches import Guidance, NoCache
from vispec.dllm.callback import apply_edit, report_progress
from vispec.dllm.eotp import EndOfText
from vispec.dllm.options import UnmaskingOptions
from vispec.dllm.prophet import EarlyCommit
from vispec.dllm.infill import PromptInfill
from vispec.dllm.schedulers import UnmaskingScheduler, UnmaskNoise, UnmaskSchedulerOutput
from vispec.dllm.tokens import TokenIds, token_masks
from vispec.dllm.view import AfterStep, StepView
from vispec.kernels.unmask import RowNoise, unmask_candidates
from vispec.outputs import DecodeOutput, DecodeStats, StepCallback
from vispec.sampling import STATUS_NAN, STATUS_OK, raise_status


class BlockLoop:
    """One decode's state and its semi-autoregressive loop (module docstring)."""

    def __init__(self, model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], options: UnmaskingOptions,
                 ids: TokenIds, scheduler: UnmaskingScheduler, seeds: Tensor, callback: Optional[StepCallback],
                 shared: Any = None):
        batch, self.prompt_len = input_ids.shape
        device, L = input_ids.device, options.gen_length
        self.model, self.options, self.ids, self.scheduler, self.seeds, self.callback = (
            model, options, ids, scheduler, seeds, callback)
        self.shared = shared  # a SharedGenerator (vispec.dllm.uniform), or None: counter-based noise
        self.x = torch.cat([input_ids, torch.full((batch, L), ids.mask, dtype=torch.long, device=device)], dim=1)
        prompt_mask = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                       else attention_mask.to(device).bool())
        key_mask = torch.cat([prompt_mask, torch.ones(batch, L, dtype=torch.bool, device=device)], dim=1)
        if bool(prompt_mask.all()):  # the one read-back about padding, before the loop: unpadded forwards take no mask
            key_mask = None
        self.infill = PromptInfill.build(input_ids, attention_mask, ids.mask, L)  # the prompt's masks, or None
        guidance = Guidance(options.guidance_scale, self.prompt_len, ids.mask,
                            None if self.infill is None else self.infill.slots)
        self.cache: NoCache = cache_class(model, options.cache)(model, guidance, key_mask, options.compile,
                                                                options.cache_reload_steps)
        self.cache.use_noise(seeds, shared)  # models with noise of their own (uniform corruption)
        blocks = (batch, L, options.block_length, ids.mask, device)
        self.bounds = (FixedBlocks(*blocks) if options.adaptive_block is None
                       else AdaptiveBounds(options.adaptive_block, *blocks))
        self.eot = EndOfText(prompt_mask, L, ids.eos, ids.mask) if options.eotp else None
        prophet = None if options.early_commit is None else EarlyCommit(options.early_commit, batch, device, ids.mask,
                                                                         self.eot)
        self.hooks: list[AfterStep] = [hook for hook in (self.eot, prophet) if hook is not None]
        self.whole = bool(self.hooks) or self.bounds.adaptive  # the rules read logits beyond the block
        self.positions = torch.arange(L, device=device)
        self.nfe = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished_at = torch.full((batch,), float("nan"), dtype=torch.float64)
        self.masks: Optional[tuple] = None  # (proposal, confidence) token masks, once the vocabulary is known
        self.nan = torch.zeros((), dtype=torch.bool, device=device)  # NaN logits seen so far (read once a round)
        self.global_step, self.interrupted, self.start_time = 0, False, time.perf_counter()
        # speculative="auto" handed this decode over: its steps (not the refreshes) timed for the chooser, (rows, s)
        self.step_timer: Optional[Callable[[int, float], None]] = None
        self.step_clock: Callable[[], float] = time.perf_counter

    # ------------------------------------------------------------------ the loop (LLaDA's generate)
    def run(self) -> None:
        """``for block: for step: logits = cache.logits(...); out = scheduler.step(...); commit``."""
        index = 0
        while not self.interrupted and self._round(index):
            raise_status(torch.where(self.nan, STATUS_NAN, STATUS_OK))  # one read-back per round
            index += 1

    def _round(self, index: int) -> bool:
        """Round ``index``: every row's block, step by step; False when there was nothing left to decode."""
        if not self.bounds.start_round(index, self.x[:, self.prompt_len:]):
            return False
        infill = self.infill if index == 0 else None  # the prompt's masks join the first block (vispec.dllm.infill)
        steps = self.bounds.steps(self.scheduler)
        if infill is not None:
            self.bounds.masked_at_start = self.bounds.masked_at_start + infill.valid.sum(dim=1)
            steps += 0 if self.scheduler.fixed_steps else infill.width
        ran = False
        for step in range(steps):
            masked = self.x[:, self.prompt_len:] == self.ids.mask
            pending = self.bounds.pending(masked, step).any(dim=1)
            if infill is not None:
                pending |= infill.masked(self.x, self.ids.mask)
            rows = pending.nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            ran = True
            for group, cache in self.bounds.groups(rows, step, self.cache):  # one, unless AdaBlock split the cache
                started = self.step_clock() if self.step_timer is not None else None
                self._advance(group, cache, step, index, infill)
                if started is not None and (step > 0 or self.options.cache not in ("prefix", "dual")):
                    self.step_timer(group.numel(), self.step_clock() - started)  # a block's refresh is not timed
                if self.interrupted:
                    return True
        return ran or not self.bounds.adaptive

    def _advance(self, rows: Tensor, cache: NoCache, step: int, index: int,
                 infill: Optional[PromptInfill] = None) -> None:
        """One forward for ``rows`` (sorted), the policy's commit in each row's block (with ``infill``, the window is
        the prompt's masks, then the block), the rules, the callback."""
        P = self.prompt_len
        rows_h = rows.cpu() if self.eot is not None or self.bounds.adaptive else None
        start, end = self.bounds.span(rows_h)
        width = self.x.shape[1] if self.eot is None else self.eot.width(rows_h)
        logits, lo = cache.logits(self.x, rows, step, (P + start if infill is None else infill.first, P + end), width,
                                  self.whole, key_mask=None if self.eot is None else self.eot.key_mask(rows_h))
        if infill is not None:  # the logits start inside the prompt: the slots', then the generated positions'
            slot_logits = self._checked(infill.logits(logits, lo, rows))
            logits, lo = logits[:, P - lo:], P
        view = self._view(rows, rows_h, logits, lo - P, step)
        if step == 0:
            self.bounds.choose(view, cache)  # AdaBlock: each row's block end, from this full forward
        index_, valid = self.bounds.window(rows, rows_h)  # each row's block as a window [R, W]
        block_logits = self._block_logits(view, index_, valid)
        sample = window_tokens(view.canvas, index_, valid, filler=-1)  # -1: never committed
        positions = index_
        if infill is not None:
            block_logits = torch.cat([slot_logits, block_logits], dim=1)
            sample = torch.cat([infill.tokens(self.x, rows), sample], dim=1)
            positions = torch.cat([infill.keys[rows], index_], dim=1)
        out = self.scheduler.step(block_logits, step, sample,
                                  mask_token_id=self.ids.mask, temperature=float(self.options.temperature),
                                  noise=UnmaskNoise(self.seeds[rows], positions, self.nfe[rows], rows=rows,
                                                    shared=self.shared),  # keyed by position
                                  num_masked_at_block_start=self.bounds.masked_at_start[rows],
                                  proposal_mask=self.masks[0], confidence_mask=self.masks[1])
        if infill is not None:
            out = self._fill_prompt(infill, rows, out)
        cache.after_step(rows, out)  # self-conditioning and drafts of models with state between steps
        self._commit(view, out, index_, valid)
        for hook in self.hooks:  # end-of-text cut, Prophet's early commit
            hook.after_step(view)
        self.x[rows, P:] = view.canvas
        self.nfe[rows] += 1
        if self.options.early_stop_eos:
            fill_after_eos(self.x, rows, P, self.ids.eos, self.ids.mask)
            if getattr(self.model, "uniform_corruption", False):  # DiffusionGemma: a finished canvas ends at its EOS
                finished = ~(window_tokens(self.x[rows, P:], index_, valid, filler=-1) == self.ids.mask).any(dim=1)
                fill_after_eos(self.x, rows[finished], P, self.ids.eos, None)
        left = (self.x[rows, P:] == self.ids.mask).any(dim=1)
        if infill is not None:
            left |= infill.masked(self.x, self.ids.mask)[rows]
        done = rows[~left]
        self.finished_at[done.cpu()] = time.perf_counter() - self.start_time
        self.global_step += 1
        if self.callback is not None:
            self._report(view, out, step, index)

    # ------------------------------------------------------------------ the pieces of a step
    def _checked(self, logits: Tensor) -> Tensor:
        """The NaN flag and LLaDA's ``logits_eos_inf`` on some logits (in place)."""
        self.nan |= torch.isnan(logits).any()
        if self.options.logits_eos_inf:  # as LLaDA: EOS is gone from the logits, for the proposal and the confidence
            logits[..., self.ids.eos] = float("-inf")
        return logits

    def _fill_prompt(self, infill: PromptInfill, rows: Tensor, out: Any) -> UnmaskSchedulerOutput:
        """Write the prompt slots of a first-block step (the window's first ``Q`` positions) into the rows' prompts;
        the block's part of the step's output."""
        q = infill.width
        infill.write(self.x, rows, out.prev_sample[:, :q])
        return UnmaskSchedulerOutput(prev_sample=out.prev_sample[:, q:], transfer_index=out.transfer_index[:, q:],
                                     sampled_tokens=out.sampled_tokens[:, q:], confidence=out.confidence[:, q:],
                                     accepted=None if out.accepted is None else out.accepted[:, q:])

    def _view(self, rows: Tensor, rows_h: Optional[Tensor], logits: Tensor, first: int, step: int) -> StepView:
        """The forward as the rules see it (:class:`StepView`); the NaN flag and LLaDA's EOS options on the logits."""
        self._checked(logits)
        if self.masks is None:
            self.masks = token_masks(self.model, logits.shape[-1], self.ids, self.x.device,
                                     self.options.confidence_eos_eot_inf, self.options.suppress_mask_token)
        canvas = self.x[rows, self.prompt_len:]
        cut = self.eot.length[rows] if self.eot is not None else torch.full_like(rows, self.options.gen_length)
        view = StepView(rows, logits, first, canvas, canvas == self.ids.mask,
                        (self.positions >= first) & (self.positions < first + logits.shape[1]), cut, rows_h,
                        proposal_mask=self.masks[0])
        if self.hooks or (self.bounds.adaptive and step == 0):
            view.candidates, view.confidence = self._candidates(view)
        return view

    def _block_logits(self, view: StepView, index: Tensor, valid: Tensor) -> Tensor:
        """``[R, W, V]`` the policy's logits of each row's block window; dropped positions (EoTP) decided EOS."""
        block = self.bounds.window_logits(view.logits, view.first, index, valid)
        return block if self.eot is None else self.eot.mark_dropped(block, index, view.rows, view.rows_h)

    def _commit(self, view: StepView, out: Any, index: Tensor, valid: Tensor) -> None:
        """Write the policy's block windows into the rows' canvas; ``view.accepted``: the positions that count as
        accepted for end-of-text prediction."""
        L = self.options.gen_length
        written = to_canvas(valid, index, valid, L, False)
        view.canvas = torch.where(written, to_canvas(out.prev_sample, index, valid, L, -1), view.canvas)
        accepted = out.accepted if out.accepted is not None else out.transfer_index
        view.accepted = to_canvas(accepted & valid, index, valid, L, False)

    def _candidates(self, view: StepView) -> tuple[Tensor, Tensor]:
        """``[R, L]`` candidates and their confidences ``softmax(ℓ)[x̂]`` (float64) at the masked positions the forward
        computed (``-1`` / ``-inf`` elsewhere), with the policy's noise keys, so they are the candidates the policy
        draws at those positions in this step."""
        logits, first, rows = view.logits, view.first, view.rows
        want = view.masked & view.computed
        width = logits.shape[1]
        flat = want[:, first: first + width].reshape(-1).nonzero().squeeze(1)
        b, j = flat // width, flat % width
        noise = None
        if self.options.temperature > 0:
            noise = RowNoise(self.seeds[rows][b], j + first, self.nfe[rows][b])
        cand = unmask_candidates(logits, float(self.options.temperature), None, self.masks[0], None, noise=noise,
                                 rows=flat)
        tokens = torch.full(want.shape, -1, dtype=torch.long, device=want.device)
        tokens[b, j + first] = cand.tokens
        confidence = torch.full(want.shape, float("-inf"), dtype=torch.float64, device=want.device)
        confidence[b, j + first] = cand.confidence
        return tokens, confidence

    def _report(self, view: StepView, out: Any, step: int, index: int) -> None:
        """The step callback (:func:`vispec.dllm.decode`'s ``callback``), and its edit."""
        canvas = self.x[:, self.prompt_len:]
        decided = canvas != self.ids.mask
        details = {"block": index, "step_in_block": step, "rows": view.rows.clone(),
                   "transfer_index": out.transfer_index.clone(), **self.bounds.details(view.rows)}
        for hook in self.hooks:
            details.update(hook.details(view.rows))
        edit, self.interrupted = report_progress(self.callback, self.global_step - 1, canvas, decided, details)
        if edit is not None:
            apply_edit(edit, self.x, self.prompt_len, self.ids.mask, view.logits.shape[-1], self.cache.guidance)

    # ------------------------------------------------------------------ result
    def output(self) -> DecodeOutput:
        """The decode's :class:`vispec.outputs.DecodeOutput` (:func:`vispec.dllm.decode`)."""
        tokens = self.x[:, self.prompt_len:]
        if self.eot is not None:
            tokens = self.eot.finish(tokens)
        extra: dict = {}
        labels = {"scheduler": type(self.scheduler).__name__, "cache": self.options.cache}
        for part in (*self.hooks, self.bounds):
            part.report(extra, labels)
        return decode_output(self, tokens, labels, extra, prompt_tokens=self.x[:, :self.prompt_len].clone())


def decode_output(loop: Any, tokens: Tensor, labels: dict, extra: dict,
                  prompt_tokens: Optional[Tensor] = None) -> DecodeOutput:
    """A text decoder's :class:`vispec.outputs.DecodeOutput` from its answer ``tokens [B, L]``, ``labels`` and ``extra``
    statistics and the state every loop keeps (:class:`BlockLoop`, :class:`vispec.dllm.block_causal.BlockCausalLoop`,
    :class:`vispec.dllm.speculative.SpeculativeLoop`): ``start_time``, ``finished_at [B]`` (NaN: still running, so
    now), ``interrupted``, ``nfe [B]``, ``ids`` and ``scheduler``."""
    elapsed = time.perf_counter() - loop.start_time
    finished_at = torch.where(torch.isnan(loop.finished_at), torch.full_like(loop.finished_at, elapsed), loop.finished_at)
    if loop.interrupted:
        labels["interrupted"] = True
    stats = DecodeStats(nfe=loop.nfe.cpu(), tokens=count_tokens(tokens, loop.ids.eos, loop.ids.eot).cpu(),
                        latency_s=finished_at, extra=extra)
    method = getattr(loop.scheduler, "strategy", "") or type(loop.scheduler).__name__
    return DecodeOutput(tokens=tokens, stats=stats, method=method, labels=labels, prompt_tokens=prompt_tokens)


def eos_filled(canvas: Tensor, eos_id: int, mask_id: Optional[int]) -> Tensor:
    """Early stop on a canvas ``[R, L]``: masked positions after each row's first EOS become EOS (every position
    after it with ``mask_id=None``: a uniform-corruption canvas that is finished, as DiffusionGemma's ``generate``
    ends a canvas at its EOS)."""
    is_eos = canvas == eos_id
    after = is_eos.long().cumsum(dim=1) - is_eos.long() > 0  # strictly after the first EOS
    if mask_id is not None:
        after &= canvas == mask_id
    return torch.where(after, torch.full_like(canvas, eos_id), canvas)


def fill_after_eos(x: Tensor, rows: Tensor, prompt_len: int, eos_id: int, mask_id: Optional[int]) -> None:
    """Early stop in place: masked positions (all with ``mask_id=None``) after each of ``rows``' first committed EOS
    become EOS."""
    x[rows, prompt_len:] = eos_filled(x[rows, prompt_len:], eos_id, mask_id)


def count_tokens(sequences: Tensor, eos_id: Optional[int], eot_id: Optional[int]) -> Tensor:
    """Generated tokens per row before the first EOS, EOS and EoT excluded (spec ``dllm.md`` §16.4)."""
    keep = torch.ones_like(sequences, dtype=torch.bool)
    if eos_id is not None:
        keep &= (sequences == eos_id).long().cumsum(dim=1) == 0
    if eot_id is not None:
        keep &= sequences != eot_id
    return keep.sum(dim=1)
