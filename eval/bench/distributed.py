"""Running one evaluation on several processes (``torchrun`` / ``accelerate launch``; gloo on CPU, NCCL on GPU).

Every random number vispec draws is keyed by the item (an image's generator is seeded ``base + i``; a text
problem is the ``i``-th of a seeded stream), so a result never depends on which process computed it. What must
also not depend on the world size is the float arithmetic around it: batched matmuls and convolutions may round
differently when a batch holds other items. So the work is cut into **units** that do not depend on the world
size, the global batches ``[u B, (u + 1) B)`` of the item list, and process ``r`` of ``W`` takes the units
``u ≡ r (mod W)``. A unit is always computed whole, with the same composition, whichever process runs it and
however often it is rerun: tokens, images, evaluator features and per-item stats are the same bits for any
``W``, and so is a report computed from them in item order on rank 0.

:class:`Workers` is this process's place among the launched ones, from accelerate's
:class:`~accelerate.PartialState` when the launcher started more than one (``WORLD_SIZE > 1``). A launcher that
starts fewer processes than asked is caught by ``expected`` (the CLI's ``--num-processes``): ``accelerate
launch --cpu --num_processes 2`` starts a single process, for instance, and nothing in that process says two
were asked for; ``torchrun --nproc_per_node 2`` starts two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

import torch

if TYPE_CHECKING:
    from vispec.eval.bench.results import ResultStore

T = TypeVar("T")


def launched_world_size() -> int:
    """``WORLD_SIZE`` as the launcher set it (1 when unset): torchrun and accelerate launch both set it."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the WORLD_SIZE environment variable must be an integer, got {value!r}") from None


@dataclass
class Workers:
    """This process among ``world_size`` (rank ``rank``); one process is ``Workers(0, 1, device)``.

    ``device`` is the device this process computes on: the one asked for on CPU; on CUDA the process's own GPU
    (``cuda:LOCAL_RANK``) when several processes share a machine.
    """

    rank: int
    world_size: int
    device: torch.device
    state: Any = None  # accelerate's PartialState when distributed

    @classmethod
    def start(cls, device: str = "cpu", expected: Optional[int] = None) -> "Workers":
        """Join the process group the launcher set up (none when it started one process).

        Args:
            device: ``cpu``, ``cuda`` or ``cuda:N``; with several processes on CUDA each takes ``cuda:LOCAL_RANK``.
            expected: the number of processes the user launched, or None. A different world size is an error,
                before any work.
        """
        from vispec.eval.bench.report import check_device

        target = check_device(device)
        if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool) or expected < 1):
            raise ValueError(f"num_processes must be an integer >= 1, got {expected!r}")
        world = launched_world_size()
        if expected is not None and world != expected:
            raise ValueError(
                f"num_processes is {expected} but {world} process(es) were started (WORLD_SIZE="
                f"{os.environ.get('WORLD_SIZE', 'unset')}). Launch with `torchrun --nproc_per_node {expected} "
                f"--no-python vispec ...` (`accelerate launch --cpu --num_processes N` starts one process)")
        if world == 1:
            return cls(rank=0, world_size=1, device=target)
        from accelerate import PartialState

        state = PartialState(cpu=target.type == "cpu")
        if state.num_processes != world:
            raise RuntimeError(f"the launcher set WORLD_SIZE={world} but accelerate joined {state.num_processes} "
                               "process(es)")
        return cls(rank=state.process_index, world_size=state.num_processes,
                   device=target if target.type == "cpu" else state.device, state=state)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def my_units(self, num_items: int, unit_size: int) -> list[range]:
        """This process's units: the item ranges ``[u B, (u + 1) B)`` with ``u ≡ rank (mod world_size)``."""
        units = [range(lo, min(lo + unit_size, num_items)) for lo in range(0, num_items, unit_size)]
        return units[self.rank :: self.world_size]

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def gather(self, obj: T) -> Optional[list[T]]:
        """Every process's ``obj`` on rank 0 (in rank order), None elsewhere (pickled; for per-item records)."""
        if not self.distributed:
            return [obj]
        out: Optional[list] = [None] * self.world_size if self.is_main else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every process."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


