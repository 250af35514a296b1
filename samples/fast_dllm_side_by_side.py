"""Side by side with the official Fast-dLLM ``generate_with_dual_cache``: the same model, the same prompts, timed in one process.

    OMP_NUM_THREADS=1 .venv/bin/python samples/fast_dllm_side_by_side.py --official /tmp/fast-dllm-official \\
        --num-problems 4 --rounds 3 --json /tmp/fastdllm.json
    OMP_NUM_THREADS=1 .venv/bin/python samples/fast_dllm_side_by_side.py --official /tmp/fast-dllm-official \\
        --contenders official-dual,vispec-threshold@dual --tasks sort --threshold 0.7

``--official`` is a checkout of the public NVlabs/Fast-dLLM repository (a clone, or from a bare mirror:
``git --git-dir=<mirror> archive HEAD llada | tar -x -C /tmp/fast-dllm-official``). Its code is imported at run
time from that path, never copied here: ``llada/model`` (``LLaDAConfig``, ``LLaDAModelLM``) and ``llada/generate.py``
(``generate_with_dual_cache``, ``generate_with_prefix_cache``, ``generate``). Import-time shims, applied here and not
to their files: ``llada/`` goes on ``sys.path`` (``generate.py`` imports ``model.modeling_llada``, a top-level package
named ``model``) and ``generate.py`` is loaded as the module ``fast_dllm_generate`` (not as a top-level
``generate``). Their modeling code was written for transformers 4.x; under transformers 5.x:
``PretrainedConfig.__init__`` drops ``use_cache`` (a generation parameter now), which their ``forward`` reads, so the
built config gets their default back (``use_cache = False``); ``config.use_return_dict`` (read on every forward)
logs a deprecation warning, so their ``LLaDAConfig`` gets a ``use_return_dict`` property returning ``return_dict``
(the same value, no warning); ``CausalLMOutputWithPast`` renamed ``past_key_values`` to ``cache`` and warns when
built or read with the old name, which their ``forward`` and ``generate_with_dual_cache`` use, so their module's
``CausalLMOutputWithPast`` is replaced by a plain dataclass with the old fields (``loss``, ``logits``,
``past_key_values``, ``hidden_states``). Their module compiles ``F.scaled_dot_product_attention`` with
``@torch.compile()`` at import (kept: it is their code; the warm-up passes compile it, for every prompt length);
torch's DeprecationWarning of ``torch.jit.script_method``, raised while that import loads inductor, is silenced.

The official model is built from an official-style ``config.json`` dict (the keys of ``GSAI-ML/LLaDA-8B-Instruct``'s,
at the vispec model's sizes: ``block_type="llama"``, ``activation_type="silu"``, ``layer_norm_type="rms"``, RoPE, no
bias, no weight tying, no dropout; the settings of ``vispec.models.llada_checkpoint._REQUIRED`` and the sizes, theta,
eps and token ids of the model's ``config.json``); that dict read back by ``llada_kwargs_from_config`` must give the
vispec model's config, and vispec's state dict loads into their model strictly (missing or unexpected keys fail).
Before timing, the script checks it IS the same model: the logits of both models (full forward) on the first
problem's first canvas (prompt + ``gen_length`` masks) and on a half-decoded canvas, and the dual-cache block
forward (official ``replace_position`` path vs vispec ``forward_span``) on the second block, must agree to ``--atol``
(1e-4).

Problems: the test problems of ``vispec bench text`` (``split_items(task, "test", n, seed)`` of each of
``--tasks``), their prompts through the pipeline's chat template (``pipe.prepare_input_ids``); both sides get the
same ids (batch 1, no padding), gen length and block length of the pipeline (tiny-mdlm-long: 256 / 32), temperature 0.

Contenders (``--contenders``, comma list):

* ``official-dual`` (``official-prefix``, ``official-none``): their ``generate_with_dual_cache`` (``..._prefix_cache``,
  ``generate``) with ``temperature=0, remasking='low_confidence', mask_id=<model's>, threshold=--threshold`` and
  ``steps=gen_length``. With a threshold their code never reads the per-step quota that ``steps`` sets (it passes
  ``None`` to ``get_transfer_index``, which then commits every masked position with confidence ``>= threshold`` and
  always the most confident one); a block loops until it has no mask left, so the threshold rule alone decides the
  steps (``steps`` only has to be a multiple of the block count, their assertion). They never stop at EOS.
* ``vispec-threshold[+ssd=K|+ssd=auto][@cache]`` (cache ``dual``, ``prefix`` or ``none``, default ``none``):
  ``MaskedDiffusionLMPipeline`` with ``strategy="threshold", threshold=--threshold, cache=...,
  early_stop_eos=False`` (no early stop: Fast-dLLM has none) and ``speculative=K`` / ``"auto"`` (exact
  self-speculation: the stepwise run's tokens with fewer forwards). Default contenders: ``official-dual``,
  ``vispec-threshold@dual``, ``vispec-threshold+ssd=auto@dual``.

Timing: one process, ``torch.set_num_threads(--threads)`` (1). ``--warmup`` untimed passes over every problem
(compiles their attention for each prompt length, calibrates ``ssd=auto``'s cost line, kept in the pipeline between
calls), then ``--rounds`` timed rounds; within a round, problem by problem, every contender decodes the problem once,
the order rotated by round + problem. Each call is timed by ``time.perf_counter`` (wall) and ``time.process_time``
(CPU time of this process). Per contender: seconds per problem (the median over rounds of each problem, then the
median over problems), speed-up over the official contender of the same cache (``official-dual`` for ``@dual``; else
the first official contender run) as the median over problems of the per-problem ratio of median times, on both
clocks; forwards per problem (official: model calls counted by a forward hook, checked against the ``nfe`` their
function returns; vispec: ``stats["nfe"]``, and for ``ssd`` the canvases forwarded and the stepwise steps). TOKEN
IDENTITY: the share of problems whose generated ids (the ``gen_length`` positions after the prompt) equal the
official contender's of the same cache exactly; every contender is also checked to give the same tokens in every
call, and an ``ssd`` contender is compared with its stepwise twin (the same setting without ``ssd``). For every
problem whose tokens differ, both decodes are traced step by step (untimed: the official ``get_transfer_index``
wrapped in ``fast_dllm_generate``'s namespace, vispec's ``callback_on_step_end``) and the first step whose committed
positions or tokens differ is reported with the confidences there. Every official contender's decodes are traced
once more (untimed) to count its forwards that commit nothing (below); ``--no-trace`` skips all tracing.

Known differences of the algorithms (reported, not papered over): their dual-cache loop always runs at least one
block forward after a block's refreshing full forward, even when that refresh committed the whole block (the extra
forward commits nothing: ``torch.topk`` with ``k = 0``), so their forward count exceeds vispec's by one for each such
block, tokens unchanged (reported: their empty forwards per problem, and whether their forwards less those equal
vispec's stepwise ones on every problem). On tiny-mdlm-long at threshold 0.9 most blocks after the answer are a
confident EOS run that the refresh completes, so this is most of the forward gap (one problem, trial run: 17 forwards
against 10, 7 of them empty). Ties: their ``torch.topk`` order vs vispec's stable sort only matters for the forced
most-confident position when nothing clears the threshold. vispec never proposes the mask token; their arg-max may
(a committed mask id stays masked).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
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

DEFAULT_CONTENDERS = "official-dual,vispec-threshold@dual,vispec-threshold+ssd=auto@dual"
DEFAULT_TASKS = "arithmetic,sort,reverse"
OFFICIAL_FILES = ("llada/generate.py", "llada/model/__init__.py", "llada/model/modeling_llada.py",
                  "llada/model/configuration_llada.py")
OFFICIAL_FUNCTIONS = {"dual": "generate_with_dual_cache", "prefix": "generate_with_prefix_cache", "none": "generate"}
CACHES = ("dual", "prefix", "none")
VISPEC_RE = re.compile(r"^vispec-threshold(?:\+ssd(?:=(?P<k>auto|\d+))?)?(?:@(?P<cache>[a-z]+))?$")


@dataclass(frozen=True)
class Contender:
    name: str  # as given: "official-dual", "vispec-threshold+ssd=auto@dual"
    official: bool
    cache: str  # "dual", "prefix", "none"
    speculative: Any = None  # vispec: None (stepwise), an int K or "auto"


def parse_contender(name: str) -> Contender:
    """``official-<cache>`` or ``vispec-threshold[+ssd[=K|=auto]][@cache]``; ValueError otherwise."""
    name = name.strip()
    if name.startswith("official"):
        cache = name[len("official-"):] if name.startswith("official-") else ""
        if cache not in CACHES:
            raise ValueError(f"contender {name!r}: the official contenders are "
                             f"{', '.join('official-' + c for c in CACHES)}")
        return Contender(name, True, cache)
    match = VISPEC_RE.match(name)
    if not match:
        raise ValueError(f"contender {name!r}: expected official-<cache> or vispec-threshold[+ssd[=K|=auto]][@cache] "
                         f"(e.g. vispec-threshold@dual, vispec-threshold+ssd=auto@dual); only the threshold rule is "
                         f"Fast-dLLM's")
    cache = match.group("cache") or "none"
    if cache not in CACHES:
        raise ValueError(f"contender {name!r}: unknown cache {cache!r}; expected one of {CACHES}")
    k = match.group("k")
    speculative = None
    if "+ssd" in name:
        speculative = "auto" if k == "auto" else int(k) if k is not None else 8
        if speculative != "auto" and not 1 <= speculative <= 256:
            raise ValueError(f"contender {name!r}: ssd=K needs 1 <= K <= 256")
    return Contender(name, False, cache, speculative)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fast_dllm_side_by_side.py", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", metavar="PATH",
                        help="a checkout of NVlabs/Fast-dLLM holding llada/ (required; its code is imported from there)")
    parser.add_argument("--model", default="tiny-mdlm-long",
                        help="a vispec masked-diffusion pipeline with a LLaDA model (default tiny-mdlm-long)")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"comma list (default {DEFAULT_CONTENDERS})")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma list (default {DEFAULT_TASKS})")
    parser.add_argument("--num-problems", type=int, default=4, help="test problems per task (default 4)")
    parser.add_argument("--threshold", type=float, default=0.9,
                        help="confidence threshold of both sides (default 0.9, Fast-dLLM's eval scripts)")
    parser.add_argument("--gen-length", type=int, default=None, help="default: the pipeline's (tiny-mdlm-long: 256)")
    parser.add_argument("--block-length", type=int, default=None, help="default: the pipeline's (tiny-mdlm-long: 32)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds over every problem (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes over every problem first (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--seed", type=int, default=0, help="the test problems' stream seed (as vispec bench text)")
    parser.add_argument("--atol", type=float, default=1e-4, help="logit agreement required of the two models")
    parser.add_argument("--no-trace", action="store_true", help="skip the step traces of problems whose tokens differ")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The checked arguments (no torch, no model); exits with a one-line usage error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.official = check_official(parser, args.official, "NVlabs/Fast-dLLM", "/tmp/fast-dllm-official",
                                   OFFICIAL_FILES)
    try:
        args.contenders = [parse_contender(c) for c in args.contenders.split(",") if c.strip()]
    except ValueError as err:
        parser.error(f"--contenders: {err}")
    if not args.contenders:
        parser.error("--contenders: name at least one contender")
    names = [c.name for c in args.contenders]
    if len(set(names)) != len(names):
        parser.error(f"--contenders: a contender is named twice in {names}")
    for c in args.contenders:
        if c.official and c.name != f"official-{c.cache}":
            parser.error(f"--contenders: {c.name!r}")
    from vispec.eval.bench.text_tasks import TASKS

    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        parser.error("--tasks: name at least one task")
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        parser.error(f"--tasks: unknown task(s) {unknown}; expected some of {sorted(TASKS)}")
    if len(set(args.tasks)) != len(args.tasks):
        parser.error(f"--tasks: a task is named twice in {args.tasks}")
    if not 0 < args.threshold <= 1:
        parser.error(f"--threshold must lie in (0, 1], got {args.threshold}")
    for flag, value, low in (("--num-problems", args.num_problems, 1), ("--rounds", args.rounds, 1),
                             ("--warmup", args.warmup, 0), ("--threads", args.threads, 1)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if not args.atol > 0:
        parser.error(f"--atol must be > 0, got {args.atol}")
    from vispec.pipelines.embedded import resolve_model_path

    try:
        args.model_path = resolve_model_path(args.model)
        with open(os.path.join(args.model_path, "model_index.json")) as f:
            index = json.load(f)
    except (ValueError, OSError) as err:
        parser.error(f"--model {args.model}: {err}")
    last = lambda v: v[-1] if isinstance(v, list) and v else v  # noqa: E731  ["module", "Class"] or "Class"
    if last(index.get("_class_name")) != "MaskedDiffusionLMPipeline" or last(index.get("model")) != "LLaDAModelLM":
        parser.error(f"--model {args.model}: not a MaskedDiffusionLMPipeline with a LLaDAModelLM")
    args.gen_length = args.gen_length if args.gen_length is not None else index.get("default_gen_length", 128)
    args.block_length = args.block_length if args.block_length is not None else min(
        index.get("default_block_length", args.gen_length), args.gen_length)
    if args.gen_length < 1:
        parser.error(f"--gen-length must be >= 1, got {args.gen_length}")
    if args.block_length < 1 or args.gen_length % args.block_length:
        parser.error(f"--block-length {args.block_length} must be >= 1 and divide --gen-length {args.gen_length} "
                     "(Fast-dLLM asserts it)")
    return args


# ---------------------------------------------------------------------------------------------- the official code
@dataclass
class _OutputWithPast:
    """Stands in for transformers 4.x ``CausalLMOutputWithPast`` in their module (module docstring, shims)."""

    loss: Any = None
    logits: Any = None
    past_key_values: Any = None
    hidden_states: Any = None
    attentions: Any = None

    def __getitem__(self, i):  # their ``return_dict=False`` path slices the output as a tuple
        return tuple(v for v in dataclasses.astuple(self) if v is not None)[i]


def import_official(path: str) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType, list[str]]:
    """Their ``configuration_llada``, ``modeling_llada`` and ``generate`` modules, imported from ``path`` with the
    import-time shims (module docstring)."""
    llada = os.path.join(path, "llada")
    shims = [f"sys.path += {llada} (their generate.py imports model.modeling_llada); generate.py loaded as "
             "fast_dllm_generate"]
    clash = sys.modules.get("model")
    if clash is not None and not os.path.abspath(getattr(clash, "__file__", "") or "").startswith(llada + os.sep):
        raise RuntimeError(f"a module named 'model' is already imported from {getattr(clash, '__file__', None)}; "
                           "their generate.py needs theirs")
    if llada not in sys.path:
        sys.path.insert(0, llada)
    with warnings.catch_warnings():
        # their module-level @torch.compile() loads inductor, which uses torch.jit.script_method (deprecated)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.*", category=DeprecationWarning)
        import model.configuration_llada as configuration
        import model.modeling_llada as modeling

        spec = importlib.util.spec_from_file_location("fast_dllm_generate", os.path.join(llada, "generate.py"))
        generate = importlib.util.module_from_spec(spec)
        sys.modules["fast_dllm_generate"] = generate
        spec.loader.exec_module(generate)
    shims.append("torch.jit.script_method DeprecationWarning (inductor loaded by their @torch.compile) silenced")
    for module in (configuration, modeling, generate):
        if not os.path.abspath(module.__file__).startswith(llada + os.sep):
            raise RuntimeError(f"{module.__name__} was imported from {module.__file__}, not from --official {path}")
    if generate.LLaDAModelLM is not modeling.LLaDAModelLM:
        raise RuntimeError("their generate.py imported another LLaDAModelLM than llada/model/modeling_llada.py")
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        configuration.LLaDAConfig.use_return_dict = property(lambda self: self.return_dict)
        shims.append("LLaDAConfig.use_return_dict = return_dict (transformers 5 deprecates use_return_dict)")
        modeling.CausalLMOutputWithPast = _OutputWithPast
        shims.append("modeling_llada.CausalLMOutputWithPast -> a dataclass with past_key_values (transformers 5 renamed "
                     "it cache and warns on the old name)")
    return configuration, modeling, generate, shims


def official_config(vispec_config) -> dict:
    """An official-style ``config.json`` dict (``GSAI-ML/LLaDA-8B-Instruct``'s keys) at the vispec model's config."""
    from vispec.models.llada_checkpoint import _REQUIRED

    c = vispec_config
    if c.logits_shift:
        raise ValueError("the model shifts its logits (Dream-style); the official LLaDA code does not")
    config = dict(_REQUIRED)  # block_type llama, activation silu, rms norm, rope, no alibi / bias / tying / qk-norm
    config.update(
        d_model=c.d_model, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads or c.n_heads, n_layers=c.n_layers,
        mlp_hidden_size=c.mlp_hidden_size, mlp_ratio=max(1, round(c.mlp_hidden_size / c.d_model)),
        vocab_size=c.vocab_size, embedding_size=c.embedding_size or c.vocab_size,
        max_sequence_length=c.max_sequence_length, rope_theta=float(c.rope_theta), rms_norm_eps=float(c.rms_norm_eps),
        mask_token_id=c.mask_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        init_std=c.init_std, include_qkv_bias=bool(c.include_qkv_bias),
        # the rest of LLaDA-8B-Instruct's config.json
        alibi_bias_max=8.0, architectures=["LLaDAModelLM"], attention_dropout=0.0, attention_layer_norm_with_affine=True,
        bias_for_layer_norm=False, embedding_dropout=0.0, flash_attention=False, init_cutoff_factor=None,
        init_device="cpu", init_fn="mitchell", layer_norm_with_affine=True, model_type="llada",
        multi_query_attention=None, precision="fp32", residual_dropout=0.0, rope_full_precision=True, use_cache=False,
    )
    return config


def official_model(configuration, modeling, vispec_model) -> tuple[Any, dict, list[str]]:
    """Their ``LLaDAModelLM`` at the vispec model's config with its weights (strict), and the config dict used."""
    import torch

    from vispec.models.llada_checkpoint import llada_kwargs_from_config

    config = official_config(vispec_model.config)
    ours = {k: v for k, v in vispec_model.config.items() if not k.startswith("_")}
    # the official config read as vispec reads official checkpoints (which name no EoT / BOS ids: given, as load_llada)
    back = llada_kwargs_from_config(config, {k: ours.get(k) for k in ("eot_token_id", "bos_token_id")})
    differ = {k: (ours.get(k), v) for k, v in back.items() if k in ours and ours[k] != v
              and not (k == "n_kv_heads" and ours[k] is None and v == ours["n_heads"])}
    if differ:
        raise RuntimeError(f"the official config does not read back as the vispec model's: {differ}")
    shims = []
    cfg = configuration.LLaDAConfig(**config)
    if not hasattr(cfg, "use_cache"):  # transformers 5 pops generation parameters, use_cache among them
        cfg.use_cache = config["use_cache"]
        shims.append("LLaDAConfig.use_cache restored (transformers 5's PretrainedConfig drops it; their forward reads it)")
    with torch.random.fork_rng(devices=[]):
        model = modeling.LLaDAModelLM(cfg, init_params=False)
    theirs, state = model.state_dict(), vispec_model.state_dict()
    missing, unexpected = sorted(set(theirs) - set(state)), sorted(set(state) - set(theirs))
    shapes = [k for k in theirs if k in state and theirs[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        raise RuntimeError(f"state dicts differ: missing in vispec's {missing}, unexpected {unexpected}, "
                           f"shapes differ {shapes}")
    result = model.load_state_dict(state, strict=True)
    model = torch.nn.Module.to(model, dtype=torch.float32).eval()
    return model, {"keys_loaded": len(theirs), "missing": list(result.missing_keys),
                   "unexpected": list(result.unexpected_keys), "official_config": config}, shims


def check_same_model(official, vispec_model, prompt_ids, gen_length: int, block_length: int, atol: float,
                     mask_id: int) -> dict:
    """Max |logit difference| of the full forwards on two canvases and of the dual-cache block forward (module
    docstring); asserted <= atol."""
    import torch

    prompt_len = prompt_ids.shape[1]
    blank = torch.cat([prompt_ids, torch.full((1, gen_length), mask_id, dtype=torch.long)], dim=1)
    gen = torch.Generator().manual_seed(1234)
    half = blank.clone()
    fill = torch.rand(gen_length, generator=gen) < 0.5
    words = torch.randint(0, vispec_model.config.vocab_size, (gen_length,), generator=gen)
    words = torch.where(words == mask_id, (words + 1) % vispec_model.config.vocab_size, words)
    half[0, prompt_len:] = torch.where(fill, words, half[0, prompt_len:])
    diffs = {}
    with torch.no_grad():
        for name, canvas in (("full_forward_blank", blank), ("full_forward_half_decoded", half)):
            diffs[name] = (official(canvas).logits.float() - vispec_model(canvas).logits).abs().max().item()
        if gen_length >= 2 * block_length:
            start, end = prompt_len + block_length, prompt_len + 2 * block_length
            out = official(half, use_cache=True)
            replace = torch.zeros_like(half, dtype=torch.bool)
            replace[:, start:end] = True
            theirs = official(half[:, start:end], past_key_values=out.past_key_values, use_cache=True,
                              replace_position=replace).logits.float()
            cache = vispec_model.compute_kv_cache(half).kv_cache
            ours = vispec_model.forward_span(half[:, start:end], start, cache).logits
            diffs["dual_cache_block_forward"] = (theirs - ours).abs().max().item()
    worst = max(diffs.values())
    if not worst <= atol:
        raise AssertionError(f"the official model's logits differ from vispec's by {worst:.3g} > {atol:g}: {diffs}")
    return {"max_abs_logit_diff": diffs, "positions": blank.shape[1], "atol": atol}


# ---------------------------------------------------------------------------------------------- running contenders
class Runner:
    """One contender: ``run(ids)`` decodes one prompt, returns ``(generated ids [gen_length], forwards, extra)``."""

    def __init__(self, contender: Contender, args, pipe, official, generate_mod, mask_id: int):
        self.c, self.args, self.pipe, self.official, self.mask_id = contender, args, pipe, official, mask_id
        self.calls = 0
        if contender.official:
            self.fn = getattr(generate_mod, OFFICIAL_FUNCTIONS[contender.cache])

            def count(module, inputs, output):
                self.calls += 1

            official.register_forward_hook(count)  # one hook per official contender; each counts only its own runs

    def run(self, ids, mask) -> tuple[list[int], int, dict]:
        import torch

        a = self.args
        if self.c.official:
            before = self.calls
            x, nfe = self.fn(self.official, ids, steps=a.gen_length, gen_length=a.gen_length,
                             block_length=a.block_length, temperature=0.0, remasking="low_confidence",
                             mask_id=self.mask_id, threshold=a.threshold)
            calls = self.calls - before
            return x[0, ids.shape[1]:].tolist(), calls, {"nfe_returned": int(nfe)}
        with torch.no_grad():
            out = self.pipe(input_ids=ids, attention_mask=mask, strategy="threshold", threshold=a.threshold,
                            cache=self.c.cache, gen_length=a.gen_length, block_length=a.block_length,
                            temperature=0.0, early_stop_eos=False, speculative=self.c.speculative, output_type="seq")
        stats = out.stats[0]
        extra = {k: stats[k] for k in ("canvases", "steps") if k in stats}
        return out.sequences[0].tolist(), int(stats["nfe"]), extra


def load_problems(args, pipe) -> list[dict]:
    from vispec.eval.bench.text_tasks import split_items

    problems = []
    for task in args.tasks:
        for i, item in enumerate(split_items(task, "test", args.num_problems, args.seed)):
            ids, mask = pipe.prepare_input_ids(prompt=[item.prompt])
            if not bool(mask.all()):
                raise RuntimeError("a batch-1 prompt came back padded")
            problems.append({"task": task, "index": i, "prompt": item.prompt, "ids": ids, "mask": mask,
                             "prompt_len": int(ids.shape[1])})
    return problems


def stepwise_vispec(contenders: list[Contender], cache: str) -> Optional[str]:
    """The name of the vispec contender without ``ssd`` on ``cache`` (``vispec-threshold@dual``), if one runs."""
    return next((c.name for c in contenders if not c.official and c.speculative is None and c.cache == cache), None)


def reference_of(contender: Contender, names: list[str]) -> Optional[str]:
    """The official contender a contender is compared with: the one of its cache, else the first official run."""
    same = f"official-{contender.cache}"
    if same in names:
        return same
    return next((n for n in names if n.startswith("official-")), None)


def first_difference(a: list[int], b: list[int], block_length: int) -> Optional[dict]:
    where = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not where:
        return None
    i = where[0]
    return {"first_position": i, "block": i // block_length, "positions_differing": len(where), "tokens": [a[i], b[i]]}


def run_all(args, runners: dict, problems: list[dict], failed: dict) -> dict:
    """Warm-up passes, then the timed rounds (module docstring); per contender and problem the times, tokens, forwards."""
    names = [c.name for c in args.contenders if c.name in runners]
    per = {n: [{"wall_s": [], "cpu_s": [], "tokens": None, "nfe": None, "extra": None, "deterministic": True,
                "same_forwards": True}
               for _ in problems] for n in names}
    total = args.warmup + args.rounds
    for r in range(total):
        timed = r >= args.warmup
        start = time.perf_counter()
        for p, problem in enumerate(problems):
            live = [n for n in names if n not in failed]
            shift = (r + p) % max(len(live), 1)
            for name in live[shift:] + live[:shift]:
                try:
                    w0, c0 = time.perf_counter(), time.process_time()
                    tokens, nfe, extra = runners[name].run(problem["ids"], problem["mask"])
                    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                except Exception as err:  # a contender that fails is reported once and dropped
                    failed[name] = f"{type(err).__name__}: {err}"
                    print(f"contender {name} failed, dropped: {failed[name]}", file=sys.stderr)
                    continue
                rec = per[name][p]
                if rec["tokens"] is None:
                    rec["tokens"], rec["nfe"], rec["extra"] = tokens, nfe, extra
                else:  # the tokens must repeat; forwards may not under ssd=auto (its choices follow the clock)
                    rec["deterministic"] &= tokens == rec["tokens"]
                    rec["same_forwards"] &= nfe == rec["nfe"]
                if timed:
                    rec["wall_s"].append(wall)
                    rec["cpu_s"].append(cpu)
        label = f"round {r - args.warmup + 1}/{args.rounds}" if timed else f"warm-up {r + 1}/{args.warmup}"
        done = ", ".join(f"{n} {statistics.median(x['wall_s'][-1] for x in per[n]):.3f}" for n in names
                         if n not in failed and per[n][0]["wall_s"]) if timed else ""
        print(f"{label} ({time.perf_counter() - start:.1f} s)" + (f"; s/problem (median): {done}" if done else ""),
              file=sys.stderr)
    return per


def summarize(args, per: dict, problems: list[dict], failed: dict) -> dict:
    names = [c.name for c in args.contenders]
    ran = [n for n in names if n in per and n not in failed]
    rows = {}
    for c in args.contenders:
        name = c.name
        if name not in ran:
            rows[name] = {"error": failed.get(name, "not run")}
            continue
        recs = per[name]
        wall = [statistics.median(r["wall_s"]) for r in recs]
        cpu = [statistics.median(r["cpu_s"]) for r in recs]
        row = {"s_per_problem_wall": statistics.median(wall), "s_per_problem_cpu": statistics.median(cpu),
               "total_wall_s": sum(wall), "total_cpu_s": sum(cpu),
               "forwards_per_problem": statistics.fmean(r["nfe"] for r in recs),
               "deterministic": all(r["deterministic"] for r in recs),
               "same_forwards": all(r["same_forwards"] for r in recs),
               "per_problem": [{"task": p["task"], "index": p["index"], "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
                                "forwards": r["nfe"], **(r["extra"] or {}), "tokens": r["tokens"]}
                               for p, r in zip(problems, recs)]}
        if c.official:
            returned = [r["extra"]["nfe_returned"] for r in recs]
            row["nfe_returned_per_problem"] = statistics.fmean(returned)
            row["hook_count_equals_returned_nfe"] = all(r["nfe"] == n for r, n in zip(recs, returned))
        for key in ("canvases", "steps"):
            if recs[0]["extra"] and key in recs[0]["extra"]:
                row[f"{key}_per_problem"] = statistics.fmean(r["extra"][key] for r in recs)
        row["by_task"] = {t: {"forwards_per_problem": statistics.fmean(r["nfe"] for p, r in zip(problems, recs)
                                                                        if p["task"] == t),
                              "s_per_problem_wall": statistics.median(w for p, w in zip(problems, wall) if p["task"] == t)}
                          for t in args.tasks}
        ref = reference_of(c, ran)
        if ref is not None:
            base = per[ref]
            bw = [statistics.median(r["wall_s"]) for r in base]
            bc = [statistics.median(r["cpu_s"]) for r in base]
            row["baseline"] = ref
            row["speed_wall_per_problem"] = [b / x for b, x in zip(bw, wall)]
            row["speed_cpu_per_problem"] = [b / x for b, x in zip(bc, cpu)]
            row["speed_wall"] = statistics.median(row["speed_wall_per_problem"])
            row["speed_cpu"] = statistics.median(row["speed_cpu_per_problem"])
            row["speed_wall_total"] = sum(bw) / sum(wall)
            if ref != name:
                diffs = [first_difference(b["tokens"], r["tokens"], args.block_length) for b, r in zip(base, recs)]
                row["identical_to"] = ref
                row["identical"] = sum(d is None for d in diffs)
                row["identical_share"] = row["identical"] / len(recs)
                row["differences"] = [{"task": p["task"], "index": p["index"], **d}
                                      for p, d in zip(problems, diffs) if d is not None]
        twin = None if c.official or c.speculative is None else stepwise_vispec(args.contenders, c.cache)
        if twin in ran:
            same = [a["tokens"] == b["tokens"] for a, b in zip(per[twin], recs)]
            row["stepwise_twin"] = twin
            row["identical_to_twin"] = sum(same)
            row["fewer_forwards_than_twin"] = (statistics.fmean(r["nfe"] for r in per[twin])
                                               / row["forwards_per_problem"])
        rows[name] = row
    return rows


# ---------------------------------------------------------------------------------------------- tracing a difference
def trace_official(runner: Runner, generate_mod, ids) -> list[dict]:
    """Their decode of ``ids`` step by step: their ``get_transfer_index`` wrapped (in ``fast_dllm_generate``'s namespace,
    where their loops look it up) to record each step's committed generated positions, their tokens and the
    confidences (float64 softmax at the arg-max, as theirs) of the positions still masked before the step."""
    import torch
    import torch.nn.functional as F

    a, prompt_len = runner.args, ids.shape[1]
    original = generate_mod.get_transfer_index
    steps: list[dict] = []
    refreshes = [-1]

    def recording(logits, temperature, remasking, mask_index, x, num_transfer_tokens, threshold=None):
        x0, transfer = original(logits, temperature, remasking, mask_index, x, num_transfer_tokens, threshold)
        full = x.shape[1] == prompt_len + a.gen_length  # a full forward: positions of the whole sequence
        if full:
            refreshes[0] += 1
        # a span forward starts at its block (dual: the block; prefix: the block and everything after it)
        offset = -prompt_len if full else refreshes[0] * a.block_length
        conf = torch.gather(F.softmax(logits.to(torch.float64), dim=-1), -1, logits.argmax(-1, keepdim=True))[0, :, 0]
        idx = transfer[0].nonzero().squeeze(1).tolist()
        steps.append({"refresh": full, "positions": [i + offset for i in idx], "tokens": [int(x0[0, i]) for i in idx],
                      "confidence": {i + offset: float(conf[i]) for i in mask_index[0].nonzero().squeeze(1).tolist()}})
        return x0, transfer

    generate_mod.get_transfer_index = recording
    try:
        runner.fn(runner.official, ids, steps=a.gen_length, gen_length=a.gen_length, block_length=a.block_length,
                  temperature=0.0, remasking="low_confidence", mask_id=runner.mask_id, threshold=a.threshold)
    finally:
        generate_mod.get_transfer_index = original
    return steps


def trace_vispec(runner: Runner, ids, mask) -> list[dict]:
    """vispec's stepwise decode of ``ids`` (the contender's setting without ``ssd``) step by step, from
    ``callback_on_step_end``: each step's committed generated positions and their tokens."""
    import torch

    a = runner.args
    steps: list[dict] = []
    previous = [torch.full((a.gen_length,), runner.mask_id, dtype=torch.long)]

    def callback(pipe, step, timestep, kwargs):
        seq = kwargs["sequences"][0].cpu()
        idx = ((previous[0] == runner.mask_id) & (seq != runner.mask_id)).nonzero().squeeze(1).tolist()
        steps.append({"positions": idx, "tokens": [int(seq[i]) for i in idx]})
        previous[0] = seq.clone()
        return {}

    with torch.no_grad():
        runner.pipe(input_ids=ids, attention_mask=mask, strategy="threshold", threshold=a.threshold,
                    cache=runner.c.cache, gen_length=a.gen_length, block_length=a.block_length, temperature=0.0,
                    early_stop_eos=False, output_type="seq", callback_on_step_end=callback)
    return steps


def explain_difference(official_steps: list[dict], vispec_steps: list[dict], threshold: float,
                       block_length: int) -> dict:
    """The first step where the two traces commit other positions or tokens, with their confidences there. The
    official trace has a step vispec lacks where a refresh completed its block (the extra, empty block forward)."""
    theirs = [s for s in official_steps if s["positions"]]  # drop empty steps (nothing committed)
    dropped = len(official_steps) - len(theirs)
    for k, (o, v) in enumerate(zip(theirs, vispec_steps)):
        if o["positions"] != v["positions"] or o["tokens"] != v["tokens"]:
            only_o = sorted(set(o["positions"]) - set(v["positions"]))
            only_v = sorted(set(v["positions"]) - set(o["positions"]))
            conf = o["confidence"]
            near = {p: conf.get(p) for p in only_o + only_v}
            reasons = []
            if any(c is not None and abs(c - threshold) < 1e-6 for c in near.values()):
                reasons.append("a confidence within 1e-6 of the threshold")
            committed = [conf.get(p) for p in o["positions"]]
            if len(o["positions"]) == 1 and committed and committed[0] is not None and committed[0] < threshold:
                tied = [p for p, c in conf.items() if c == committed[0]]
                if len(tied) > 1:
                    reasons.append(f"a tie for the forced most-confident position at {tied}")
            if not only_o and not only_v:
                reasons.append("same positions, other tokens (an arg-max tie, or the mask token proposed)")
            return {"step": k, "block": (o["positions"] or v["positions"] or [0])[0] // block_length,
                    "official_refresh": o["refresh"],
                    "official_positions": o["positions"], "vispec_positions": v["positions"],
                    "only_official": only_o, "only_vispec": only_v, "official_confidence_there": near,
                    "empty_official_steps_dropped": dropped, "likely": reasons or ["unexplained by ties: see the values"]}
    if len(theirs) != len(vispec_steps):
        return {"step": min(len(theirs), len(vispec_steps)), "likely": ["one trace has more committing steps"],
                "official_steps": len(theirs), "vispec_steps": len(vispec_steps)}
    return {"likely": ["the step traces agree (the timed runs differed: nondeterminism?)"]}


# ---------------------------------------------------------------------------------------------- report
def print_table(args, result: dict) -> None:
    la, lb = result["load_avg_start"], result["load_avg_end"]
    counts = ", ".join(f"{t} {args.num_problems}" for t in args.tasks)
    print(f"\n{args.model}  gen {args.gen_length}  block {args.block_length}  threshold {args.threshold:g}  "
          f"problems {len(result['problems'])} ({counts})  rounds {args.rounds} (+{args.warmup} warm-up)  "
          f"threads {args.threads}  load avg {la[0]:.2f} -> {lb[0]:.2f} ({os.cpu_count()} cores)")
    rows = result["contenders"]
    width = max(12, *(len(n) for n in rows))
    print(f"  {'contender':<{width}} {'s/prob wall':>11} {'s/prob cpu':>10} {'speed wall':>10} {'speed cpu':>9} "
          f"{'fwd/prob':>8} {'same tokens':>12}")
    for name, row in rows.items():
        if "error" in row:
            print(f"  {name:<{width}} failed: {row['error'][:100]}")
            continue
        speed = (f"{row['speed_wall']:>9.2f}x {row['speed_cpu']:>8.2f}x" if "speed_wall" in row
                 else f"{'-':>10} {'-':>9}")
        if "identical" in row:
            n = len(row["per_problem"])
            same = f"{row['identical']}/{n} {row['identical_share']:.2f}"
        else:
            same = "reference" if name.startswith("official") else "-"
        print(f"  {name:<{width}} {row['s_per_problem_wall']:>11.3f} {row['s_per_problem_cpu']:>10.3f} {speed} "
              f"{row['forwards_per_problem']:>8.1f} {same:>12}")
    print("  forwards per problem by task: " + "; ".join(
        f"{name} " + ", ".join(f"{t} {row['by_task'][t]['forwards_per_problem']:.1f}" for t in args.tasks)
        for name, row in rows.items() if "error" not in row))
    for name, row in rows.items():
        if "error" in row:
            continue
        notes = []
        if "nfe_returned_per_problem" in row:
            notes.append(f"their returned nfe {row['nfe_returned_per_problem']:.1f}/problem "
                         f"({'equals' if row['hook_count_equals_returned_nfe'] else 'differs from'} the hook count)")
        if row.get("empty_forwards_per_problem") == 0:
            notes.append("every forward of it commits a token")
        elif "empty_forwards_per_problem" in row:
            notes.append(f"{row['empty_forwards_per_problem']:.1f} of its forwards/problem commit nothing (the block "
                         "forward after a refresh that completed the block)" + (
                             "; without them its forwards equal vispec's stepwise ones on every problem"
                             if row.get("forwards_minus_empty_equal_vispec_stepwise") else ""))
        if "canvases_per_problem" in row:
            notes.append(f"canvases {row['canvases_per_problem']:.1f}/problem, stepwise steps "
                         f"{row.get('steps_per_problem', float('nan')):.1f}")
        if "identical_to_twin" in row:
            notes.append(f"tokens equal to {row['stepwise_twin']} on {row['identical_to_twin']}/{len(row['per_problem'])}, "
                         f"{row['fewer_forwards_than_twin']:.2f}x fewer forwards")
        if not row["deterministic"]:
            notes.append("NOT deterministic: its tokens changed between calls")
        elif not row["same_forwards"]:
            notes.append("same tokens in every call; its forwards varied between calls (ssd=auto chooses draft lengths "
                         "by measured time)")
        for d in row.get("differences", []):
            notes.append(f"differs from {row['identical_to']} on {d['task']} #{d['index']}: first at generated "
                         f"position {d['first_position']} (block {d['block']}), {d['positions_differing']} positions, "
                         f"tokens {d['tokens'][0]} vs {d['tokens'][1]}")
        for e in row.get("explanations", []):
            notes.append(f"trace {e['task']} #{e['index']}: {json.dumps(e['explanation'], default=str)}")
        if notes:
            print(f"  {name}: " + "; ".join(notes))
    print("  speed = official time / contender time per problem (median over rounds), median over problems; "
          "s/prob: median over problems; same tokens: problems whose generated ids equal the official contender's")


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    configuration, modeling, generate_mod, shims = import_official(args.official)
    from vispec.pipelines import MaskedDiffusionLMPipeline

    pipe = MaskedDiffusionLMPipeline.from_pretrained(args.model_path)
    pipe.set_progress_bar_config(disable=True)
    vispec_model = torch.nn.Module.to(pipe.model, dtype=torch.float32).eval()
    mask_id = int(pipe.mask_token_id)
    if mask_id != vispec_model.config.mask_token_id:
        raise RuntimeError(f"the tokenizer's mask id {mask_id} is not the model's {vispec_model.config.mask_token_id}")
    official, load_info, more = official_model(configuration, modeling, vispec_model)
    shims += more
    print("official code shims: " + "; ".join(shims), file=sys.stderr)
    problems = load_problems(args, pipe)
    check = check_same_model(official, vispec_model, problems[0]["ids"], args.gen_length, args.block_length,
                             args.atol, mask_id)
    diffs = ", ".join(f"{k} {v:.3g}" for k, v in check["max_abs_logit_diff"].items())
    print(f"{args.model}: official LLaDAModelLM loaded strictly ({load_info['keys_loaded']} tensors, missing "
          f"{load_info['missing'] or 'none'}, unexpected {load_info['unexpected'] or 'none'}); max |logit diff| vs "
          f"vispec: {diffs} (<= {args.atol:g})", file=sys.stderr)
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "contenders"} | {
        "contenders": [c.name for c in args.contenders], "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "official_shims": shims, "official_steps": args.gen_length}, "official_load": load_info, "check": check,
        "load_avg_start": list(os.getloadavg())}
    try:
        import transformers

        report["config"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    failed: dict[str, str] = {}
    runners = {c.name: Runner(c, args, pipe, official, generate_mod, mask_id) for c in args.contenders}
    per = run_all(args, runners, problems, failed)
    report["load_avg_end"] = list(os.getloadavg())
    report["problems"] = [{k: p[k] for k in ("task", "index", "prompt", "prompt_len")} for p in problems]
    rows = summarize(args, per, problems, failed)
    if not args.no_trace:  # untimed: their forwards that commit nothing, and why tokens differ
        for c in args.contenders:
            row = rows[c.name]
            if not c.official or "error" in row:
                continue
            empty = [sum(not step["positions"] for step in trace_official(runners[c.name], generate_mod, p["ids"]))
                     for p in problems]
            row["empty_forwards_per_problem"] = statistics.fmean(empty)
            twin = rows.get(stepwise_vispec(args.contenders, c.cache), {})
            if twin.get("identical") == len(problems):  # same tokens: is the empty forward the whole difference?
                row["forwards_minus_empty_equal_vispec_stepwise"] = all(
                    r["forwards"] - e == v["forwards"]
                    for r, e, v in zip(row["per_problem"], empty, twin["per_problem"]))
        for c in args.contenders:
            row = rows[c.name]
            if c.official or not row.get("differences") or row["identical_to"] != f"official-{c.cache}":
                continue
            ref = runners[row["identical_to"]]
            stepwise = Runner(dataclasses.replace(c, speculative=None), args, pipe, official, generate_mod, mask_id)
            row["explanations"] = []
            for d in row["differences"]:
                p = next(x for x in problems if x["task"] == d["task"] and x["index"] == d["index"])
                row["explanations"].append({"task": d["task"], "index": d["index"], "explanation": explain_difference(
                    trace_official(ref, generate_mod, p["ids"]), trace_vispec(stepwise, p["ids"], p["mask"]),
                    args.threshold, args.block_length)})
    report["contenders"] = rows
    print_table(args, report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
