"""Side by side with the official LlamaGen ``generate()``: the same model, the same sampling, timed in one process.

    OMP_NUM_THREADS=1 .venv/bin/python samples/official_side_by_side.py --official /tmp/llamagen-official \\
        --batch-sizes 1 --rounds 3 --contenders official-eager,official-compiled,ar-eager,ar-compiled,mc-sjd-compiled \\
        --json /tmp/sbs-b1.json
    OMP_NUM_THREADS=1 .venv/bin/python samples/official_side_by_side.py --official /tmp/llamagen-official \\
        --model tiny-c2i,tiny-c2i@GPT-B --batch-sizes 1,4,16 --json /tmp/sbs.json
    .venv/bin/python samples/official_side_by_side.py --official /tmp/llamagen-official \\
        --contenders official-compiled,ar-compiled,sjd-pac:window=16,tree_width=2,tree_depth=2-compiled

``--official`` is a checkout of the public FoundationVision/LlamaGen repository (a clone, or from a bare mirror:
``git --git-dir=<mirror> archive HEAD autoregressive utils | tar -x -C /tmp/llamagen-official``). Its code is imported at
run time from that path, never copied here: ``autoregressive/models/gpt.py`` (``Transformer``, ``ModelArgs``) and
``autoregressive/models/generate.py`` (``generate``). Import-time shims, applied here and not to their files: the
checkout's root goes on ``sys.path`` (their modules import ``utils.drop_path`` and ``autoregressive.models...``);
``utils/drop_path.py`` is stubbed if the checkout lacks it (only used with ``drop_path_rate > 0``); their
``torch.backends.cuda.sdp_kernel`` (deprecated since torch 2.3, entered on every decode step) has its FutureWarning
silenced, and is replaced by a no-op context if a future torch removes it.

The official model is built at the vispec model's config (``tiny-c2i``, or ``tiny-c2i@GPT-B``: tiny-c2i inflated to
GPT-B's size, :func:`vispec.models.inflate.inflate`, so the official model gets the inflated config and weights) and
loaded strictly from vispec's state dict. Before timing, the script checks it IS the same model: the next-token
logits of both models for the same labels (conditional and null class) and the same token prefix (official: its
KV-cache path, as ``generate`` runs it; vispec: the teacher-forced forward) must agree to ``--atol`` (1e-4), and
greedy generation with CFG (official ``sample_logits=False``; vispec ``ar`` at temperature 0) is compared token by
token (reported, not asserted: a near-tie may flip). ``--dtype bfloat16`` then casts both models, as the official
``sample_c2i.py`` casts its model (its ``--precision`` defaults to bf16), and reports the check again (logit
difference and greedy tokens, not asserted: the two graphs round differently). On a CPU with AMX or AVX512-BF16 a
wide window costs relatively less in bfloat16 (``samples/window_cost.py --dtype bfloat16``).

Contenders (``--contenders``, comma list): ``official-eager`` / ``official-compiled`` (their ``generate`` on their
model; compiled as ``autoregressive/sample/sample_c2i.py --compile`` does: ``torch.compile(gpt_model,
mode="reduce-overhead", fullgraph=True)``, on CPU without CUDA graphs; ``--official-compile step`` compiles their
``decode_one_token`` instead, gpt-fast's way) and ``<vispec decoding spec>-eager`` / ``-compiled`` (``decode(...,
compile=...)``), e.g. ``mc-sjd:window=auto-compiled``; a spec's own commas stay in it (a piece ``key=value``
continues the contender before it). Both sides sample the model's default target (tiny-c2i: CFG 3,
temperature 1, no top-k / top-p) unless ``--guidance-scale`` etc. say otherwise. A contender that fails (an unknown
spec) is reported once and dropped; the others run on.

Timing: every contender is warmed up first (compiles announced on stderr; a shape-choosing decoder, ``auto``, until
its first calls have calibrated its cost curve, kept in the WindowStats each vispec contender keeps between calls). Round ``r`` runs every contender once,
the order rotated by ``r``, on ``--images`` images in batches of the batch size; ``torch.manual_seed(seed + r)``
before each (the official ``generate`` draws from the global RNG), vispec gets one seeded generator per image.
Each run is timed by ``time.perf_counter`` (wall) and ``time.process_time`` (CPU time of this process, all
threads). Speed = official-compiled's time / the contender's, per round (official-eager's if official-compiled
is not run or failed); the table gives the median over rounds
(wall and CPU), seconds per image (median), forwards per image and step compression (image tokens / forwards).
A shape-choosing contender (``auto``, ``window=auto``) also gets its passes per shape over the timed rounds, its
chooser's predicted speed-up over AR (mean over its decodes) and the measured one (median over rounds of the vispec AR
contender's time with the same compile setting, ``ar-compiled`` or ``ar-eager``, over its own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
import types
import warnings
from dataclasses import dataclass
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling official_checkout
from official_checkout import check_official  # noqa: E402

DEFAULT_CONTENDERS = "official-eager,official-compiled,ar-compiled,mc-sjd-compiled,auto-compiled"
BASELINE = "official-compiled"
DTYPES = ("float32", "bfloat16")
OFFICIAL_FILES = ("autoregressive/models/generate.py", "autoregressive/models/gpt.py")
SUFFIXES = (("-compiled", True), ("-eager", False))


@dataclass(frozen=True)
class Contender:
    name: str  # as given: "official-compiled", "mc-sjd:window=auto-compiled"
    official: bool
    spec: Optional[str]  # the vispec decoding spec (None for the official generate)
    compiled: bool


def parse_contender(name: str) -> Contender:
    """``official-eager|official-compiled`` or ``<vispec decoding spec>-eager|-compiled``; ValueError otherwise."""
    name = name.strip()
    for suffix, compiled in SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            break
    else:
        raise ValueError(f"contender {name!r} must end in -eager or -compiled (e.g. official-compiled, "
                         f"mc-sjd-eager, sjd-pac:window=16-compiled)")
    if not base:
        raise ValueError(f"contender {name!r} names no decoder before {suffix!r}")
    if base == "official":
        return Contender(name, True, None, compiled)
    if base.startswith("official"):
        raise ValueError(f"contender {name!r}: the official contenders are official-eager and official-compiled")
    return Contender(name, False, base, compiled)


def split_contenders(text: str) -> list[str]:
    """The comma list of contenders, where a spec's own options stay together: a piece that starts ``key=`` continues
    the contender before it (``sjd-pac:window=16,tree_width=2,tree_depth=2-compiled`` is one contender)."""
    names: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if names and re.match(r"^[A-Za-z_]+=", piece) and ":" in names[-1]:
            names[-1] += "," + piece
        else:
            names.append(piece)
    return names


def _positive_ints(text: str, flag: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag} takes a comma list of positive integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        parser.error(f"{flag} takes a comma list of positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="official_side_by_side.py", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", metavar="PATH",
                        help="a checkout of FoundationVision/LlamaGen (required; its code is imported from there)")
    parser.add_argument("--model", default="tiny-c2i",
                        help="comma list: tiny-c2i or tiny-c2i@<GPT config> (e.g. tiny-c2i@GPT-B); default tiny-c2i")
    parser.add_argument("--batch-sizes", default="1,4,16", help="comma list (default 1,4,16)")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"comma list (default {DEFAULT_CONTENDERS})")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--images", type=int, default=None,
                        help="images per contender per round, a multiple of the batch size (default: the batch size)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--official-compile", choices=("model", "step"), default="model",
                        help="official-compiled: compile their model as sample_c2i.py does (model, default) or their "
                             "decode_one_token as gpt-fast does (step)")
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the model's decoding_config")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--cfg-interval", type=int, default=None)
    parser.add_argument("--atol", type=float, default=1e-4, help="logit agreement required of the two models")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="both models' weights and activations after the float32 identity check (default float32; "
                             "bfloat16 is the official sample_c2i.py's default --precision)")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The checked arguments (no model, no torch for plain model names); exits with a usage error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.official = check_official(parser, args.official, "FoundationVision/LlamaGen", "/tmp/llamagen-official",
                                   OFFICIAL_FILES)
    try:
        args.contenders = [parse_contender(c) for c in split_contenders(args.contenders)]
    except ValueError as err:
        parser.error(f"--contenders: {err}")
    if not args.contenders:
        parser.error("--contenders: name at least one contender")
    names = [c.name for c in args.contenders]
    if len(set(names)) != len(names):
        parser.error(f"--contenders: a contender is named twice in {names}")
    args.batch_sizes = _positive_ints(args.batch_sizes, "--batch-sizes", parser)
    for flag, value in (("--rounds", args.rounds), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.images is not None:
        bad = [b for b in args.batch_sizes if args.images < 1 or args.images % b]
        if bad:
            parser.error(f"--images {args.images} must be a positive multiple of every batch size (not of {bad})")
    from vispec.eval.bench.configs import TRAINED_MODELS, check_inflated_model, split_inflated_name

    args.models = [m.strip() for m in args.model.split(",") if m.strip()]
    if not args.models:
        parser.error("--model: name a model")
    for name in args.models:
        try:
            base, target = split_inflated_name(name)
            if target is not None:
                check_inflated_model(name)
            elif base not in TRAINED_MODELS:
                raise ValueError(f"model {name!r}: expected one of {list(TRAINED_MODELS)} or <model>@<GPT config> "
                                 f"(e.g. {TRAINED_MODELS[0]}@GPT-B)")
        except ValueError as err:
            parser.error(f"--model: {err}")
    return args


# ---------------------------------------------------------------------------------------------- the official code
def import_official(path: str) -> tuple[types.ModuleType, types.ModuleType, list[str]]:
    """Their ``gpt`` and ``generate`` modules, imported from ``path`` with the import-time shims (module docstring)."""
    import torch

    shims = [f"sys.path += {path} (their modules import utils.drop_path and autoregressive.models.*)"]
    if path not in sys.path:
        sys.path.insert(0, path)
    if not os.path.isfile(os.path.join(path, "utils", "drop_path.py")):
        stub = types.ModuleType("utils.drop_path")

        class DropPath(torch.nn.Module):  # never built at drop_path_rate=0 (their TransformerBlock uses Identity)
            def __init__(self, *a, **k):
                raise RuntimeError("utils/drop_path.py is missing from the official checkout (stubbed)")

        stub.DropPath = DropPath
        package = sys.modules.setdefault("utils", types.ModuleType("utils"))
        package.drop_path = stub
        sys.modules["utils.drop_path"] = stub
        shims.append("utils.drop_path stubbed (missing from the checkout)")
    if not hasattr(torch.backends.cuda, "sdp_kernel"):
        torch.backends.cuda.sdp_kernel = lambda **kwargs: contextlib.nullcontext()
        shims.append("torch.backends.cuda.sdp_kernel replaced by a no-op context (removed from this torch)")
    warnings.filterwarnings("ignore", message=r".*sdp_kernel.*", category=FutureWarning)
    shims.append("FutureWarning of torch.backends.cuda.sdp_kernel (entered per decode step) silenced")
    import autoregressive.models.generate as official_generate
    import autoregressive.models.gpt as official_gpt

    for module in (official_gpt, official_generate):
        if not os.path.abspath(module.__file__).startswith(path + os.sep):
            raise RuntimeError(f"{module.__name__} was imported from {module.__file__}, not from --official {path}")
    return official_gpt, official_generate, shims


def official_model(official_gpt: types.ModuleType, gpt) -> tuple[Any, dict]:
    """Their ``Transformer`` at ``gpt``'s config with ``gpt``'s weights (strict, ``freqs_cis`` / KV caches excepted)."""
    import torch

    c = gpt.config
    args = official_gpt.ModelArgs(
        dim=c.dim, n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.n_kv_head, multiple_of=c.multiple_of,
        ffn_dim_multiplier=c.ffn_dim_multiplier, rope_base=c.rope_base, norm_eps=c.norm_eps,
        initializer_range=c.initializer_range, token_dropout_p=0.0, attn_dropout_p=0.0, resid_dropout_p=0.0,
        ffn_dropout_p=0.0, drop_path_rate=0.0, num_classes=c.num_classes, caption_dim=c.caption_dim,
        class_dropout_prob=c.class_dropout_prob, model_type=c.model_type, vocab_size=c.vocab_size,
        cls_token_num=c.cls_token_num, block_size=c.block_size,
    )
    if c.model_type != "c2i":
        raise ValueError(f"only class-conditional models are compared, got model_type={c.model_type!r}")
    with torch.random.fork_rng(devices=[]):  # their init draws from the global RNG
        model = official_gpt.Transformer(args)
    ours = gpt.state_dict()
    theirs = model.state_dict()
    excepted = ("freqs_cis", "kv_cache", "causal_mask")
    missing = sorted(k for k in theirs if k not in ours and not any(e in k for e in excepted))
    unexpected = sorted(k for k in ours if k not in theirs and not any(e in k for e in excepted))
    if missing or unexpected:
        raise RuntimeError(f"state dicts differ: missing in vispec's {missing}, unexpected {unexpected}")
    result = model.load_state_dict({k: v for k, v in ours.items() if k in theirs}, strict=False)
    left = [k for k in result.missing_keys if not any(e in k for e in excepted)]
    if left or result.unexpected_keys:
        raise RuntimeError(f"load_state_dict: missing {left}, unexpected {result.unexpected_keys}")
    ignored = sorted(set(result.missing_keys) | {k for k in ours if k not in theirs})
    return model.eval(), {"keys_loaded": len(theirs) - len(result.missing_keys), "keys_excepted": ignored,
                          "official_args": {k: v for k, v in vars(args).items()}}


def check_same_model(official, gen_mod, gpt, guidance_scale: float, atol: float, prefix_len: int = 24) -> dict:
    """Max |logit difference| over every position of a prefix (conditional and null class, official KV-cache path vs
    vispec's forward), asserted <= atol; then greedy CFG generation of two images compared token by token."""
    import torch

    from vispec.decoding import decode
    from vispec.models.llamagen_gpt import LlamaGenCondition
    from vispec.sampling import SamplingConfig

    n = gpt.num_image_tokens
    labels = torch.tensor([0, 1 % gpt.config.num_classes])
    gen = torch.Generator().manual_seed(1234)
    prefix = torch.randint(0, gpt.config.vocab_size, (2, prefix_len), generator=gen)
    with torch.no_grad():
        ours = torch.cat([
            gpt(prefix, LlamaGenCondition(class_labels=labels), condition_drop=torch.zeros(2, dtype=torch.bool)),
            gpt(prefix, LlamaGenCondition(class_labels=labels), condition_drop=torch.ones(2, dtype=torch.bool)),
        ])  # [4, P + 1, V]
        rows = torch.cat([labels, torch.full_like(labels, gpt.config.num_classes)])
        official.setup_caches(max_batch_size=4, max_seq_length=1 + n, dtype=official.tok_embeddings.weight.dtype)
        steps = [official(None, rows, input_pos=torch.arange(0, 1))[0]]
        tokens = torch.cat([prefix, prefix])
        for t in range(prefix_len):
            steps.append(official(tokens[:, t : t + 1], None, input_pos=torch.tensor([1 + t], dtype=torch.int))[0])
        theirs = torch.cat(steps, dim=1)
    diff = (ours - theirs).abs().max().item()
    if not diff <= atol:
        raise AssertionError(f"the official model's logits differ from vispec's by {diff:.3g} > {atol:g}")
    with torch.no_grad():
        greedy_official = gen_mod.generate(official, labels, n, cfg_scale=guidance_scale, cfg_interval=-1,
                                           temperature=1.0, top_k=0, top_p=1.0, sample_logits=False).long()
        greedy_ours = decode(gpt, LlamaGenCondition(class_labels=labels), num_tokens=n, decoding="ar",
                             sampling=SamplingConfig(guidance_scale=guidance_scale, temperature=0.0)).tokens.long()
    same = (greedy_official == greedy_ours)
    first = [int((~row).nonzero()[0]) if not row.all() else None for row in same]
    return {"max_abs_logit_diff": diff, "positions": prefix_len + 1, "rows": 4, "atol": atol,
            "greedy_tokens_equal": int(same.sum()), "greedy_tokens": same.numel(), "greedy_first_mismatch": first}


# ---------------------------------------------------------------------------------------------- running contenders
class Runner:
    """One contender on one model: ``run(labels, seeds)`` makes ``len(labels)`` images, returns forwards per image."""

    def __init__(self, contender: Contender, gpt, official, gen_mod, sampling: dict, official_compile: str):
        import torch

        self.contender, self.gpt, self.gen_mod, self.sampling = contender, gpt, gen_mod, sampling
        self.model, self.step = official, None
        if contender.official and contender.compiled:
            if official_compile == "model":  # autoregressive/sample/sample_c2i.py --compile
                self.model = torch.compile(official, mode="reduce-overhead", fullgraph=True)
            else:  # gpt-fast: the per-token step
                self.step = torch.compile(gen_mod.decode_one_token, mode="reduce-overhead", fullgraph=True)
        self.window_stats, self.calibrating = None, False
        self.shapes: dict[str, int] = {}  # passes per shape, and the chooser's predicted speed-ups over AR, since reset
        self.predicted: list[float] = []
        if not contender.official:
            from vispec.decoding import DecodingConfig
            from vispec.decoding.windows import WindowStats

            DecodingConfig.parse(contender.spec)  # an unknown spec fails here, before any warm-up
            self.window_stats = WindowStats()  # the choosers' measurements, kept between calls as a pipeline keeps them

    def run(self, labels, seeds: list[int]) -> float:
        import torch

        s = self.sampling
        if self.contender.official:
            original = self.gen_mod.decode_one_token
            if self.step is not None:
                self.gen_mod.decode_one_token = self.step  # decode_n_tokens looks it up in their module
            try:
                self.gen_mod.generate(self.model, labels, self.gpt.num_image_tokens, cfg_scale=s["guidance_scale"],
                                      cfg_interval=s["cfg_interval"], temperature=s["temperature"], top_k=s["top_k"],
                                      top_p=s["top_p"], sample_logits=True)
            finally:
                self.gen_mod.decode_one_token = original
            return float(self.gpt.num_image_tokens)  # prefill + (N - 1) one-token steps
        from vispec.decoding import decode
        from vispec.models.llamagen_gpt import LlamaGenCondition
        from vispec.sampling import SamplingConfig

        with torch.no_grad():
            out = decode(self.gpt, LlamaGenCondition(class_labels=labels), num_tokens=self.gpt.num_image_tokens,
                         sampling=SamplingConfig(**s), decoding=self.contender.spec,
                         generator=[torch.Generator().manual_seed(i) for i in seeds], compile=self.contender.compiled,
                         window_stats=self.window_stats)
        self.calibrating = bool(out.stats.chooser.get("calibrated"))
        for label, passes in (out.stats.shapes or {}).items():
            self.shapes[label] = self.shapes.get(label, 0) + passes
        if out.stats.chooser.get("predicted_speedup") is not None:
            self.predicted.append(out.stats.chooser["predicted_speedup"])
        return float(out.stats.nfe.float().mean())


def cast_both(gpt, official, gen_mod, dtype: str, guidance_scale: float) -> tuple[Any, Any, dict]:
    """Both models cast to ``dtype`` after the float32 identity check, as their sample_c2i.py casts its model
    (``.to(dtype=precision)``); their logits are compared again (reported, not asserted: the two graphs round
    differently in bfloat16) with the greedy tokens."""
    import torch

    torch_dtype = getattr(torch, dtype)
    gpt = torch.nn.Module.to(gpt, dtype=torch_dtype).eval()
    official = official.to(dtype=torch_dtype).eval()
    return gpt, official, check_same_model(official, gen_mod, gpt, guidance_scale, atol=float("inf"))


def load_model(name: str, seed: int):
    import torch

    from vispec.eval.bench.configs import split_inflated_name
    from vispec.pipelines import LlamaGenPipeline

    base, target = split_inflated_name(name)
    pipe = LlamaGenPipeline.from_pretrained(f"vispec/{base}")
    gpt = pipe.transformer
    note = None
    if target is not None:
        from vispec.models.inflate import inflate, inflation_note

        gpt = inflate(gpt, target, seed=seed)
        note = inflation_note(base, gpt.inflation)
    return torch.nn.Module.to(gpt, dtype=torch.float32).eval(), pipe.decoding_config, note


def run_batch_size(args, model_name: str, gpt, runners: dict, batch: int, failed: dict) -> dict:
    import torch

    images = args.images or batch
    labels_all = torch.arange(images) % gpt.config.num_classes
    batches = [(labels_all[i : i + batch], list(range(i, i + batch))) for i in range(0, images, batch)]
    load_start = os.getloadavg()

    def attempt(name: str, round_seed: int, seed_offset: int) -> Optional[tuple[float, float, float]]:
        torch.manual_seed(round_seed)
        try:
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            nfe = [runners[name].run(labels, [seed_offset + s for s in seeds]) for labels, seeds in batches]
            return time.perf_counter() - start_wall, time.process_time() - start_cpu, statistics.fmean(nfe)
        except Exception as err:  # a contender that fails is reported once and dropped
            failed[name] = f"{type(err).__name__}: {err}"
            print(f"[{model_name} b={batch}] contender {name} failed, dropped: {failed[name]}", file=sys.stderr)
            return None

    names = [c.name for c in args.contenders if c.name in runners and c.name not in failed]
    for name in names:  # warm-up: compiles (each shape of a compiled contender)
        compiled = runners[name].contender.compiled
        print(f"[{model_name} b={batch}] warming up {name}" + (" (compiling)" if compiled else ""), file=sys.stderr)
        for k in range(8):  # a second call shows a recompile on fresh caches; auto calibrates its cost curve
            if k >= (2 if compiled else 1) and not runners[name].calibrating:
                break
            result = attempt(name, args.seed, 10**6 + k * images)
            if result is None:
                break
            print(f"[{model_name} b={batch}]   warm-up call {k + 1}: {result[0]:.1f} s", file=sys.stderr)

    names = [n for n in names if n not in failed]
    per = {n: {"wall_s": [], "cpu_s": [], "nfe": []} for n in names}
    for name in names:  # the chooser's figures of the timed rounds only
        runners[name].shapes, runners[name].predicted = {}, []
    for r in range(args.rounds):
        live = [n for n in names if n not in failed]
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for name in order:
            result = attempt(name, args.seed + r, r * images)
            if result is not None:
                per[name]["wall_s"].append(result[0])
                per[name]["cpu_s"].append(result[1])
                per[name]["nfe"].append(result[2])
        done = ", ".join(f"{n} {per[n]['wall_s'][-1] / images:.2f}" for n in order if n not in failed)
        print(f"[{model_name} b={batch}] round {r + 1}/{args.rounds} s/image: {done}", file=sys.stderr)
    load_end = os.getloadavg()

    baseline = next((n for n in (BASELINE, "official-eager") if n in per and n not in failed), None)
    base = per[baseline] if baseline else None
    rows = {}
    for c in args.contenders:
        name = c.name
        if name in failed or name not in per:
            rows[name] = {"error": failed.get(name, "not run")}
            continue
        p = per[name]
        row = {"wall_s": p["wall_s"], "cpu_s": p["cpu_s"],
               "s_per_image_wall": statistics.median(p["wall_s"]) / images,
               "s_per_image_cpu": statistics.median(p["cpu_s"]) / images,
               "forwards_per_image": statistics.fmean(p["nfe"]),
               "step_compression": gpt.num_image_tokens / statistics.fmean(p["nfe"])}
        if base is not None and len(base["wall_s"]) == len(p["wall_s"]):
            row["speed_wall_rounds"] = [b / x for b, x in zip(base["wall_s"], p["wall_s"])]
            row["speed_cpu_rounds"] = [b / x for b, x in zip(base["cpu_s"], p["cpu_s"])]
            row["speed_wall"] = statistics.median(row["speed_wall_rounds"])
            row["speed_cpu"] = statistics.median(row["speed_cpu_rounds"])
        runner = runners[name]
        if (runner.shapes and any(label != "ar" for label in runner.shapes)) or runner.predicted:
            row["shapes"] = dict(sorted(runner.shapes.items(), key=lambda kv: (-kv[1], kv[0])))
            row["predicted_speedup"] = statistics.fmean(runner.predicted) if runner.predicted else None
            ar = per.get("ar-compiled" if c.compiled else "ar-eager")
            if ar is not None and len(ar["wall_s"]) == len(p["wall_s"]):  # over vispec AR of the same compile setting
                row["measured_speedup"] = statistics.median(a / x for a, x in zip(ar["wall_s"], p["wall_s"]))
                if row["predicted_speedup"] is not None:
                    row["prediction_error"] = row["predicted_speedup"] / row["measured_speedup"] - 1
        rows[name] = row
    return {"model": model_name, "batch_size": batch, "images": images, "rounds": args.rounds, "baseline": baseline,
            "load_avg_start": list(load_start), "load_avg_end": list(load_end), "contenders": rows}


def print_table(result: dict, note: Optional[str]) -> None:
    la, lb = result["load_avg_start"], result["load_avg_end"]
    print(f"\n{result['model']}  {result.get('dtype', 'float32')}  batch {result['batch_size']}  "
          f"images/round {result['images']}  rounds {result['rounds']}  load avg {la[0]:.2f} -> {lb[0]:.2f} "
          f"({os.cpu_count()} cores)")
    if note:
        print(f"  {note}")
    width = max(12, *(len(n) for n in result["contenders"]))
    print(f"  {'contender':<{width}} {'s/img wall':>10} {'s/img cpu':>10} {'speed wall':>10} {'speed cpu':>9} "
          f"{'fwd/img':>8} {'compress':>8}")
    for name, row in result["contenders"].items():
        if "error" in row:
            print(f"  {name:<{width}} failed: {row['error'][:100]}")
            continue
        speed = (f"{row['speed_wall']:>9.2f}x {row['speed_cpu']:>8.2f}x" if "speed_wall" in row
                 else f"{'-':>10} {'-':>9}")
        print(f"  {name:<{width}} {row['s_per_image_wall']:>10.3f} {row['s_per_image_cpu']:>10.3f} {speed} "
              f"{row['forwards_per_image']:>8.1f} {row['step_compression']:>7.2f}x")
    for name, row in result["contenders"].items():
        if "shapes" in row:
            predicted, measured = row.get("predicted_speedup"), row.get("measured_speedup")
            figures = (f"predicted {predicted:.2f}x" if predicted is not None else "predicted -") + (
                f", measured {measured:.2f}x ({row['prediction_error']:+.0%})" if "prediction_error" in row
                else f", measured {measured:.2f}x" if measured is not None else "")
            passes = ", ".join(f"{label} {n}" for label, n in row["shapes"].items())
            print(f"  {name}: shapes (passes) {passes}; speed-up over vispec AR: {figures}")
    if result["baseline"]:
        print(f"  speed = {result['baseline']} time / contender time, median of per-round ratios")
    else:
        print("  speed: no official contender ran")


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    official_gpt, gen_mod, shims = import_official(args.official)
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "contenders"} | {
        "contenders": [c.name for c in args.contenders], "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "official_shims": shims}, "load_avg_start": list(os.getloadavg()), "models": {}, "results": []}
    print("official code shims: " + "; ".join(shims), file=sys.stderr)
    for model_name in args.models:
        gpt, decoding_config, note = load_model(model_name, args.seed)
        sampling = {k: getattr(decoding_config, k) for k in ("guidance_scale", "temperature", "top_k", "top_p",
                                                             "cfg_interval")}
        for k in sampling:
            if getattr(args, k) is not None:
                sampling[k] = getattr(args, k)
        official, load_info = official_model(official_gpt, gpt)
        check = check_same_model(official, gen_mod, gpt, sampling["guidance_scale"], args.atol)
        print(f"{model_name}: official Transformer loaded strictly ({load_info['keys_loaded']} tensors; excepted "
              f"{load_info['keys_excepted'] or 'none'}); max |logit diff| vs vispec {check['max_abs_logit_diff']:.3g} "
              f"over {check['rows']} rows x {check['positions']} positions (<= {args.atol:g}); greedy CFG tokens equal "
              f"{check['greedy_tokens_equal']}/{check['greedy_tokens']}; sampling {sampling}")
        report["models"][model_name] = {"note": note, "sampling": sampling, "check": check,
                                        "official_load": load_info}
        if args.dtype != "float32":
            gpt, official, cast = cast_both(gpt, official, gen_mod, args.dtype, sampling["guidance_scale"])
            report["models"][model_name]["check_" + args.dtype] = cast
            print(f"{model_name}: both models cast to {args.dtype} (as sample_c2i.py's --precision casts theirs); "
                  f"max |logit diff| {cast['max_abs_logit_diff']:.3g} (reported: the two graphs round differently); "
                  f"greedy CFG tokens equal {cast['greedy_tokens_equal']}/{cast['greedy_tokens']}")
        failed: dict[str, str] = {}
        runners = {}
        for c in args.contenders:
            try:
                runners[c.name] = Runner(c, gpt, official, gen_mod, sampling, args.official_compile)
            except Exception as err:
                failed[c.name] = f"{type(err).__name__}: {err}"
                print(f"[{model_name}] contender {c.name} failed, dropped: {failed[c.name]}", file=sys.stderr)
        for batch in args.batch_sizes:
            result = run_batch_size(args, model_name, gpt, runners, batch, failed) | {"dtype": args.dtype}
            report["results"].append(result)
            print_table(result, note)
            if args.json:
                _write(args.json, report)
    report["load_avg_end"] = list(os.getloadavg())
    if args.json:
        _write(args.json, report)
        print(f"\nwrote {args.json}")
    return report


def _write(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
