"""Exact self-speculation for block-causal models (LLaDA2): :class:`vispec.dllm.speculative.SpeculativeLoop`'s
draft-verify rounds over the stepwise block-causal sampler (:mod:`vispec.dllm.block_causal`).

The step ``S`` is :class:`~vispec.dllm.block_causal.BlockCausalRule`'s (the policy, keyed noise, early stop at EOS and
the editing policy's post steps) and the forwards are :class:`~vispec.dllm.block_causal.BlockForwards`' (the stepwise
run's own, with the same cache). Under block-causal attention a draft canvas differs from the committed one only
inside the current block, and that block's logits depend only on the finished blocks and itself: with
``cache="prefix"`` the ``k`` draft canvases are verified as ``k`` block-sized rows against copies of the row's cached
finished blocks, in one call per block in flight, with no approximation. A chain ends at its block's end; each block
starts with the stepwise run's own first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from vispec.dllm.block_causal import BlockCausalLayout, BlockCausalRule, BlockForwards
from vispec.dllm.loop import decode_output, eos_filled
from vispec.dllm.schedulers import UnmaskingScheduler
from vispec.dllm.speculative import Lanes, SpeculativeLoop
from vispec.dllm.tokens import TokenIds
from vispec.outputs import DecodeOutput, StepCallback

if TYPE_CHECKING:
    from vispec.dllm.draft_length import DraftLengthChooser
    from vispec.dllm.options import UnmaskingOptions


@dataclass
class BlockCausalLanes(Lanes):
    """:class:`Lanes` of a block-causal decode: ``canvas`` is the row's whole block-aligned canvas ``[R, N]``
    (:class:`~vispec.dllm.block_causal.BlockCausalLayout`), ``block`` the round (the row's ``block``-th decoded
    block), ``step`` the block's steps that began with masks, ``post`` the others (the editing policy's post steps),
    ``finished`` early stop at EOS, ``edits`` the row's T2T edits so far."""

    post: Tensor
    finished: Tensor
    edits: Tensor


