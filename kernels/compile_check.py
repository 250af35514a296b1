"""Compile every Triton kernel configuration for NVIDIA targets without a GPU.

``python -m vispec.kernels.compile_check --arch 80 --arch 90 [--kernel PREFIX] [--json FILE]`` runs
``triton.compile`` (Triton IR -> PTX -> cubin with the bundled ``ptxas``) for each entry of the
kernel modules' ``compile_configs()``. This catches what Triton's interpreter accepts but the
compiler rejects (``break``, non-power-of-two ``arange``, type errors). It must run with the
interpreter off (the interpreter replaces kernels before they can be compiled), so tests call it
in a subprocess. ``--kernel`` (repeatable) keeps the configurations whose name starts with a prefix, e.g.
``--kernel multi_verify`` for the recursive rejection sampling kernel alone. ``--progress`` shows a tqdm bar over
the configurations on stderr (a full check takes minutes; ``vispec bench kernels`` passes it when its stderr is a
terminal). ``--spot-arch`` (repeatable) compiles only the first configuration of each kernel for an architecture: a spot
check that the kernels build there, at a tenth of a full pass's cost (the test suite runs every configuration for
sm_90 and this for sm_80). ``--pairwise`` compiles, for the ``--arch`` targets, a pairwise covering of each kernel's
configurations instead of all of them (:func:`pairwise_cover`: every value of every option and every combination of two
options' values is compiled at least once; about a third of the configurations, since the options' branches are
independent ``tl.constexpr`` ifs and a compiler rejection shows with one option or a pair of them). The test suite runs
that for sm_90; ``vispec bench kernels`` compiles every configuration.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import itertools
import time
from typing import Callable, Optional

KERNEL_MODULES = ("vispec.kernels.philox_triton", "vispec.kernels.verify_triton", "vispec.kernels.unmask_triton",
                  "vispec.kernels.multi_verify_triton")
COMPILE_OPTIONS = {"enable_fp_fusion": False}  # the launches use the same option (bitwise-stable rounding)


def kernel_configs() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """``(name, kernel, signature, constexprs)`` of every configuration of every kernel module."""
    configs = []
    for module_name in KERNEL_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue
            raise
        prefix = module_name.rsplit(".", 1)[-1].removesuffix("_triton")
        configs += [(f"{prefix}.{name}", fn, sig, consts) for name, fn, sig, consts in module.compile_configs()]
    return configs


def selected_configs(prefixes: tuple[str, ...] = ()) -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """:func:`kernel_configs` whose name starts with one of ``prefixes`` (all of them if none is given)."""
    return [config for config in kernel_configs() if not prefixes or config[0].startswith(prefixes)]


def first_of_each_kernel(configs: list) -> list:
    """The first configuration of each kernel (the name before ``[``), in order."""
    seen: set[str] = set()
    kept = []
    for config in configs:
        kernel = config[0].split("[")[0]
        if kernel not in seen:
            seen.add(kernel)
            kept.append(config)
    return kept


def options_of(name: str) -> frozenset[tuple[str, str]]:
    """The options a configuration's name lists: ``"verify.sample[fp32,greedy=False]"`` -> ``{("0", "fp32"),
    ("greedy", "False")}`` (an option without ``=`` is keyed by its place); no brackets: no options."""
    inside = name.partition("[")[2].removesuffix("]")
    items = [part.partition("=") for part in inside.split(",")] if inside else []
    return frozenset((key, value) if sep else (str(place), key) for place, (key, sep, value) in enumerate(items))


def pairwise_cover(configs: list) -> list:
    """A greedy pairwise covering of each kernel's configurations, in their order: the kept configurations of a kernel
    hold every option value and every pair of option values (of two options) that any of its configurations holds.
    Greedy set cover: each pick is the configuration adding the most uncovered singles and pairs (the first on ties)."""
    def combos(options: frozenset) -> set:
        items = sorted(options)
        return {(item,) for item in items} | set(itertools.combinations(items, 2))

    kernels: dict[str, list] = {}
    for config in configs:
        kernels.setdefault(config[0].split("[")[0], []).append(config)
    kept = []
    for group in kernels.values():
        wanted = [combos(options_of(config[0])) for config in group]
        uncovered = set().union(*wanted)
        chosen = [0] if not uncovered else []
        while uncovered:
            best = max(range(len(group)), key=lambda i: (len(wanted[i] & uncovered), -i))
            chosen.append(best)
            uncovered -= wanted[best]
        kept += [group[i] for i in sorted(chosen)]
    return kept


def compile_all(arch: int, prefixes: tuple[str, ...] = (), done: Optional[Callable[[dict], None]] = None,
                spot: bool = False, pairwise: bool = False) -> list[dict]:
    """Compile each configuration (those whose name starts with one of ``prefixes``, if given; with ``spot`` only the
    first of each kernel; with ``pairwise`` the :func:`pairwise_cover` of them) for ``GPUTarget("cuda", arch, 32)``;
    one record per configuration, also passed to ``done(record)`` as it is made."""
    import triton
    from triton.backends.compiler import GPUTarget

    from vispec.kernels.backend import interpreter_enabled

    if interpreter_enabled():
        raise RuntimeError("TRITON_INTERPRET=1 is set: kernels are interpreted and cannot be compiled; unset it")
    records = []
    configs = chosen_configs(selected_configs(prefixes), spot, pairwise)
    for name, fn, signature, constexprs in configs:
        start = time.perf_counter()
        try:
            compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", arch, 32), options=COMPILE_OPTIONS)
            ok, error = bool(compiled.asm.get("cubin")), None
        except Exception as exc:  # report every failure, not just the first
            ok, error = False, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        records.append({"kernel": name, "arch": f"sm_{arch}", "ok": ok, "seconds": round(time.perf_counter() - start, 3),
                        "error": error})
        if done is not None:
            done(records[-1])
    return records


def chosen_configs(configs: list, spot: bool, pairwise: bool) -> list:
    """``configs`` as one pass compiles them: the first of each kernel (``spot``), a pairwise covering, or all."""
    return first_of_each_kernel(configs) if spot else pairwise_cover(configs) if pairwise else configs


def _bar(total: int, enabled: bool):
    """tqdm on stderr over ``total`` compilations (disabled: counts silently)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="compiling", unit="kernel", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vispec.kernels.compile_check", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10 (80 = A100, 90 = H100); repeatable")
    parser.add_argument("--kernel", action="append", default=[],
                        help="only configurations whose name starts with this prefix (e.g. multi_verify); repeatable")
    parser.add_argument("--spot-arch", type=int, action="append", default=[],
                        help="compile only the first configuration of each kernel for this architecture; repeatable")
    parser.add_argument("--pairwise", action="store_true",
                        help="for the --arch targets, compile a pairwise covering of each kernel's configurations")
    parser.add_argument("--json", help="write the records to this file")
    parser.add_argument("--progress", action="store_true", help="a progress bar over the configurations on stderr")
    args = parser.parse_args(argv)
    prefixes = tuple(args.kernel)
    arches = [(arch, False) for arch in (args.arch or ([] if args.spot_arch else [80, 90]))]
    arches += [(arch, True) for arch in args.spot_arch if arch not in (args.arch or [])]
    configs = selected_configs(prefixes)
    total = sum(len(chosen_configs(configs, spot, args.pairwise)) for _, spot in arches)
    records = []
    with _bar(total, args.progress) as bar:
        for arch, spot in arches:
            bar.set_description(f"compiling for sm_{arch}{' (one per kernel)' if spot else ''}", refresh=False)
            records += compile_all(arch, prefixes, done=lambda record: bar.update(1), spot=spot, pairwise=args.pairwise)
    failed = [r for r in records if not r["ok"]]
    for record in failed:
        print(f"FAILED {record['kernel']} {record['arch']}: {record['error']}")
    print(f"compiled {len(records) - len(failed)}/{len(records)} kernel configurations "
          f"({', '.join(sorted({r['arch'] for r in records}))}) in {sum(r['seconds'] for r in records):.1f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
