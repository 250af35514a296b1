"""lm-evaluation-harness model ``vispec-dllm``: masked diffusion LMs scored through vispec's decoding.

Every dLLM paper (LLaDA, Dream, Fast-dLLM, Learn2PD, d3LLM) measures with lm-evaluation-harness through a model class
of its own (LLaDA's ``llada_dist`` in ``eval_llada.py``); ``vispec-dllm`` is vispec's, over
:class:`vispec.pipelines.MaskedDiffusionLMPipeline`, so every vispec policy, cache and rule runs under lm-eval::

    python -m vispec.eval.lm_eval_model --model vispec-dllm \\
        --model_args pretrained=tiny-mdlm,decoding=threshold@dual --tasks vispec_arithmetic --apply_chat_template

**Registration.** lm-eval 0.4.x resolves ``--model`` in its own registry, which an installed package cannot fill
before the CLI runs (lm-eval issues #1457, #1621, #3282). vispec declares ``vispec-dllm`` in the entry-point group
lm-eval's plugin discovery reads (``lm_eval.models``, lm-eval PR #4013), so a release with that discovery finds it
from the plain ``lm_eval`` command; on releases without it (0.4.13 and earlier), ``python -m
vispec.eval.lm_eval_model ARGS`` registers the model and runs lm-eval's own CLI (``lm_eval.__main__.cli_evaluate``:
its parser, task manager and evaluator) with the same arguments, as LLaDA's ``eval_llada.py`` does, and puts
vispec's local tasks (:mod:`vispec.eval.lm_eval_tasks`) on ``--include_path`` when none is given. Importing this
module registers the model for Python use (``lm_eval.simple_evaluate(model="vispec-dllm", ...)``).

**Checked before lm-eval starts.** lm-eval indexes every task it knows before it builds the model (minutes), so
``python -m vispec.eval.lm_eval_model`` first checks ``--model_args`` (with ``--batch_size`` and ``--device``) as the
constructor does, the decoding against the model's family included, on the pipeline without its weights
(:meth:`VispecDLLM.check_arguments`): a bad argument is one ``vispec-dllm: error:`` line naming it and status 2. It
then says on stderr when lm-eval's indexing starts and ends, and lm-eval's git look-up (the commit it records) no
longer prints git's "not a git repository". The constructor itself refuses a decoding the model cannot run (not the
first generation), and an unknown argument name is an error naming it.

**Arguments** (``--model_args k=v,...``): ``pretrained`` (a pipeline folder or an embedded model name);
``decoding`` (``strategy[+rule...][@cache]`` as in ``vispec bench text --settings``, e.g. ``threshold@dual``,
``learn2pd+eotp@dual``, ``llada``; default: the pipeline's own scheduler, no cache); the policies' knobs
``threshold``, ``factor``, ``entropy_bound``, ``filter_threshold``, ``draft_length`` (each refused where the decoding
does not use it); ``gen_length``, ``block_length`` (default: the pipeline's), ``steps`` (total over blocks, fixed-step
policies; default one token per step); ``temperature`` (used when a task does not say; tasks' ``do_sample`` /
``temperature`` win), ``guidance_scale`` (LLaDA's ``cfg`` + 1), ``early_stop_eos``, ``cache_reload_steps``;
``batch_size`` (prompts per pipeline call; lm-eval's ``--batch_size``); ``mc_num``, ``mc_batch_size``,
``check_greedy`` (likelihood, below); ``seed``; ``device``; ``dtype``.

**generate_until**: the requests in order, ``batch_size`` prompts per pipeline call (left-padded ids; a context that
starts with the BOS token, as chat-templated ones do, is tokenised without adding special tokens, as the pipeline
tokenises its own chat template). The canvas is ``gen_length`` tokens whatever the task's ``max_gen_toks`` (as every
dLLM harness), and a smaller ``max_gen_toks`` keeps that many generated tokens. The text is the generated tokens only
(never the prompt), up to the first EOS / end-of-turn token, special tokens skipped, then cut at the earliest of the
task's ``until`` strings and the EOS string (diffusion decodes the whole canvas, so stop strings apply after).
Sampling uses one generator per request, seeded from ``seed`` and the request's context, so a request's text does
not depend on its batch. Speed is logged at the end as Fast-dLLM counts it: tokens of the returned texts (after the
stop strings, EOS excluded) over the wall time of the pipeline calls; ``get_model_info`` puts it in lm-eval's results.

**loglikelihood**: a masked diffusion LM has no causal likelihood; the score is LLaDA's Monte-Carlo bound
(:mod:`vispec.dllm.likelihood`) with its official defaults ``mc_num=128`` samples in mini-batches of
``mc_batch_size=32``. ``is_greedy`` is LLaDA's check (``is_check_greedy``, default on as in ``eval_llada.py``): the
continuation decoded from the context one token per step by confidence (the ``llada`` policy, one block of the
continuation's length, no early stop) equals it. Context and continuation are split as lm-eval's ``TemplateLM`` does
(trailing spaces of the context move to the continuation; the continuation is the tail of the whole encoding).

**loglikelihood_rolling**: the sum, over lm-eval's rolling windows (``max_sequence_length`` tokens, each token
predicted once), of each window's bound given the window's context: a bound on the document's log-likelihood (used
for perplexity), not an exact value.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import os
import subprocess
import sys
import time
from typing import Any, Optional

try:
    from lm_eval.api.model import LM
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError("vispec.eval.lm_eval_model needs lm-evaluation-harness: pip install 'vispec[lm-eval]'") from err

import torch

from vispec.checks import check_int, check_number

MODEL_NAME = "vispec-dllm"
logger = logging.getLogger(__name__)

# which decoding each knob belongs to (a knob the decoding does not use is an error, not ignored)
_KNOB_STRATEGIES = {"threshold": ("threshold", "contiguous"), "factor": ("factor",), "entropy_bound": ("entropy",),
                    "filter_threshold": ("learn2pd",)}
_GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def request_seed(seed: int, *parts: str) -> int:
    """A 63-bit seed from ``seed`` and the request's text: the same request draws the same numbers in any batch."""
    digest = hashlib.sha256("\x1f".join((str(seed), *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def cut_at_stops(text: str, stops: list[str]) -> str:
    """``text`` up to the earliest occurrence of any of ``stops`` (empty strings ignored)."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


class VispecDLLM(LM):
    """lm-eval ``LM`` over a :class:`~vispec.pipelines.MaskedDiffusionLMPipeline` (module docstring)."""

    def __init__(self, pretrained: Optional[str] = None, decoding: Optional[str] = None,
                 gen_length: Optional[int] = None, block_length: Optional[int] = None, steps: Optional[int] = None,
                 threshold: Optional[float] = None, factor: Optional[float] = None, entropy_bound: Optional[float] = None,
                 filter_threshold: Optional[float] = None, draft_length: Optional[int] = None,
                 temperature: float = 0.0, guidance_scale: float = 1.0, early_stop_eos: bool = True,
                 cache_reload_steps: int = 8, batch_size: Any = 1, max_batch_size: Optional[int] = None,
                 mc_num: int = 128, mc_batch_size: int = 32, check_greedy: bool = True, seed: int = 1234,
                 device: Optional[str] = None, dtype: Optional[str] = None) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        self._setup(arguments, weights=True)

    @classmethod
    def check_arguments(cls, model_args: dict, additional_config: Optional[dict] = None) -> None:
        """Every check the constructor runs on ``model_args`` (and lm-eval's ``additional_config``: ``batch_size``,
        ``max_batch_size``, ``device`` from its flags), the decoding against the model's family included, without
        reading the weights: the pipeline's model is built on the meta device
        (:meth:`~vispec.pipelines.MaskedDiffusionLMPipeline.from_pretrained_without_weights`). A ``ValueError``
        naming the argument; :func:`main` runs it before lm-eval indexes its tasks."""
        lm = cls.__new__(cls)
        LM.__init__(lm)
        lm._setup(cls._arguments(model_args, additional_config), weights=False)

    @classmethod
    def _arguments(cls, model_args: Any, additional_config: Optional[dict]) -> dict:
        """The constructor's keywords from lm-eval's ``model_args`` and ``additional_config`` (its flags, None ones
        dropped, as lm-eval does), after checking the names: an unknown one is a ``ValueError`` naming it and listing
        the arguments (Python's ``TypeError`` otherwise, from inside lm-eval)."""
        if not isinstance(model_args, dict):
            raise ValueError(f"--model_args must be key=value pairs, got {model_args!r}")
        defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"}
        known = list(defaults)
        unknown = [key for key in model_args if key not in known]
        if unknown:
            raise ValueError(f"--model_args: {MODEL_NAME} takes no argument {unknown[0]!r}; its arguments are "
                             f"{', '.join(known)}")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        for key in set(extra) & set(model_args):
            if extra[key] != model_args[key] and str(extra[key]) != str(model_args[key]):
                raise ValueError(f"--model_args {key}={model_args[key]!r}: {key} is lm-eval's flag --{key} too, which "
                                 f"is {extra[key]!r} (its default when not given); pass --{key} {model_args[key]} "
                                 f"instead")
        return {**defaults, **model_args, **extra}

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "VispecDLLM":
        """lm-eval's constructor from ``"k=v,..."``: the names checked first (:meth:`_arguments`)."""
        from lm_eval.utils import simple_parse_args_string

        return cls(**cls._arguments(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "VispecDLLM":
        """lm-eval's constructor from a dict (its CLI's parsed ``--model_args``): the names checked first."""
        return cls(**cls._arguments(arg_dict, additional_config))

    def _setup(self, arguments: dict, weights: bool) -> None:
        """The constructor's work: every argument checked, then (``weights``) the pipeline loaded; without
        ``weights`` the pipeline's model is built on the meta device, so the decoding is checked against the model
        (:meth:`~vispec.pipelines.MaskedDiffusionLMPipeline.check_decoding`) and nothing is allocated."""
        from vispec.dllm import UnmaskingOptions
        from vispec.dllm.options import GUIDANCE_HINT
        from vispec.eval.bench.text import TextBenchConfig, parse_rule, parse_setting, setting_scheduler

        a = arguments
        pretrained, decoding, gen_length, block_length, steps = (a["pretrained"], a["decoding"], a["gen_length"],
                                                                 a["block_length"], a["steps"])
        draft_length, temperature, early_stop_eos = a["draft_length"], a["temperature"], a["early_stop_eos"]
        mc_num, mc_batch_size, check_greedy, seed, dtype = (a["mc_num"], a["mc_batch_size"], a["check_greedy"],
                                                            a["seed"], a["dtype"])
        if pretrained is None:
            raise ValueError("vispec-dllm needs pretrained=<pipeline folder or embedded model name> in --model_args")
        if not isinstance(pretrained, str) or not pretrained:
            raise ValueError(f"pretrained must be a pipeline folder or an embedded model name, got {pretrained!r}")
        self.batch_size = self._batch_size(a["batch_size"], a["max_batch_size"])
        check_int("mc_num", mc_num, minimum=1, hint=" (Monte-Carlo samples per continuation; LLaDA uses 128)")
        check_int("mc_batch_size", mc_batch_size, minimum=1, hint=" (samples per forward; LLaDA uses 32)")
        if mc_num % mc_batch_size:
            raise ValueError(f"mc_num ({mc_num}) must be a multiple of mc_batch_size ({mc_batch_size})")
        for name in ("check_greedy", "early_stop_eos"):
            if not isinstance(a[name], bool):
                raise ValueError(f"{name} must be True or False, got {a[name]!r}")
        check_int("seed", seed, minimum=0)
        check_number("temperature", temperature, minimum=0, hint=" (0 means arg-max candidates)")
        check_number("guidance_scale", a["guidance_scale"], minimum=1, hint=GUIDANCE_HINT)
        check_int("cache_reload_steps", a["cache_reload_steps"], minimum=1)
        for name in ("gen_length", "block_length", "steps"):
            if a[name] is not None:
                check_int(name, a[name], minimum=1)
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)} (or left out: the saved dtype), got {dtype!r}")
        device = self._pick_device(a["device"], warn=weights)

        # the decoding: a bench setting, its knobs (refused where unused), its rules
        knobs = {name: a[name] for name in _KNOB_STRATEGIES}
        if decoding is None:
            strategy, rules, cache = None, (), "none"
        else:
            try:
                strategy, rules, cache = parse_setting(str(decoding))
            except ValueError as err:  # its words are bench text's (--settings); here the argument is decoding
                words = str(err).removeprefix("settings: ").removeprefix(f"{str(decoding)!r}: ")
                raise ValueError(f"decoding={decoding!r}: {words}") from None
        for knob, value in knobs.items():
            if value is not None and strategy not in _KNOB_STRATEGIES[knob] and not (
                    strategy is None and knob == "threshold"):
                raise ValueError(f"{knob} applies to decoding {' / '.join(_KNOB_STRATEGIES[knob])}; "
                                 f"decoding={decoding!r} does not use it")
        rule_names = [parse_rule(r, "decoding")[0] for r in rules]
        if draft_length is not None and "ssd" not in rule_names:
            raise ValueError(f"draft_length applies to the ssd rule; decoding={decoding!r} has none")
        defaults = TextBenchConfig()
        config = TextBenchConfig(**{k: v for k, v in knobs.items() if v is not None},
                                 draft_length=defaults.draft_length if draft_length is None else draft_length,
                                 settings=() if decoding is None else (str(decoding),))
        config.validate()  # the knobs' values, before the model loads

        # the lengths and steps, checked against the folder's defaults before the weights load
        try:
            index = self._check_folder(pretrained)
        except ValueError as err:
            raise ValueError(f"pretrained={pretrained!r}: {err}") from None
        self.gen_length = index.get("default_gen_length", 128) if gen_length is None else gen_length
        self.block_length = block_length
        if block_length is None:
            self.block_length = min(index.get("default_block_length", 32), self.gen_length)
        self.scheduler = None if strategy is None else setting_scheduler(config, strategy)
        if self.scheduler is not None:
            self._check_steps(self.scheduler, steps)
        try:
            self.options = UnmaskingOptions(gen_length=self.gen_length, block_length=self.block_length,
                                            temperature=float(temperature), guidance_scale=float(a["guidance_scale"]),
                                            cache=cache, cache_reload_steps=a["cache_reload_steps"],
                                            early_stop_eos=early_stop_eos, **config.rule_options(set(rules), None))
        except ValueError as err:  # a rule with a cache or another rule (ssd over dkv, ...), or the lengths
            raise ValueError(f"decoding={decoding!r}: {err}" if decoding is not None else str(err)) from None

        # the pipeline: loaded, or (no weights) with its model on the meta device, which the checks below read
        self._device = device
        if weights:
            self.pipe = self._load(pretrained).to(self._device)
            if dtype is not None:
                self.pipe.to(dtype=_DTYPES[dtype])
        else:
            from vispec.pipelines import MaskedDiffusionLMPipeline
            from vispec.pipelines.embedded import resolve_model_path

            self.pipe = MaskedDiffusionLMPipeline.from_pretrained_without_weights(resolve_model_path(pretrained))
            if self.pipe is None:  # a model that cannot be built on meta: the constructor checks it once loaded
                return
        self.pipe.set_progress_bar_config(disable=True)
        self.tokenizer = self.pipe.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer; lm-eval passes text")
        self.rule_options = config.rule_options(set(rules), self.tokenizer)  # adablock's delimiter ids
        # None: the pipeline's own scheduler (threshold= passed at each call); learn2pd gets the pipeline's filter
        # component at each call
        self.threshold = a["threshold"] if strategy is None else None
        policy = self.pipe.scheduler if strategy is None else self.scheduler
        if strategy is None:
            if self.threshold is not None and "threshold" not in policy.config:
                raise ValueError(f"threshold applies to the threshold, contiguous and learn2pd strategies; the "
                                 f"pipeline's scheduler {type(policy).__name__} has none (pass decoding=)")
            self._check_steps(policy, steps)
        if strategy == "learn2pd" and self.pipe.filter is None:
            raise ValueError(f"decoding learn2pd needs a Learn2PD filter, and {pretrained} has none (train one with "
                             "`vispec train filter`)")
        self.steps = steps if steps is not None or not policy.fixed_steps else self.gen_length
        # the decoding against the model (its family's caches and rules, the policy's limits), as every call runs it
        try:
            self.pipe.check_decoding(**self._decoding(self.options.temperature))
        except ValueError as err:
            what = f"decoding={decoding!r}" if decoding is not None else "the pipeline's own scheduler (no decoding=)"
            raise ValueError(f"pretrained={pretrained!r} cannot run {what}: {err}") from None
        self.decoding = decoding or f"{policy.strategy or type(policy).__name__} (the pipeline's scheduler)"
        self.pretrained = str(pretrained)
        self.mc_num, self.mc_batch_size, self.check_greedy, self.seed = mc_num, mc_batch_size, check_greedy, seed
        self.max_length = getattr(self.pipe.model.config, "max_sequence_length", None)
        self.speed = {"requests": 0, "generated_tokens": 0, "wall_s": 0.0, "nfe": 0, "canvas_tokens": 0}

    def _decoding(self, temperature: float) -> dict:
        """The pipeline's decoding keywords of a ``generate_until`` call at ``temperature``."""
        return dict(strategy=self.scheduler, threshold=self.threshold, cache=self.options.cache,
                    gen_length=self.gen_length, block_length=self.block_length, steps=self.steps,
                    temperature=temperature, guidance_scale=self.options.guidance_scale,
                    early_stop_eos=self.options.early_stop_eos, cache_reload_steps=self.options.cache_reload_steps,
                    **self.rule_options)

    # ------------------------------------------------------------------ setup
    def _check_steps(self, policy, steps: Optional[int]) -> None:
        """``steps`` fits the policy: only fixed-step policies take it, a multiple of the number of blocks."""
        if steps is not None and not policy.fixed_steps:
            raise ValueError(f"steps applies to fixed-step decoding (llada); {type(policy).__name__} commits "
                             "until each block is complete")
        if policy.fixed_steps:  # steps a multiple of the blocks (on a copy: each pipeline call sets its own)
            copy.deepcopy(policy).set_timesteps(self.gen_length if steps is None else steps, self.gen_length,
                                                self.block_length)

    @staticmethod
    def _check_folder(pretrained: str) -> dict:
        """The folder's ``model_index.json`` after checking it is a text pipeline whose weights fit their configs."""
        from vispec.models.checkpoints import check_pipeline_folder
        from vispec.pipelines.embedded import resolve_model_path

        return check_pipeline_folder(resolve_model_path(pretrained), "MaskedDiffusionLMPipeline",
                                     {"LlamaGenPipeline": "an image model", "UnifiedImagePipeline": "an image model"})

    @staticmethod
    def _batch_size(batch_size: Any, max_batch_size: Optional[int]) -> int:
        text = str(batch_size)
        if text.startswith("auto"):
            raise ValueError(f"batch_size={batch_size!r}: vispec-dllm takes a fixed batch size (prompts per pipeline "
                             "call); pass --batch_size N")
        if max_batch_size is not None:
            raise ValueError("max_batch_size goes with batch_size=auto, which vispec-dllm does not support")
        if not text.isdigit():
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        return check_int("batch_size", int(text), minimum=1)

    @staticmethod
    def _pick_device(device: Optional[str], warn: bool = True) -> torch.device:
        from vispec.eval.bench.report import check_device

        if device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if not isinstance(device, str):
            raise ValueError(f"device must be cpu, cuda or cuda:N (a torch device), got {device!r}")
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError):
            return check_device(device)  # its error, naming the device
        if kind == "cuda" and not torch.cuda.is_available():
            # lm-eval's CLI passes --device cuda:0 unless told otherwise; its HF model falls back the same way
            if warn:
                logger.warning("vispec-dllm: device %r requested but CUDA is not available; running on cpu", device)
            return torch.device("cpu")
        return check_device(device)

    @staticmethod
    def _load(pretrained: str):
        from vispec.pipelines import MaskedDiffusionLMPipeline
        from vispec.pipelines.embedded import resolve_model_path

        return MaskedDiffusionLMPipeline.from_pretrained(resolve_model_path(pretrained))

    # ------------------------------------------------------------------ lm-eval's interface
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", self.pretrained)).replace("/", "__")

    def chat_template(self, chat_template: Any = False) -> Optional[str]:
        template = getattr(self.tokenizer, "chat_template", None)
        if chat_template and not template:
            raise ValueError(f"--apply_chat_template: the tokenizer of {self.pretrained} has no chat template")
        return template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat rendered by the tokenizer's template, as the pipeline renders a prompt (``add_generation_prompt``
        False continues the last assistant message, as lm-eval asks for prefilled answers)."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict:
        """What lm-eval records in its results' ``config``: the decoding and the measured speed."""
        speed = dict(self.speed)
        if speed["wall_s"] > 0:
            speed["tokens_per_s"] = speed["generated_tokens"] / speed["wall_s"]
        if speed["nfe"] > 0:
            speed["tokens_per_forward"] = speed["canvas_tokens"] / speed["nfe"]
        return {"vispec": {"pretrained": self.pretrained, "decoding": self.decoding, "gen_length": self.gen_length,
                           "block_length": self.block_length, "steps": self.steps, "mc_num": self.mc_num,
                           "mc_batch_size": self.mc_batch_size, "speed": speed}}

    # ------------------------------------------------------------------ tokenisation
    def _encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a text that already starts with BOS (a chat-templated context) gets no special tokens."""
        bos = getattr(self.tokenizer, "bos_token", None)
        add = not (bos and text.startswith(bos))
        return self.tokenizer(text, add_special_tokens=add)["input_ids"]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's ``TemplateLM`` split: trailing spaces of the context belong to the continuation, and the
        continuation's ids are the tail of the whole text's encoding."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self._encode(context + continuation)
        context_ids = self._encode(context) if context else []
        return context_ids, whole[len(context_ids):]

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``[B, P]`` ids and attention mask."""
        from vispec.pipelines.masked_diffusion_lm import left_pad

        return left_pad(rows, self.tokenizer.pad_token_id)

    def _check_fits(self, what: str, index: int, length: int) -> None:
        if self.max_length is not None and length > self.max_length:
            raise ValueError(f"request {index}: {what} is {length} tokens, more than the model's max_sequence_length "
                             f"({self.max_length})")

    # ------------------------------------------------------------------ generation
    def _gen_settings(self, index: int, kwargs: Any) -> tuple[list[str], Optional[int], float]:
        """A request's ``until`` strings, ``max_gen_toks`` and temperature; unknown generation keywords are an error."""
        if not isinstance(kwargs, dict):
            raise ValueError(f"request {index}: generation keywords must be a dict, got {type(kwargs).__name__}")
        unknown = sorted(set(kwargs) - set(_GEN_KWARGS))
        if unknown:
            raise ValueError(f"request {index}: vispec-dllm does not support generation keyword(s) {unknown}; it "
                             f"takes {list(_GEN_KWARGS)}")
        until = kwargs.get("until", [])
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(s, str) for s in until):
            raise ValueError(f"request {index}: until must be a string or a list of strings, got {until!r}")
        max_gen_toks = kwargs.get("max_gen_toks")
        if max_gen_toks is not None:
            check_int("max_gen_toks", max_gen_toks, minimum=1)
        temperature = float(kwargs.get("temperature", self.options.temperature))
        check_number("temperature", temperature, minimum=0)
        do_sample = kwargs.get("do_sample", temperature > 0)
        if do_sample and temperature == 0:
            raise ValueError(f"request {index}: do_sample=True with temperature=0; give a temperature > 0")
        return until, max_gen_toks, temperature if do_sample else 0.0

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.eos_token
        prepared = []
        for i, request in enumerate(requests):  # every request checked before any decoding
            context, kwargs = request.args
            until, max_gen_toks, temperature = self._gen_settings(i, kwargs)
            ids = self._encode(context)
            if not ids:
                raise ValueError(f"request {i}: the context encodes to no tokens")
            self._check_fits("the context plus gen_length", i, len(ids) + self.gen_length)
            prepared.append((ids, until + ([eos] if eos else []), max_gen_toks, temperature))
        texts: list[str] = [""] * len(prepared)
        # requests in order, batch_size per call; the requests of a call share a temperature
        chunks = [c for group in self._split_by(list(range(len(prepared))), lambda i: prepared[i][3]) for c in
                  (group[k:k + self.batch_size] for k in range(0, len(group), self.batch_size))]
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prepared), desc="vispec-dllm generate_until", disable=disable_tqdm or self.rank != 0)
        for chunk in chunks:
            ids, mask = self._padded([prepared[i][0] for i in chunk])
            temperature = prepared[chunk[0]][3]
            generators = [torch.Generator().manual_seed(request_seed(self.seed, requests[i].args[0])) for i in chunk]
            start = time.perf_counter()
            out = self.pipe(input_ids=ids, attention_mask=mask, generator=generators, output_type="seq",
                            **self._decoding(temperature))
            for row, i in enumerate(chunk):
                _, stops, max_gen_toks, _ = prepared[i]
                sequence = out.sequences[row:row + 1, :max_gen_toks] if max_gen_toks else out.sequences[row:row + 1]
                text = cut_at_stops(self.pipe.decode_texts(sequence)[0], stops)
                texts[i] = text
                self.speed["generated_tokens"] += len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            self.speed["wall_s"] += time.perf_counter() - start
            self.speed["requests"] += len(chunk)
            self.speed["nfe"] += sum(int(s["nfe"]) for s in out.stats)
            self.speed["canvas_tokens"] += sum(int(s["tokens"]) for s in out.stats)
            bar.update(len(chunk))
        bar.close()
        if self.speed["wall_s"] > 0:
            logger.info("vispec-dllm: %d generated tokens (after stop strings, EOS excluded) in %.2f s: %.1f tokens/s, "
                        "%.2f tokens per forward", self.speed["generated_tokens"], self.speed["wall_s"],
                        self.speed["generated_tokens"] / self.speed["wall_s"],
                        self.speed["canvas_tokens"] / max(self.speed["nfe"], 1))
        return texts

    @staticmethod
    def _split_by(order: list[int], key) -> list[list[int]]:
        groups: dict[Any, list[int]] = {}
        for i in order:
            groups.setdefault(key(i), []).append(i)
        return list(groups.values())

    # ------------------------------------------------------------------ likelihood
    def _generators(self, pairs: list[tuple[str, ...]]) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(request_seed(self.seed, *pair)) for pair in pairs]

    def _bounds(self, contexts: list[list[int]], continuations: list[list[int]], texts: list[tuple[str, ...]]) -> list[float]:
        from vispec.dllm.likelihood import log_likelihood_bound

        return log_likelihood_bound(self.pipe.model, [torch.tensor(c, dtype=torch.long) for c in contexts],
                                    [torch.tensor(c, dtype=torch.long) for c in continuations],
                                    mask_token_id=self.pipe.mask_token_id, generators=self._generators(texts),
                                    mc_num=self.mc_num, batch_size=self.mc_batch_size,
                                    guidance_scale=self.options.guidance_scale).tolist()

    def _greedy(self, contexts: list[list[int]], continuations: list[list[int]]) -> list[bool]:
        """LLaDA's ``suffix_greedy_prediction``: decoding the continuation's length one token per step by confidence
        (one block, no early stop) gives the continuation; batched by continuation length."""
        from vispec.dllm import LLaDAScheduler

        result = [False] * len(contexts)
        if not self.check_greedy:
            return result
        for group in self._split_by(list(range(len(contexts))), lambda i: len(continuations[i])):
            length = len(continuations[group[0]])
            for k in range(0, len(group), self.batch_size):
                chunk = group[k:k + self.batch_size]
                ids, mask = self._padded([contexts[i] for i in chunk])
                out = self.pipe(input_ids=ids, attention_mask=mask, strategy=LLaDAScheduler(), gen_length=length,
                                block_length=length, steps=length, early_stop_eos=False,
                                guidance_scale=self.options.guidance_scale, output_type="seq")
                targets = torch.tensor([continuations[i] for i in chunk], dtype=torch.long)
                for row, same in zip(chunk, (out.sequences.cpu() == targets).all(dim=1).tolist()):
                    result[row] = bool(same)
        return result

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        contexts, continuations, empty = [], [], []
        bos_id = self.tokenizer.bos_token_id
        for i, request in enumerate(requests):
            context, continuation = request.args
            context_ids, continuation_ids = self._encode_pair(context, continuation)
            if not context_ids and bos_id is not None:
                context_ids = [bos_id]  # an empty context conditions on BOS, as lm-eval's prefix token
            self._check_fits("the context plus the continuation", i, len(context_ids) + len(continuation_ids))
            contexts.append(context_ids)
            continuations.append(continuation_ids)
            empty.append(not continuation_ids)
        scored = [i for i in range(len(requests)) if not empty[i]]
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # an empty continuation: log 1, greedy
        if scored:
            values = self._bounds([contexts[i] for i in scored], [continuations[i] for i in scored],
                                  [tuple(requests[i].args) for i in scored])
            greedy = self._greedy([contexts[i] for i in scored], [continuations[i] for i in scored])
            for i, value, is_greedy in zip(scored, values, greedy):
                results[i] = (float(value), bool(is_greedy))
                self.cache_hook.add_partial("loglikelihood", requests[i].args, results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        if self.max_length is None:
            raise ValueError("loglikelihood_rolling needs the model's max_sequence_length (its config has none)")
        prefix = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
        windows, owners = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tokenizer(text, add_special_tokens=False)["input_ids"], prefix_token=prefix,
                    max_seq_len=self.max_length - 1, context_len=1)):  # a window and its prefix token fit
                windows.append((list(context), list(target)))
                owners.append(i)
        totals = [0.0] * len(requests)
        if windows:
            values = self._bounds([w[0] for w in windows], [w[1] for w in windows],
                                  [(requests[i].args[0], str(k)) for k, i in enumerate(owners)])
            for i, value in zip(owners, values):
                totals[i] += value
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals


