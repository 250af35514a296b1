"""The block loop of :func:`vispec.dllm.decode` for block-causal models (LLaDA2), with an exact KV cache.

A block-diffusion model (LLaDA2.0 / 2.1; :mod:`vispec.models.llada2`) attends block-causally: the sequence splits
into blocks of ``Lb`` positions counted from the row's first real token, and a position sees its own block and the
blocks before it. Decoding follows LLaDA2's ``generate`` and diffusers' ``LLaDA2Pipeline``: a row with ``P`` prompt
tokens has its canvas ``[prompt ; mask^L ; mask^tail]`` cut into blocks from position 0, where the tail pads the last
block to a whole one (``tail = ⌈(P + L) / Lb⌉ Lb - P - L``). The first decoded block is block ``⌊P / Lb⌋``, which
may start inside the prompt (its prompt positions are read, never written); the tail is decoded like the rest but
hidden as a key from every query, and cut from the result. Block ``k``'s steps forward the canvas up to its end under
the block-causal mask and let the policy (:mod:`vispec.dllm.schedulers`, :mod:`vispec.dllm.editing`) commit inside
the block.

**Caches.** ``cache="none"`` forwards positions ``[0, e)`` every step (what diffusers does). ``cache="prefix"`` keeps
the keys and values of the finished blocks (:meth:`vispec.models.llada2.LLaDA2MoeModelLM.forward_cached`): a block's
first step forwards the previous block together with it (the previous block's queries see only its own past, so its
K/V are written from its final tokens), later steps forward the block alone against the cache. Under block-causal
attention a finished block's K/V never change, so this cache is exact: the logits equal the uncached forward's up to
float rounding of the different matmul shapes (tested token for token). A step callback that edits an earlier block
moves that row's cache back to the edited block. ``"dual"`` and ``"dkv"`` approximate a bidirectional suffix this
attention does not have and are refused.

**Batches.** Each row is laid out as it is alone: its blocks start at its own first real token and its RoPE positions
count from it (left padding removed), then rows are shifted by whole blocks so that their first decoded blocks line up
in round 0; a row with one block fewer sits out the last round. So a row's tokens and NFE are those it gets alone.
Within a round each row runs its policy's steps until its own rule ends the block (adaptive policies: no mask left;
LLaDA's quota: ``steps / K`` steps; the editing policy: :meth:`~vispec.dllm.editing.TokenEditingScheduler.block_continues`).
diffusers' ``LLaDA2Pipeline`` runs the whole batch until every row's rule ends and counts steps for the batch, and
aligns blocks to the padded batch; its tokens equal vispec's for unpadded batches whenever rows that stop early have
reached a fixed point (always with editing off).

**Early stop** (``early_stop_eos``, LLaDA2's ``eos_early_stop``): a row finishes when a step commits or edits an EOS
and the row's first EOS lies after its prompt with no mask before it (diffusers' ``check_eos_finished``); it then
spends no more forwards, and its masks after that EOS become EOS (diffusers leaves them as mask ids).

**Self-speculation** (``speculative=k``; :class:`vispec.dllm.block_causal_speculative.BlockCausalSpeculativeLoop`) returns this
loop's tokens with fewer forwards, over either cache. The pieces are shared so that both follow one rule: the layout
(:class:`BlockCausalLayout`), the step ``S`` with its early stop and block-end rule (:class:`BlockCausalRule`, a
function of the logits, the canvas, the row's counters and its keyed noise, editing included) and the model calls
(:class:`BlockForwards`).

Every forward counts one NFE for every row it serves. Stats gain ``edits`` (T2T edits per row) with the editing
policy; labels gain ``"attention": "block_causal"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from vispec.dllm.callback import apply_edit, report_progress
from vispec.dllm.caches import Guidance
from vispec.dllm.editing import TokenEditingScheduler
from vispec.dllm.loop import decode_output, eos_filled
from vispec.dllm.options import UnmaskingOptions
from vispec.dllm.schedulers import UnmaskingScheduler, UnmaskNoise
from vispec.dllm.tokens import TokenIds, token_masks
from vispec.models.llada2 import block_causal_mask
from vispec.outputs import DecodeOutput, StepCallback
from vispec.sampling import STATUS_NAN, STATUS_OK, raise_status

CACHES = ("none", "prefix")


def is_block_causal(model: Any) -> bool:
    """Whether ``model`` attends block-causally (LLaDA2 layout: ``attention_layout == "block_causal"``)."""
    return getattr(model, "attention_layout", None) == "block_causal"


def check_block_causal(model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], options: UnmaskingOptions,
                       mask_id: int) -> None:
    """What block-causal decoding does not support is refused, naming the option (before any forward)."""
    if options.cache not in CACHES:
        raise ValueError(f"cache={options.cache!r} does not apply to a block-causal model ({type(model).__name__}): "
                         "finished blocks never see later ones, so cache='prefix' caches them exactly; pass 'prefix' "
                         "or 'none'")
    refused = [(options.guidance_scale != 1, "guidance_scale != 1 (no unconditional branch for block-causal models)"),
               (options.compile, "compile=True"), (options.eotp, "eotp=True"),
               (options.early_commit is not None, "early_commit (Prophet)"),
               (options.adaptive_block is not None, "adaptive_block (AdaBlock): LLaDA2's blocks are fixed by training")]
    for bad, name in refused:
        if bad:
            raise ValueError(f"{name} is not supported with the block-causal model {type(model).__name__}")
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if bool((real.long().diff(dim=1) < 0).any()):
        raise ValueError("attention_mask must mark left padding (each row's real tokens last) for a block-causal model")
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is not None:
        Lb = options.block_length
        longest = int((((real.sum(dim=1) + options.gen_length + Lb - 1) // Lb) * Lb).max())
        if longest > context:
            raise ValueError(f"prompt + gen_length, rounded up to whole blocks of {Lb}, reaches {longest} positions, "
                             f"beyond the model's max_position_embeddings ({context})")
    if bool(((input_ids == mask_id) & real).any()):
        raise ValueError(f"input_ids contain the mask token {mask_id}: prompt infilling is not supported with the "
                         f"block-causal model {type(model).__name__} (its blocks before the first decoded one are "
                         "read, never written)")


class BlockCausalLayout:
    """Where each row's tokens sit on the block-aligned canvas (module docstring, *Batches*): all ``[B]`` or
    ``[B, N]`` tensors over canvas positions ``0 .. N - 1``, ``N = Lb (first_block + rounds)``.

    ``prompt_len`` real prompt tokens per row; ``num_blocks`` blocks each row decodes; ``first_block`` the canvas block
    of round 0; ``rounds`` the most blocks a row decodes; ``rel`` position within the row's own sequence; ``positions``
    its RoPE positions; ``decodable`` the generated and tail positions; ``key_visible`` prompt and generated positions
    (the tail is hidden as a key); ``gen_index [B, L]`` the answer's canvas positions; ``canvas`` the canvas before
    the first step (prompt, then masks).
    """

    def __init__(self, input_ids: Tensor, attention_mask: Optional[Tensor], options: UnmaskingOptions, mask_id: int):
        device = input_ids.device
        width = input_ids.shape[1]
        Lb, L = options.block_length, options.gen_length
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(device).bool())
        self.prompt_len = real.sum(dim=1)  # [B] real prompt tokens (left padding)
        prefill = self.prompt_len // Lb  # blocks wholly inside the prompt
        self.num_blocks = (self.prompt_len % Lb + L + Lb - 1) // Lb  # blocks each row decodes
        first = int(prefill.max())
        self.first_block, self.rounds, self.block_length = first, int(self.num_blocks.max()), Lb
        offset = Lb * (first - prefill)  # canvas index of each row's first real token
        self.index = torch.arange(Lb * (first + self.rounds), device=device)
        self.rel = self.index[None] - offset[:, None]  # position within the row's own sequence
        P = self.prompt_len[:, None]
        is_prompt = (self.rel >= 0) & (self.rel < P)
        self.decodable = (self.rel >= P) & (self.rel < Lb * (prefill + self.num_blocks)[:, None])  # gen and tail
        self.key_visible = is_prompt | ((self.rel >= P) & (self.rel < P + L))
        source = (width - P + self.rel).clamp(0, width - 1)
        self.canvas = torch.where(is_prompt, input_ids.gather(1, source), torch.full_like(self.rel, mask_id))
        self.positions = self.rel.clamp(min=0)
        self.gen_index = offset[:, None] + P + torch.arange(L, device=device)  # [B, L] canvas of the answer

    def block_index(self, block: Tensor) -> Tensor:
        """``[R, Lb]`` canvas positions of round ``block [R]``'s block (clamped to the last round)."""
        start = (self.first_block + block.clamp(max=self.rounds - 1)) * self.block_length
        return start[:, None] + torch.arange(self.block_length, device=block.device)