class BlockCausalSpeculativeLoop(SpeculativeLoop):
    """Self-speculation for block-causal models (LLaDA2; module docstring): the draft-verify rounds of
    :class:`SpeculativeLoop` over the stepwise block-causal sampler (:class:`vispec.dllm.block_causal.BlockCausalLoop`),
    whose step ``S`` is :class:`~vispec.dllm.block_causal.BlockCausalRule`'s and whose forwards are
    :class:`~vispec.dllm.block_causal.BlockForwards`' (the reference's own, with the same cache)."""

    def __init__(self, model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], options: "UnmaskingOptions",
                 ids: TokenIds, scheduler: UnmaskingScheduler, seeds: Tensor, callback: Optional[StepCallback],
                 chooser: Optional[DraftLengthChooser] = None):
        self._setup(model, input_ids, options, ids, scheduler, seeds, callback, chooser)
        self.input_ids = input_ids
        self.layout = layout = BlockCausalLayout(input_ids, attention_mask, options, ids.mask)
        self.rule = BlockCausalRule(layout, scheduler, options, ids, seeds)
        self.forwards = BlockForwards(model, layout, options.cache)
        self.block_length, self.num_blocks = layout.block_length, layout.rounds
        self.per_block = True  # a forward gives the block's logits: a chain ends at its block's end
        self.tokens = layout.canvas.clone()
        self.reported = torch.zeros_like(layout.gen_index, dtype=torch.bool)
        batch = input_ids.shape[0]
        self.edits = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)

    # ------------------------------------------------------------------ the reference's state machine
    def start(self) -> BlockCausalLanes:
        """Every row's lane before its first step: round 0."""
        batch = self.tokens.shape[0]
        rows = torch.arange(batch, device=self.tokens.device)
        zeros = torch.zeros(batch, dtype=torch.long, device=self.tokens.device)
        lanes = BlockCausalLanes(rows, self.tokens.clone(), zeros - 1, zeros, zeros, zeros.clone(), zeros.bool(),
                                 zeros.clone(), zeros.bool(), zeros.clone())
        return self._next_block(lanes, torch.ones_like(lanes.done))

    def _next_block(self, lanes: BlockCausalLanes, moving: Tensor) -> BlockCausalLanes:
        """Lanes ``moving`` go to their next round (``done`` after their last one, or once finished)."""
        block = torch.where(moving, lanes.block + 1, lanes.block)
        zero = torch.zeros_like(lanes.step)
        masked0 = self.rule.masked(lanes.row, lanes.canvas, self.layout.block_index(block))
        done = lanes.done | (moving & ((block >= self.layout.num_blocks[lanes.row]) | lanes.finished))
        return BlockCausalLanes(lanes.row, lanes.canvas, block, torch.where(moving, zero, lanes.step),
                                torch.where(moving, masked0, lanes.masked0), lanes.draws, done,
                                torch.where(moving, zero, lanes.post), lanes.finished, lanes.edits)

    def reference_step(self, lanes: BlockCausalLanes, logits: Tensor,
                       source: Optional[Tensor] = None) -> BlockCausalLanes:
        """``S_t`` on every lane from ``logits[source[i]]`` (``[Lb, V]``, its block's; as
        :meth:`SpeculativeLoop.reference_step`): :meth:`vispec.dllm.block_causal.BlockCausalRule.step`."""
        block_logits = logits if source is None else logits[source]
        if self.options.logits_eos_inf:
            block_logits = block_logits.clone()
        block_logits = self.rule.logits(self.model, block_logits)
        index = self.layout.block_index(lanes.block)
        step = self.rule.step(lanes.row, lanes.canvas, index, block_logits, lanes.step, lanes.post, lanes.masked0,
                              lanes.draws, lanes.finished)
        edits = lanes.edits if step.edited is None else lanes.edits + step.edited.sum(dim=1)
        new = BlockCausalLanes(lanes.row, step.canvas, lanes.block, step.step, lanes.masked0, lanes.draws + 1,
                               lanes.done, step.post, step.finished, edits)
        return self._next_block(new, ~step.continues)

    # ------------------------------------------------------------------ the model
    def refresh(self, lanes: BlockCausalLanes) -> Tensor:
        """The reference's first forward of each lane's block (its step 0): with ``cache="prefix"`` it writes the
        finished blocks' K/V into the row's cache, as the stepwise run's does."""
        return self._blocks(lanes, write=True)

    def span(self, lanes: BlockCausalLanes) -> Tensor:
        """The verifying forward: each canvas's block against its row's cached prefix (a copy per canvas), or the whole
        canvas up to the block's end without a cache; one model call per block in flight."""
        return self._blocks(lanes, write=False)

    def _blocks(self, lanes: BlockCausalLanes, write: bool) -> Tensor:
        parts, order = [], []
        for block in lanes.block.unique().tolist():  # one read-back per call; rows decode a few blocks at once at most
            group = (lanes.block == block).nonzero().squeeze(1)
            start = (self.layout.first_block + block) * self.block_length
            parts.append(self.forwards(lanes.canvas[group], lanes.row[group], start, start + self.block_length, write))
            order.append(group)
        logits = torch.cat(parts)[torch.argsort(torch.cat(order))]
        return self._checked(logits)

    # ------------------------------------------------------------------ results
    def _record(self, lanes: BlockCausalLanes) -> None:
        super()._record(lanes)
        self.edits[lanes.row] = lanes.edits
        self.finished[lanes.row] = lanes.finished

    def _answer(self) -> Tensor:
        return self.tokens.gather(1, self.layout.gen_index)

    def output(self) -> DecodeOutput:
        tokens = self._answer()
        if self.options.early_stop_eos:  # a finished row's masks after its first EOS are EOS
            tokens = torch.where(self.finished[:, None], eos_filled(tokens, self.ids.eos, self.ids.mask), tokens)
        labels = {"scheduler": type(self.scheduler).__name__, "cache": self.options.cache, "attention": "block_causal",
                  "speculative": self._speculation_label()}
        extra = {"steps": self.steps.cpu(), "canvases": self.canvases.cpu()}
        if self.rule.editing:
            extra["edits"] = self.edits.cpu()
        return decode_output(self, tokens, labels, extra, prompt_tokens=self.input_ids.clone())
