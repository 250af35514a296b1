"""What both pipelines share: the diffusers contract around ``__call__`` (input checks, step-end callbacks,
``guidance_scale`` / ``num_timesteps`` / ``interrupt``), loading (the generic ``DiffusionPipeline`` loader,
``from_pipe``, folder checks) and offloading on any device."""

from __future__ import annotations

import json
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from torch import Tensor

from vispec.checks import check_int
from vispec.dllm import StopDecoding
from vispec.outputs import DecodeProgress

if TYPE_CHECKING:
    from vispec.decoding.windows import WindowStats

SHIM_HEADER = ("# Written by vispec's save_pretrained so that diffusers' generic loader finds this pipeline class:\n"
               "# DiffusionPipeline.from_pretrained(folder, trust_remote_code=True). It only imports vispec.\n")


class Interrupted(StopDecoding):
    """Raised from a step callback when ``pipe.interrupt`` is set: ends decoding with what is done (the text
    decoder returns its canvas; the image pipeline catches it and keeps the committed tokens)."""

    def __init__(self, progress: DecodeProgress):
        super().__init__("interrupted")
        self.progress = progress


def check_generator(generator: Any, batch: int) -> None:
    """``generator``: None, one ``torch.Generator``, or a list / tuple with one per sample (None entries allowed)."""
    if generator is None or isinstance(generator, torch.Generator):
        return
    if not isinstance(generator, (list, tuple)) or not all(g is None or isinstance(g, torch.Generator) for g in generator):
        got = type(generator).__name__ if not isinstance(generator, (list, tuple)) else \
            f"a list holding {sorted({type(g).__name__ for g in generator})}"
        raise TypeError(f"generator must be a torch.Generator or a list of them (one per sample), got {got}; "
                        "for a seed, pass torch.Generator().manual_seed(seed)")
    if len(generator) != batch:
        raise ValueError(f"generator list has {len(generator)} entries, expected one per sample ({batch})")


def interrupted_stats(stop: Interrupted, method: str) -> list[dict]:
    """Per-sample stats of a decode stopped by ``pipe._interrupt``: committed tokens and steps run."""
    return [{"method": method, "interrupted": True, "tokens": int(n), "steps": stop.progress.step}
            for n in stop.progress.num_committed.tolist()]


def grey_undecided(pixels: Tensor, undecided: Tensor) -> Tensor:
    """``pixels [B, 3, H, W]`` with the patches of undecided tokens (``undecided [B, h, w]``) mid-grey (0 in [-1, 1])."""
    if not bool(undecided.any()):
        return pixels
    factor = pixels.shape[-1] // undecided.shape[-1]
    patches = undecided.repeat_interleave(factor, 1).repeat_interleave(factor, 2)[:, None].to(pixels.device)
    return pixels.masked_fill(patches, 0.0)


def _plain_cpu(device: Any) -> Any:
    return torch.device("cpu") if device is not None and torch.device(device).type == "cpu" else device