def register() -> None:
    """Register :class:`VispecDLLM` as ``vispec-dllm`` in lm-eval's model registry (once; an entry already there,
    e.g. the entry point lm-eval's plugin discovery registered, is kept)."""
    from lm_eval.api import registry

    table = getattr(registry, "model_registry", None)
    if table is None:  # lm-eval < 0.4.9: a plain dict
        table = registry.MODEL_REGISTRY
    if MODEL_NAME not in table:
        registry.register_model(MODEL_NAME)(VispecDLLM)


def check_command_line(args: list[str]) -> None:
    """Before lm-eval indexes its tasks (minutes): when ``args`` (lm-eval's command line) run ``--model
    vispec-dllm``, its ``--model_args``, ``--batch_size`` and ``--device`` are checked as the constructor checks
    them, the decoding against the model's family included, without loading the weights
    (:meth:`VispecDLLM.check_arguments`): a ``ValueError`` naming the argument. A command line lm-eval itself
    refuses, or one for another model, is left to lm-eval (which reports its own errors before indexing)."""
    import contextlib
    import io

    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    cli = HarnessCLI()
    argv = list(args)
    if argv and argv[0] not in cli._subparsers.choices:  # lm-eval's legacy form: `run` implied
        argv.insert(0, "run")
    quiet = io.StringIO()
    logging.disable(logging.CRITICAL)  # lm-eval logs its own notes (--limit, ...) when it parses them again
    try:
        with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
            namespace, _ = cli._parser.parse_known_args(argv)
            if getattr(namespace, "command", None) != "run":
                return
            config = EvaluatorConfig.from_cli(namespace)
    except (Exception, SystemExit):  # noqa: BLE001 - lm-eval's own refusal: it reports it, in its words
        return
    finally:
        logging.disable(logging.NOTSET)
    if config.model != MODEL_NAME:
        return
    VispecDLLM.check_arguments(config.model_args, {"batch_size": config.batch_size,
                                                   "max_batch_size": config.max_batch_size, "device": config.device})