class BlockForwards:
    """The model calls of block-causal decoding: ``[R, Lb, V]`` logits of a block from canvases ``[R, >= end]`` of
    batch rows ``rows`` (module docstring, *Caches*). With ``cache="prefix"`` a writing call (every step of the stepwise
    loop, the first step of a block under self-speculation) forwards from the rows' oldest position whose cached K/V
    are not final and writes the span's K/V into the rows' cache; a reading call (self-speculation's verification,
    several canvases per row) forwards only the block against a copy of the rows' cached prefix."""

    def __init__(self, model: Any, layout: BlockCausalLayout, cache: str):
        self.model, self.layout = model, layout
        batch, length = layout.canvas.shape
        self.cache = model.new_kv_cache(batch, length) if cache == "prefix" else None
        self.cached_upto = [0] * batch  # per row: canvas positions whose cached K/V are final (host ints)

    def __call__(self, canvas: Tensor, rows: Tensor, start: int, end: int, write: bool = True) -> Tensor:
        layout = self.layout
        visible = layout.key_visible[rows, :end]
        if self.cache is None:
            mask = block_causal_mask(layout.index[:end], layout.index[:end], layout.block_length, visible)
            logits = self.model(canvas[:, :end], attention_mask=mask, position_ids=layout.positions[rows, :end]).logits
            return logits[:, start:]
        if not write:  # k canvases of a row share its cache: each reads a copy of the prefix
            mask = block_causal_mask(layout.index[start:end], layout.index[:end], layout.block_length, visible)
            return self.model.forward_cached(canvas[:, start:end], layout.positions[rows, start:end],
                                             self.cache.select(rows, end), start, mask).logits
        rows_h = rows.tolist()
        lo = min(self.cached_upto[b] for b in rows_h)
        mask = block_causal_mask(layout.index[lo:end], layout.index[:end], layout.block_length, visible)
        every = rows_h == list(range(len(self.cached_upto)))
        logits = self.model.forward_cached(canvas[:, lo:end], layout.positions[rows, lo:end], self.cache, lo, mask,
                                           rows=None if every else rows).logits
        for b in rows_h:
            self.cached_upto[b] = start  # everything before the block was just written from final tokens
        return logits[:, start - lo:]