def one_process_seconds(records: Sequence[dict]) -> float:
    """The wall time one process would take for every item: each unit's wall time (``unit_wall_s``, stored with
    each of its ``unit_size`` items) counted once, whichever process ran it and however many runs it took."""
    return sum(r["unit_wall_s"] / r["unit_size"] for r in records)


def merge_records(parts: Sequence[dict]) -> dict:
    """One ``{item index: record}`` from the processes' gathered parts; an index two processes both report is a
    bug in the split, not something to paper over."""
    merged: dict = {}
    for part in parts:
        clash = merged.keys() & part.keys()
        if clash:
            raise RuntimeError(f"items {sorted(clash)[:5]} were computed by two processes")
        merged.update(part)
    return merged


Item = tuple[dict, dict]  # an item's record (JSON-able) and its tensors (may be empty)


def run_units(workers: Workers, num_items: int, unit_size: int, compute: Callable[[range], dict[int, Item]],
              store: Optional["ResultStore"] = None, group: str = "", tick: Optional[Callable[[int], None]] = None,
              ) -> Optional[list[Item]]:
    """Compute this process's units (:meth:`Workers.my_units`) and bring every item to rank 0.

    ``compute(unit)`` returns ``{index: (record, tensors)}`` for the unit's indices. With a ``store`` each item
    is written under ``group`` as its unit finishes, units already complete there are skipped (a rerun; of a unit
    that a killed run left part-written, the items already stored are recomputed but not rewritten), and
    rank 0 reads every item back from the store after a barrier (multi-node: the store must be on a shared
    file system). Without one the items travel to rank 0 by ``gather_object``. ``tick(n)`` after each unit of
    ``n`` items, computed or skipped.

    Returns every item in index order on rank 0, None on the other ranks.
    """
    mine: dict[int, Item] = {}
    for unit in workers.my_units(num_items, unit_size):
        if store is not None and store.has_all(group, unit):
            if tick is not None:
                tick(len(unit))
            continue
        items = compute(unit)
        if sorted(items) != list(unit):
            raise RuntimeError(f"compute returned items {sorted(items)[:5]}... for the unit {unit}")
        for index in unit:
            if store is not None:
                if not store.has(group, index):  # of a unit a killed run cut short, its finished items stay as written
                    store.write(group, index, *items[index])
            else:
                mine[index] = items[index]
        if tick is not None:
            tick(len(unit))
    if store is not None:
        workers.barrier()
        return [store.read(group, i) for i in range(num_items)] if workers.is_main else None
    parts = workers.gather(mine)
    if parts is None:
        return None
    merged = merge_records(parts)
    return [merged[i] for i in range(num_items)]


def on_main_first(workers: Workers, check: Callable[[], Any]) -> None:
    """Run ``check()`` on rank 0 (creating or checking a run's files), then let the others go on; a ``ValueError``
    or ``OSError`` it raises is raised on every rank, so all of them stop with the same one-line error."""
    error: Optional[str] = None
    if workers.is_main:
        try:
            check()
        except (ValueError, OSError) as err:
            error = str(err)
    error = workers.broadcast(error)
    if error is not None:
        raise ValueError(error)


def open_store(workers: Workers, root: Optional[str], settings: dict) -> Optional["ResultStore"]:
    """The run's :class:`~vispec.eval.bench.results.ResultStore` at ``root`` (None without one): rank 0 creates it or
    checks its settings, then the others open it."""
    if root is None:
        return None
    from vispec.eval.bench.results import ResultStore

    on_main_first(workers, lambda: ResultStore(root, settings))
    return ResultStore(root, settings, create=False)