def _quiet_git_commit_hash() -> Optional[str]:
    """lm-eval's ``get_git_commit_hash`` (the commit of the working directory, recorded in its results) without
    git's "fatal: not a git repository" on stderr when the directory is not in one."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, OSError):  # not a repository, or no git
        return get_commit_from_path(os.getcwd())


def _patch_lm_eval() -> None:
    """What the launcher changes in lm-eval for this process: its git look-up is silent (:func:`_quiet_git_commit_hash`),
    and its task index (lm-eval reads every task's YAML before the first request, minutes) says on stderr when it
    starts and when it is done."""
    import lm_eval.evaluator
    import lm_eval.loggers.utils
    from lm_eval.tasks.manager import TaskManager

    for module in (lm_eval.loggers.utils, lm_eval.evaluator):
        if hasattr(module, "get_git_commit_hash"):
            module.get_git_commit_hash = _quiet_git_commit_hash
    index = TaskManager.__init__
    if getattr(index, "vispec_progress", False):
        return

    def indexed(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        print("lm-eval: indexing tasks (it reads every task's YAML first; this can take minutes)...", file=sys.stderr,
              flush=True)
        index(self, *args, **kwargs)
        count = len(getattr(self, "all_tasks", ()) or ())
        print(f"lm-eval: indexed {count} tasks in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    indexed.vispec_progress = True
    TaskManager.__init__ = indexed


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m vispec.eval.lm_eval_model ARGS``: lm-eval's CLI with ``vispec-dllm`` registered and vispec's local
    tasks on ``--include_path`` when none is given. ``--model vispec-dllm``'s arguments are checked before lm-eval
    starts (:func:`check_command_line`; a bad one exits with status 2 and one ``vispec-dllm: error:`` line), lm-eval's
    task indexing prints progress on stderr and its git look-up prints nothing (:func:`_patch_lm_eval`)."""
    from lm_eval.__main__ import cli_evaluate

    from vispec.eval.lm_eval_tasks import TASKS_DIR

    args = list(sys.argv[1:] if argv is None else argv)
    asks_help = not args or any(a in ("-h", "--help") for a in args)
    if not asks_help and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", TASKS_DIR]
    register()
    if not asks_help:
        try:
            check_command_line(args)
        except ValueError as err:
            text = " ".join(str(err).split())
            print(f"{MODEL_NAME}: error: {text if text.startswith('--') else '--model_args: ' + text}", file=sys.stderr)
            raise SystemExit(2) from None
    _patch_lm_eval()
    sys.argv = [sys.argv[0] if sys.argv else "lm_eval", *args]
    cli_evaluate()


if __name__ == "__main__":  # run through the module's own name, so the registered class is vispec's
    from vispec.eval.lm_eval_model import main as _main

    _main()
else:
    register()