@dataclass
class BlockStep:
    """One step of :class:`BlockCausalRule` on ``R`` rows: the new canvases ``[R, N]``, the policy's output, its T2T
    edits ``[R, Lb]`` (editing policy, else None), whether the block had a mask before the step (``had``), the row's
    updated counters (``step``: steps that began with masks; ``post``: the others), ``finished`` (early stop) and
    whether the block runs another step (``continues``)."""

    canvas: Tensor
    out: Any
    edited: Optional[Tensor]
    had: Tensor
    step: Tensor
    post: Tensor
    finished: Tensor
    continues: Tensor


class BlockCausalRule:
    """The stepwise block-causal sampler's step, ``x_{t+1} = S_t(ℓ_t, x_t)``, on rows each in its own block: the
    policy's step on the block with the row's noise key (seed, position in the answer, the row's step count ``draws``),
    early stop at EOS, and the rule that ends the block (module docstring). :class:`BlockCausalLoop` runs it step by
    step; self-speculation (:class:`vispec.dllm.block_causal_speculative.BlockCausalSpeculativeLoop`) applies the same function to
    stale logits to draft and to fresh ones to verify, so both follow one rule."""

    def __init__(self, layout: BlockCausalLayout, scheduler: UnmaskingScheduler, options: UnmaskingOptions,
                 ids: TokenIds, seeds: Tensor):
        self.layout, self.scheduler, self.options, self.ids, self.seeds = layout, scheduler, options, ids, seeds
        self.editing = isinstance(scheduler, TokenEditingScheduler)
        self.cap = scheduler.steps_per_block if scheduler.fixed_steps else layout.block_length
        self.masks: Optional[tuple] = None  # (proposal_mask, confidence_mask), set from the first logits

    def masked(self, rows: Tensor, canvas: Tensor, index: Tensor) -> Tensor:
        """``[R]`` decodable masked positions of each row's block (``index [R, Lb]``)."""
        return ((canvas.gather(1, index) == self.ids.mask) & self.layout.decodable[rows].gather(1, index)).sum(dim=1)

    def step(self, rows: Tensor, canvas: Tensor, index: Tensor, logits: Tensor, step: Tensor, post: Tensor,
             masked0: Tensor, draws: Tensor, finished: Tensor) -> BlockStep:
        """``S`` on batch rows ``rows`` with canvases ``canvas [R, N]``, blocks ``index [R, Lb]`` and their logits
        ``[R, Lb, V]`` (EOS already suppressed when ``logits_eos_inf``); ``step`` / ``post``: the block's counters,
        ``masked0`` its masked count when it began, ``draws`` the row's steps so far (the noise key)."""
        layout, mask = self.layout, self.ids.mask
        sample = canvas.gather(1, index)
        decodable = layout.decodable[rows].gather(1, index)
        had = ((sample == mask) & decodable).any(dim=1)
        post = post + (~had).long()
        kwargs = {"editable": decodable & (sample != mask)} if self.editing else {}
        positions = layout.rel[rows].gather(1, index) - layout.prompt_len[rows, None]
        out = self.scheduler.step(logits, step, sample, mask_token_id=mask, temperature=float(self.options.temperature),
                                  noise=UnmaskNoise(self.seeds[rows], positions, draws),
                                  num_masked_at_block_start=masked0, proposal_mask=self.masks[0],
                                  confidence_mask=self.masks[1], **kwargs)
        canvas = canvas.scatter(1, index, out.prev_sample)
        edited = getattr(out, "editing_transfer_index", None)
        if self.options.early_stop_eos:
            finished = self.eos_finished(rows, canvas, out, edited, index[:, -1] + 1, finished)
        step = step + had.long()
        if self.editing:
            continues = self.scheduler.block_continues(had, step, post, edited.any(dim=1))
        else:
            continues = (self.masked(rows, canvas, index) > 0) & (step < self.cap)
        return BlockStep(canvas, out, edited, had, step, post, finished, continues & ~finished)

    def eos_finished(self, rows: Tensor, canvas: Tensor, out: Any, edited: Optional[Tensor], end: Tensor,
                     finished: Tensor) -> Tensor:
        """diffusers' ``check_eos_finished`` per row (module docstring), batched, on canvas positions before ``end``."""
        layout, eos = self.layout, self.ids.eos
        changed = out.transfer_index if edited is None else out.transfer_index | edited
        committed_eos = (changed & (out.sampled_tokens == eos)).any(dim=1) & ~finished
        rel, P = layout.rel[rows], layout.prompt_len[rows, None]
        upto = layout.index[None] < end[:, None]
        is_eos = (canvas == eos) & (rel >= 0) & upto
        has = is_eos.any(dim=1)
        first = torch.where(has, is_eos.long().argmax(dim=1), end)
        after_prompt = (rel.gather(1, first.clamp(max=canvas.shape[1] - 1)[:, None]) >= P).squeeze(1) & has
        before = (layout.index[None] < first[:, None]) & (rel >= P)
        no_mask_before = ~((canvas == self.ids.mask) & before).any(dim=1)
        return finished | (committed_eos & after_prompt & no_mask_before)

    def logits(self, model: Any, logits: Tensor) -> Tensor:
        """The logits a step reads: EOS suppressed with ``logits_eos_inf`` (in place); the token masks set once."""
        if self.options.logits_eos_inf:
            logits[..., self.ids.eos] = float("-inf")
        if self.masks is None:
            self.masks = token_masks(model, logits.shape[-1], self.ids, logits.device,
                                     self.options.confidence_eos_eot_inf, self.options.suppress_mask_token)
        return logits