class PipelineMixin:
    """diffusers' pipeline contract for vispec pipelines; list it before ``DiffusionPipeline`` in the bases.

    * ``check_common_inputs`` / ``step_callback``: ``check_inputs`` for the arguments every pipeline has, and
      the decoder callback that drives a progress bar and ``callback_on_step_end`` (``PipelineCallback`` and
      ``MultiPipelineCallbacks`` too); the returned dict is checked, and tensors the pipeline can apply are
      applied (:meth:`apply_callback_outputs`).
    * ``guidance_scale``, ``num_timesteps``, ``interrupt`` as in diffusers; setting ``pipe._interrupt = True``
      (from a callback) ends generation and returns what is done.
    * Loading: ``save_pretrained`` writes a one-line pipeline module next to ``model_index.json`` and names it
      in ``_class_name`` (diffusers' format for pipelines outside its package), so
      ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` finds the class; the class's own
      ``from_pretrained`` never runs that file. ``from_pipe`` passes every component on.
    * Offloading: on the CPU the hooks get the device ``cpu`` instead of diffusers' ``cpu:0`` (a CPU tensor
      is never on ``cpu:0``, so accelerate copied every weight on every call, and sequential offload failed
      outright: ``Parameter.to("cpu:0")`` returns a plain tensor that the hook cannot park on ``meta``).
    """

    _callback_tensor_inputs: list[str] = []
    _applied_callback_inputs: tuple[str, ...] = ()  # the inputs a returned value replaces (subclasses)
    _guidance_scale: float = 1.0
    _num_timesteps: int = 0
    _interrupt: bool = False
    last_stats: Optional[list[dict]] = None

    # ------------------------------------------------------------------ diffusers properties
    @property
    def guidance_scale(self) -> float:
        """The guidance scale of the current (or last) call; 1 means no guidance."""
        return self._guidance_scale

    @property
    def num_timesteps(self) -> int:
        """Decode steps of the current (or last) call: exact for one-token-per-step decoding, an upper bound
        for speculative and adaptive decoding, which commit several tokens per step."""
        return self._num_timesteps

    @property
    def interrupt(self) -> bool:
        """Set ``pipe._interrupt = True`` (e.g. in ``callback_on_step_end``) to stop and return what is done."""
        return self._interrupt

    # ------------------------------------------------------------------ inputs and callbacks
    def check_common_inputs(self, output_type: str, output_types: tuple[str, ...], per_prompt_name: str, per_prompt: int,
                            callback: Any, callback_inputs: Sequence[str]) -> list[str]:
        """Check what every pipeline takes; returns the callback's tensor inputs (a ``PipelineCallback``
        names its own, as in diffusers)."""
        if output_type not in output_types:
            raise ValueError(f"output_type must be one of {output_types}, got {output_type!r}")
        check_int(per_prompt_name, per_prompt, minimum=1)
        if isinstance(callback, (PipelineCallback, MultiPipelineCallbacks)):
            callback_inputs = callback.tensor_inputs
        elif callback is not None and not callable(callback):
            raise TypeError(f"callback_on_step_end must be callable, got {type(callback).__name__}")
        if isinstance(callback_inputs, str) or not isinstance(callback_inputs, (list, tuple)):
            raise TypeError(f"callback_on_step_end_tensor_inputs must be a list of names, got {callback_inputs!r}")
        unknown = [k for k in callback_inputs if k not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(f"callback_on_step_end_tensor_inputs {unknown} are not among {self._callback_tensor_inputs}")
        return list(callback_inputs)

    def decode_image_tokens(self, model: Any, condition: Any, *, num_tokens: int, sampling: Any, config: Any, rule: Any,
                            generator: Any, max_batch_size: Optional[int], callback_on_step_end: Optional[Callable],
                            tensor_inputs: Sequence[str], **decode_kwargs: Any) -> tuple[Tensor, list[dict]]:
        """The image pipelines' decode (:func:`vispec.decoding.decode`) with the call's resolved ``config`` and built
        ``rule``: resets the per-call state, drives a progress bar over generated tokens and the step callbacks,
        keeps the window chooser's measurements (:meth:`window_stats`), and on ``pipe._interrupt`` returns the
        committed tokens so far (-1 elsewhere) with ``"interrupted"`` stats. Returns ``(tokens [B, N], per-image stats)``."""
        from vispec.decoding import decode

        batch = condition.batch_size
        slots = batch if max_batch_size is None else min(batch, check_int("max_batch_size", max_batch_size, minimum=1))
        self.start_call(sampling.guidance_scale, -(-batch // slots) * (num_tokens - 1))
        with self.progress_bar(total=batch * num_tokens) as bar:
            bar.update(batch)  # token 0 comes from the prefill
            on_step = self.step_callback(bar, callback_on_step_end, tensor_inputs,
                                         {"tokens": lambda p: p.tokens, "num_committed": lambda p: p.num_committed})
            try:
                out = decode(model, condition, num_tokens=num_tokens, sampling=sampling, decoding=config,
                             generator=generator, callback=on_step, acceptance=rule, max_batch_size=max_batch_size,
                             window_stats=self.window_stats(), **decode_kwargs)
                return out.tokens, out.as_dicts()
            except Interrupted as stop:  # pipe._interrupt was set: what is done so far
                method = "ar" if config.strategy == "ar" else config.method  # as the decoders name themselves
                return stop.progress.tokens, interrupted_stats(stop, method)

    def window_stats(self) -> WindowStats:
        """The window chooser's measurements (``window="auto"``) of this pipeline's transformer, kept between calls.
        They belong to that model: a pipeline given another transformer starts a new set (the old model is only
        weakly referenced)."""
        from vispec.decoding.windows import WindowStats

        owner, stats = self.__dict__.get("_window_stats", (None, None))
        if stats is None or owner() is not self.transformer:
            stats = WindowStats()
            self._window_stats = (weakref.ref(self.transformer), stats)
        return stats

    def start_call(self, guidance_scale: float, num_timesteps: int) -> None:
        """Reset the per-call state diffusers' properties read."""
        self._guidance_scale, self._num_timesteps, self._interrupt = guidance_scale, num_timesteps, False
        self.last_stats = None

    def step_callback(self, bar: Any, callback_on_step_end: Optional[Callable], tensor_inputs: Sequence[str],
                      views: dict[str, Callable[[DecodeProgress], Tensor]]) -> Callable[[DecodeProgress], Optional[dict]]:
        """``on_step(progress)``: advance ``bar`` to the committed tokens, call
        ``callback_on_step_end(pipe, step, step, {name: views[name](progress)})`` with the requested inputs
        (copies), check what it returns and hand the applicable tensors to :meth:`apply_callback_outputs`,
        whose result ``on_step`` returns (for decoders that take edits). Raises :class:`Interrupted` once
        ``pipe._interrupt`` is set."""
        done = [int(bar.n)]

        def on_step(progress: DecodeProgress) -> Optional[dict]:
            total = int(progress.num_committed.sum())
            bar.update(total - done[0])
            done[0] = total
            edits = None
            if callback_on_step_end is not None:
                guidance = self._guidance_scale
                fresh = {k: views[k](progress) for k in tensor_inputs}
                outputs = callback_on_step_end(self, progress.step, progress.step, {k: v.clone() for k, v in fresh.items()})
                edits = self._checked_outputs(outputs, fresh)
                if self._guidance_scale != guidance:
                    edits = {**(edits or {}), "guidance_scale": self._guidance_scale}
                edits = self.apply_callback_outputs(edits, progress) if edits else None
            if self._interrupt:
                raise Interrupted(progress)
            return edits

        return on_step

    def _checked_outputs(self, outputs: Any, fresh: dict[str, Tensor]) -> dict[str, Tensor]:
        """The returned tensors that differ from what the callback was given; only applicable names may differ."""
        if outputs is None:
            return {}
        if not isinstance(outputs, dict):
            raise TypeError(f"callback_on_step_end must return a dict or None, got {type(outputs).__name__}")
        unknown = sorted(set(outputs) - set(self._callback_tensor_inputs))
        if unknown:
            raise ValueError(f"callback_on_step_end returned {unknown}, which are not among {self._callback_tensor_inputs}")
        changed = {}
        for name, value in outputs.items():
            given = fresh.get(name)
            if given is not None and isinstance(value, Tensor) and value.shape == given.shape and torch.equal(value.to(given.device), given):
                continue
            if name not in self._applied_callback_inputs:
                applied = list(self._applied_callback_inputs) or "none"
                raise ValueError(f"callback_on_step_end returned a changed {name!r}, which {type(self).__name__} cannot "
                                 f"apply (applied: {applied}); return the callback_kwargs it was given unchanged")
            changed[name] = value
        return changed

    def apply_callback_outputs(self, edits: dict[str, Any], progress: DecodeProgress) -> Optional[dict]:
        """Turn the changed callback outputs into the decoder's edit (subclasses); the base applies nothing."""
        if "guidance_scale" in edits:
            raise ValueError(f"{type(self).__name__} cannot change guidance_scale during decoding (the decoders fix the "
                             f"target distribution when they start); pass guidance_scale= to the call instead")
        return None

    # ------------------------------------------------------------------ loading
    @classmethod
    def _shim_module(cls) -> Optional[str]:
        """The file stem of the pipeline module ``save_pretrained`` writes (None for classes defined in ``__main__``,
        which no file can import: those folders load through the class's own ``from_pretrained`` only)."""
        if cls.__module__ in ("__main__", "builtins") or "<" in cls.__qualname__:
            return None
        return f"pipeline_{cls.__module__.rsplit('.', 1)[-1]}"

    def to_json_string(self) -> str:
        """diffusers' ``model_index.json``, with ``_class_name = [module, class]`` (its custom-pipeline format)."""
        text = super().to_json_string()
        module = self._shim_module()
        if module is None:
            return text
        config = json.loads(text)
        config["_class_name"] = [module, type(self).__name__]
        return json.dumps(config, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """diffusers' ``save_pretrained``, plus the pipeline module the generic loader imports."""
        super().save_pretrained(save_directory, **kwargs)
        module = self._shim_module()
        if module is not None:
            with open(os.path.join(save_directory, f"{module}.py"), "w") as handle:
                handle.write(f"{SHIM_HEADER}from {type(self).__module__} import {type(self).__name__}  # noqa: F401\n")

    @classmethod
    def load_config(cls, *args, **kwargs):
        """diffusers' ``load_config``; a ``[module, class]`` ``_class_name`` becomes the class name, so the class's
        own ``from_pretrained`` loads itself instead of importing the folder's pipeline module."""
        out = super().load_config(*args, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        name = config.get("_class_name")
        if isinstance(name, list) and len(name) == 2 and all(isinstance(n, str) for n in name):
            config["_class_name"] = name[1]
        return out

    @classmethod
    def check_folder(cls, path: str) -> None:
        """Before loading ``path``: it holds this kind of pipeline (or a subclass), and every component
        ``model_index.json`` names has its subfolder (and weights that fit its config, checked from the headers)."""
        from vispec.models.checkpoints import check_pipeline_folder

        index = check_pipeline_folder(path)
        found = index.get("_class_name")
        found = found[1] if isinstance(found, list) and len(found) == 2 else found
        related = {c.__name__ for c in cls.__mro__} | {c.__name__ for c in _subclasses(cls)}
        if found not in related:
            known = {c.__name__: c for c in _subclasses(PipelineMixin)}
            hint = f"; load it with {found}.from_pretrained" if found in known else ""
            raise ValueError(f"{path} holds a {found or 'pipeline of unknown kind'} (model_index.json), "
                             f"not a {cls.__name__}{hint}")

    @classmethod
    def from_pipe(cls, pipeline: Any, **kwargs):
        """diffusers' ``from_pipe``. diffusers keeps a model component only when its exact class is in the new
        ``__init__``'s annotation; vispec pipelines take any model with the decoding protocol, so every component
        the new pipeline takes is passed on explicitly (``kwargs`` still replace them)."""
        expected, _ = cls._get_signature_keys(cls)
        components = {k: v for k, v in pipeline.components.items() if k in expected and k not in kwargs}
        new = super().from_pipe(pipeline, **components, **kwargs)
        new.copy_state_from(pipeline)
        return new

    def copy_state_from(self, pipeline: Any) -> None:
        """Carry over state that is not a component (subclasses: e.g. LANTERN's neighbour tables)."""

    # ------------------------------------------------------------------ offloading
    def enable_model_cpu_offload(self, gpu_id: Optional[int] = None, device: Any = None) -> None:
        """diffusers' model offload (one model on the device at a time); also works with ``device="cpu"``."""
        super().enable_model_cpu_offload(gpu_id=gpu_id, device=device)
        self._plain_cpu_hooks()

    def enable_sequential_cpu_offload(self, gpu_id: Optional[int] = None, device: Any = None) -> None:
        """diffusers' sequential offload (weights on ``meta``, loaded per submodule); also with ``device="cpu"``."""
        super().enable_sequential_cpu_offload(gpu_id=gpu_id, device=device)
        self._plain_cpu_hooks()

    def _plain_cpu_hooks(self) -> None:
        for component in self.components.values():
            if not isinstance(component, torch.nn.Module):
                continue
            for module in component.modules():
                hook = getattr(module, "_hf_hook", None)
                for part in getattr(hook, "hooks", (hook,)):
                    if getattr(part, "execution_device", None) is not None:
                        part.execution_device = _plain_cpu(part.execution_device)


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found
