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

Every forward counts one NFE for every row it serves. Stats gain ``edits`` (T2T edits per row) with the editing
policy; labels gain ``"attention": "block_causal"``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

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
               (options.adaptive_block is not None, "adaptive_block (AdaBlock): LLaDA2's blocks are fixed by training"),
               (options.speculative is not None, "speculative (self-speculation)")]
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


class BlockCausalLoop:
    """One block-causal decode's state and loop (module docstring)."""

    def __init__(self, model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], options: UnmaskingOptions,
                 ids: TokenIds, scheduler: UnmaskingScheduler, seeds: Tensor, callback: Optional[StepCallback]):
        self.model, self.options, self.ids, self.scheduler, self.seeds, self.callback = (
            model, options, ids, scheduler, seeds, callback)
        self.input_ids = input_ids
        device = input_ids.device
        batch, width = input_ids.shape
        Lb, L = options.block_length, options.gen_length
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(device).bool())
        self.prompt_len = real.sum(dim=1)  # [B] real prompt tokens (left padding)
        prefill = self.prompt_len // Lb  # blocks wholly inside the prompt
        self.num_blocks = (self.prompt_len % Lb + L + Lb - 1) // Lb  # blocks each row decodes
        first = int(prefill.max())
        self.first_block, self.rounds = first, int(self.num_blocks.max())
        self.offset = Lb * (first - prefill)  # canvas index of each row's first real token
        length = Lb * (first + self.rounds)
        index = torch.arange(length, device=device)
        self.rel = index[None] - self.offset[:, None]  # position within the row's own sequence
        P = self.prompt_len[:, None]
        self.is_prompt = (self.rel >= 0) & (self.rel < P)
        is_gen = (self.rel >= P) & (self.rel < P + L)
        self.decodable = (self.rel >= P) & (self.rel < Lb * (prefill + self.num_blocks)[:, None])  # gen and tail
        self.key_visible = self.is_prompt | is_gen
        source = (width - self.prompt_len[:, None] + self.rel).clamp(0, width - 1)
        self.x = torch.where(self.is_prompt, input_ids.gather(1, source), torch.full_like(self.rel, ids.mask))
        self.positions = self.rel.clamp(min=0)
        self.gen_index = self.offset[:, None] + P + torch.arange(L, device=device)  # [B, L] canvas of the answer
        self.index = index
        self.block_length = Lb
        self.editing = isinstance(scheduler, TokenEditingScheduler)
        self.cache = model.new_kv_cache(batch, length) if options.cache == "prefix" else None
        self.cached_upto = [0] * batch  # per row: canvas positions whose cached K/V are final (host ints)
        self.nfe = torch.zeros(batch, dtype=torch.long, device=device)
        self.edits = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.finished_at = torch.full((batch,), float("nan"), dtype=torch.float64)
        self.masks: Optional[tuple] = None
        self.nan = torch.zeros((), dtype=torch.bool, device=device)
        self.global_step, self.interrupted, self.start_time = 0, False, time.perf_counter()
        self.guidance = Guidance(1.0, 0, ids.mask)  # an edit callback's guidance_scale is refused through it

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        for r in range(self.rounds):
            if self.interrupted:
                break
            self._round(r)
            raise_status(torch.where(self.nan, STATUS_NAN, STATUS_OK))  # one read-back per round

    def _round(self, r: int) -> None:
        """Round ``r``: every row's ``r``-th decoded block, step by step, until each row's rule ends it."""
        Lb = self.block_length
        start = (self.first_block + r) * Lb
        end = start + Lb
        going = (self.num_blocks > r) & ~self.finished
        steps = torch.zeros_like(self.nfe)
        post = torch.zeros_like(self.nfe)
        masked_at_start = ((self.x[:, start:end] == self.ids.mask) & self.decodable[:, start:end]).sum(dim=1)
        cap = Lb if not self.scheduler.fixed_steps else self.scheduler.steps_per_block
        while True:
            block = self.x[:, start:end]
            has_masks = ((block == self.ids.mask) & self.decodable[:, start:end]).any(dim=1)
            going &= has_masks | self.editing  # a complete block without editing needs no more forwards
            if not self.editing:
                going &= steps < cap
            rows = going.nonzero().squeeze(1)
            if rows.numel() == 0:
                return
            had = has_masks[rows]
            post[rows] += (~had).long()
            logits = self._forward(rows, start, end)
            sample = block[rows]
            editable = self.decodable[rows, start:end] & (sample != self.ids.mask)
            kwargs = {"editable": editable} if self.editing else {}
            out = self.scheduler.step(logits, steps[rows], sample, mask_token_id=self.ids.mask,
                                      temperature=float(self.options.temperature),
                                      noise=UnmaskNoise(self.seeds[rows], self.rel[rows, start:end] - self.prompt_len[rows, None],
                                                        self.nfe[rows]),
                                      num_masked_at_block_start=masked_at_start[rows],
                                      proposal_mask=self.masks[0], confidence_mask=self.masks[1], **kwargs)
            self.x[rows, start:end] = out.prev_sample
            self.nfe[rows] += 1
            edited = getattr(out, "editing_transfer_index", None)
            if edited is not None:
                self.edits[rows] += edited.sum(dim=1)
            if self.options.early_stop_eos:
                self._check_finished(rows, out, edited, end)
            steps[rows] += had.long()
            if self.editing:
                going[rows] = self.scheduler.block_continues(had, steps[rows], post[rows], edited.any(dim=1))
            going &= ~self.finished
            done = rows[~going[rows]]
            self.finished_at[done.cpu()] = time.perf_counter() - self.start_time
            self.global_step += 1
            if self.callback is not None:
                self._report(rows, out, r, int(steps.max()))
                if self.interrupted:
                    return

    # ------------------------------------------------------------------ the pieces of a step
    def _forward(self, rows: Tensor, start: int, end: int) -> Tensor:
        """``[R, Lb, V]`` logits of the block ``[start, end)`` for ``rows`` under the block-causal mask."""
        if self.cache is None:
            lo = 0
            mask = block_causal_mask(self.index[:end], self.index[:end], self.block_length,
                                     self.key_visible[rows, :end])
            logits = self.model(self.x[rows, :end], attention_mask=mask, position_ids=self.positions[rows, :end]).logits
        else:
            rows_h = rows.tolist()
            lo = min(self.cached_upto[b] for b in rows_h)
            mask = block_causal_mask(self.index[lo:end], self.index[:end], self.block_length,
                                     self.key_visible[rows, :end])
            logits = self.model.forward_cached(self.x[rows, lo:end], self.positions[rows, lo:end], self.cache, lo, mask,
                                               rows=None if len(rows_h) == self.x.shape[0] else rows).logits
            for b in rows_h:
                self.cached_upto[b] = start  # everything before the block was just written from final tokens
        logits = logits[:, start - lo:]
        self.nan |= torch.isnan(logits).any()
        if self.options.logits_eos_inf:
            logits[..., self.ids.eos] = float("-inf")
        if self.masks is None:
            self.masks = token_masks(self.model, logits.shape[-1], self.ids, logits.device,
                                     self.options.confidence_eos_eot_inf, self.options.suppress_mask_token)
        return logits

    def _check_finished(self, rows: Tensor, out: Any, edited: Optional[Tensor], end: int) -> None:
        """diffusers' ``check_eos_finished`` per row (module docstring), batched."""
        changed = out.transfer_index if edited is None else out.transfer_index | edited
        eos = self.ids.eos
        committed_eos = (changed & (out.sampled_tokens == eos)).any(dim=1) & ~self.finished[rows]
        seq = self.x[rows, :end]
        own = self.rel[rows, :end] >= 0
        is_eos = (seq == eos) & own
        first = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1), torch.full_like(rows, end))
        after_prompt = (self.rel[rows].gather(1, first.clamp(max=end - 1)[:, None]).squeeze(1)
                        >= self.prompt_len[rows]) & is_eos.any(dim=1)
        before = (self.index[:end][None] < first[:, None]) & (self.rel[rows, :end] >= self.prompt_len[rows, None])
        no_mask_before = ~((seq == self.ids.mask) & before).any(dim=1)
        self.finished[rows] |= committed_eos & after_prompt & no_mask_before

    def _report(self, rows: Tensor, out: Any, r: int, step: int) -> None:
        """The step callback (:func:`vispec.dllm.decode`'s ``callback``) on the rows' answers ``[B, L]``, and its edit."""
        answer = self.x.gather(1, self.gen_index)
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
            self.x.scatter_(1, self.gen_index, canvas[:, 1:])
            first = torch.where(changed, self.gen_index, torch.full_like(self.gen_index, self.x.shape[1])).min(dim=1).values
            block_start = (first // self.block_length * self.block_length).tolist()
            self.cached_upto = [min(c, s) for c, s in zip(self.cached_upto, block_start)]

    # ------------------------------------------------------------------ result
    def output(self) -> DecodeOutput:
        tokens = self.x.gather(1, self.gen_index)
        if self.options.early_stop_eos:  # a finished row's masks after its first EOS are EOS
            tokens = torch.where(self.finished[:, None], eos_filled(tokens, self.ids.eos, self.ids.mask), tokens)
        labels = {"scheduler": type(self.scheduler).__name__, "cache": self.options.cache, "attention": "block_causal"}
        extra = {"edits": self.edits.cpu()} if self.editing else {}
        return decode_output(self, tokens, labels, extra, prompt_tokens=self.input_ids.clone())