class BlockCausalLoop:
    """One block-causal decode's state and loop (module docstring)."""

    def __init__(self, model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], options: UnmaskingOptions,
                 ids: TokenIds, scheduler: UnmaskingScheduler, seeds: Tensor, callback: Optional[StepCallback]):
        self.model, self.options, self.ids, self.scheduler, self.seeds, self.callback = (
            model, options, ids, scheduler, seeds, callback)
        self.input_ids = input_ids
        device = input_ids.device
        batch = input_ids.shape[0]
        self.layout = layout = BlockCausalLayout(input_ids, attention_mask, options, ids.mask)
        self.rule = BlockCausalRule(layout, scheduler, options, ids, seeds)
        self.forwards = BlockForwards(model, layout, options.cache)
        self.x = layout.canvas.clone()
        self.block_length, self.editing = layout.block_length, self.rule.editing
        self.nfe = torch.zeros(batch, dtype=torch.long, device=device)
        self.edits = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.finished_at = torch.full((batch,), float("nan"), dtype=torch.float64)
        self.nan = torch.zeros((), dtype=torch.bool, device=device)
        self.global_step, self.interrupted, self.start_time = 0, False, time.perf_counter()
        self.guidance = Guidance(1.0, 0, ids.mask)  # an edit callback's guidance_scale is refused through it
        # speculative="auto" handed this decode over: its steps (a block's first not, under the cache) timed, (rows, s)
        self.step_timer: Optional[Callable[[int, float], None]] = None
        self.step_clock: Callable[[], float] = time.perf_counter

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        for r in range(self.layout.rounds):
            if self.interrupted:
                break
            self._round(r)
            raise_status(torch.where(self.nan, STATUS_NAN, STATUS_OK))  # one read-back per round

    def _round(self, r: int) -> None:
        """Round ``r``: every row's ``r``-th decoded block, step by step, until each row's rule ends it."""
        layout, Lb = self.layout, self.block_length
        start = (layout.first_block + r) * Lb
        end = start + Lb
        batch = self.x.shape[0]
        index = layout.block_index(torch.full((batch,), r, dtype=torch.long, device=self.x.device))
        going = (layout.num_blocks > r) & ~self.finished
        steps = torch.zeros_like(self.nfe)
        post = torch.zeros_like(self.nfe)
        every = torch.arange(batch, device=self.x.device)
        masked_at_start = self.rule.masked(every, self.x, index)
        first = True  # the block's first step: under the prefix cache it writes the previous block's K/V (untimed)
        while True:
            if not self.editing:  # a complete block needs no more forwards (a callback may have completed it)
                going &= (self.rule.masked(every, self.x, index) > 0) & (steps < self.rule.cap)
            rows = going.nonzero().squeeze(1)
            if rows.numel() == 0:
                return
            timed = self.step_timer is not None and not (first and self.options.cache == "prefix")
            started, first = (self.step_clock() if timed else None), False
            logits = self._forward(rows, start, end)
            step = self.rule.step(rows, self.x[rows], index[rows], logits, steps[rows], post[rows],
                                  masked_at_start[rows], self.nfe[rows], self.finished[rows])
            self.x[rows] = step.canvas
            self.nfe[rows] += 1
            if step.edited is not None:
                self.edits[rows] += step.edited.sum(dim=1)
            self.finished[rows] = step.finished
            steps[rows], post[rows], going[rows] = step.step, step.post, step.continues
            done = rows[~step.continues]
            self.finished_at[done.cpu()] = time.perf_counter() - self.start_time
            self.global_step += 1
            if self.callback is not None:
                self._report(rows, step.out, r, int(steps.max()))
            if started is not None:
                self.step_timer(rows.numel(), self.step_clock() - started)
            if self.interrupted:
                return

    # ------------------------------------------------------------------ the pieces of a step
    def _forward(self, rows: Tensor, start: int, end: int) -> Tensor:
        """``[R, Lb, V]`` logits of the block ``[start, end)`` for ``rows`` under the block-causal mask."""
        logits = self.forwards(self.x[rows], rows, start, end)
        self.nan |= torch.isnan(logits).any()
        return self.rule.logits(self.model, logits)

    def _report(self, rows: Tensor, out: Any, r: int, step: int) -> None:
        """The step callback (:func:`vispec.dllm.decode`'s ``callback``) on the rows' answers ``[B, L]``, and its edit."""
        answer = self.x.gather(1, self.layout.gen_index)
        decided = answer != self.ids.mask
        details = {"block": r, "step_in_block": step, "rows": rows.clone(), "transfer_index": out.transfer_index.clone()}
        edited = getattr(out, "editing_transfer_index", None)
        if edited is not None:
            details["editing_transfer_index"] = edited.clone()
        edit, self.interrupted = report_progress(self.callback, self.global_step - 1, answer, decided, details)
        if edit is None:
            return
        canvas = torch.cat([answer[:, :1], answer], dim=1)  # apply_edit's layout: one prompt column, then the answer
        apply_edit(edit, canvas, 1, self.ids.mask, self.model.config.vocab_size, self.guidance)
        changed = canvas[:, 1:] != answer
        if bool(changed.any()):
            self.x.scatter_(1, self.layout.gen_index, canvas[:, 1:])
            gen_index = self.layout.gen_index
            first = torch.where(changed, gen_index, torch.full_like(gen_index, self.x.shape[1])).min(dim=1).values
            block_start = (first // self.block_length * self.block_length).tolist()
            self.forwards.cached_upto = [min(c, s) for c, s in zip(self.forwards.cached_upto, block_start)]

    # ------------------------------------------------------------------ result
    def output(self) -> DecodeOutput:
        tokens = self.x.gather(1, self.layout.gen_index)
        if self.options.early_stop_eos:  # a finished row's masks after its first EOS are EOS
            tokens = torch.where(self.finished[:, None], eos_filled(tokens, self.ids.eos, self.ids.mask), tokens)
        labels = {"scheduler": type(self.scheduler).__name__, "cache": self.options.cache, "attention": "block_causal"}
        extra = {"edits": self.edits.cpu()} if self.editing else {}
        return decode_output(self, tokens, labels, extra, prompt_tokens=self.input_ids.clone())
