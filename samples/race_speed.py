"""Time the keyed exponential race on CPU: eager composition vs the compiled Philox (vispec.kernels.race).

    .venv/bin/python samples/race_speed.py [--threads 1] [--rounds 7] [--calls 50]

Prints the first call (lazy compile; inductor's on-disk cache makes later processes faster), then per
shape the median over ``--rounds`` rounds of the mean time per call, for the race (``keyed_race`` vs
``sample_from_weights(w, exponentials(...))``) and for the noise alone (``keyed_exponentials``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from vispec.kernels import race
from vispec.kernels.verify import sample_from_weights

SHAPES = ((2, 1024), (32, 1024), (2, 16384), (32, 16384))


def per_call_ms(fn: Callable[[], object], rounds: int, calls: int) -> float:
    """Median over rounds of the mean milliseconds per call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    race.set_fused(True)  # the fused path is opt-in (race.DEFAULT); this script times it
    gen = torch.Generator().manual_seed(0)

    def keys(rows: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen), torch.randint(0, 4096, (rows,), generator=gen),
                torch.full((rows,), 3), torch.randint(0, 64, (rows,), generator=gen))

    start = time.perf_counter()
    race.keyed_race(torch.rand(2, 8), *keys(2))
    print(f"first call (compile): {time.perf_counter() - start:.2f} s   torch threads: {args.threads}   "
          f"fused: {race.fused_enabled()}   load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'shape':>12} | {'race eager ms':>13} {'fused ms':>9} {'ratio':>6} | "
          f"{'noise eager ms':>14} {'fused ms':>9} {'ratio':>6}")
    for rows, vocab in SHAPES:
        k = keys(rows)
        w = torch.rand(rows, vocab, generator=gen)
        assert torch.equal(race.keyed_race(w, *k), sample_from_weights(w, race.eager_exponentials(*k, vocab)))
        calls = max(2, args.calls * 2048 // (rows * vocab))
        eager_calls = max(2, calls // 8)
        race_eager = per_call_ms(lambda: sample_from_weights(w, race.eager_exponentials(*k, vocab)), args.rounds, eager_calls)
        race_fused = per_call_ms(lambda: race.keyed_race(w, *k), args.rounds, calls)
        noise_eager = per_call_ms(lambda: race.eager_exponentials(*k, vocab), args.rounds, eager_calls)
        noise_fused = per_call_ms(lambda: race.keyed_exponentials(*k, vocab), args.rounds, calls)
        print(f"{f'[{rows}, {vocab}]':>12} | {race_eager:13.3f} {race_fused:9.3f} {race_eager / race_fused:6.1f} | "
              f"{noise_eager:14.3f} {noise_fused:9.3f} {noise_eager / noise_fused:6.1f}")


if __name__ == "__main__":
    main()
