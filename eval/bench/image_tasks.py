"""What ``vispec bench image`` does differently for each kind of image model: one *task* object per kind.

:func:`vispec.eval.bench.image.run_image_bench` runs one algorithm (latency, batched quality, AR seed noise,
throughput sweep) on a task; the task knows the conditions, how to generate and how to judge:

* :class:`ClassImageTask` (``"class-to-image"``, a ``LlamaGenPipeline`` such as tiny-c2i): conditions are class
  labels ``i % num_classes``; quality is the evaluator's top-1 accuracy (class adherence) and FID against
  held-out real crops with the evaluator's penultimate features; the reference is the evaluator on held-out
  crops and the FID between two disjoint sets of them (the floor);
* :class:`EditImageTask` (``"image-to-image"``, a ``UnifiedImagePipeline`` marked ``image_to_image`` such as
  tiny-edit): held-out scene pairs (an instruction and a source picture), judged as text-to-image against the
  target caption, with the step compression binned by how much of the picture the edit keeps;
* :class:`TextImageTask` (``"text-to-image"``, a ``UnifiedImagePipeline`` such as tiny-t2i): conditions are
  held-out captions with their sizes (:class:`~vispec.eval.bench.scenes.SceneSampler` ``("test", seed)``, scenes
  of 64x64 and 64x96); quality is prompt-following accuracy from the programmatic scene checks
  (:func:`~vispec.eval.bench.scene_checks.check_images`: ``accuracy`` = every asked attribute right, and the
  per-attribute fractions), CLIP score against the captions (:func:`~vispec.eval.bench.clip_score.clip_score`,
  the model folder's ``clip`` CLIP by default) and FID against held-out real renders with the CLIP's projected
  image embeddings as features (the processor squeezes every image to the CLIP's input, so both sizes share
  one feature space); the reference is the scene checks and the CLIP score of real renders with their true
  captions and with mismatched ones (captions rolled by one), and the FID between two disjoint sets of real
  renders (the floor). Unified-token models decode eagerly (``UnifiedTokenModel.compilable`` is False).

Every image has its own seeded generator, and text-to-image batches are formed per size in the order of the
conditions, so a method's images do not depend on the batch size or on which images share a batch.

:func:`load_task` picks the task from the folder's ``model_index.json`` and checks the options (``--evaluator``
is for class-to-image models, ``--clip`` for text-to-image ones) before anything is loaded.
"""

from __future__ import annotations

import copy
import os
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from vispec.eval.bench import image as bench_image
from vispec.eval.bench.image import ImageBenchConfig

REAL_SEED_OFFSET = 7  # the reference images use seed cfg.seed + 7: other images than the conditions' stream
TEXT_MODEL_HINT = {"MaskedDiffusionLMPipeline": "a text model: use `vispec bench text`"}
Tick = Optional[Callable[[int], None]]
Images = Union[Tensor, list[Tensor]]  # uint8 [N, 3, H, W] (one size) or a list of uint8 [3, H, W] (sizes may differ)


class Prompt(NamedTuple):
    """One text-to-image condition: a caption and the image size (pixels) it is generated at."""

    caption: str
    height: int
    width: int


def held_out_prompts(n: int, seed: int) -> list[Prompt]:
    """The first ``n`` held-out captions of ``SceneSampler("test", seed)`` with their scenes' sizes (64x64 or 64x96)."""
    from vispec.eval.bench.scenes import SceneSampler

    batch = SceneSampler("test", seed=seed).sample(n)
    return [Prompt(caption, scene.height, scene.width) for caption, scene in zip(batch.captions, batch.scenes)]


class ImageTask(ABC):
    """The interface :func:`~vispec.eval.bench.image.run_image_bench` runs on (module docstring).

    ``kind`` names the task; ``noise_metrics`` are the quality metrics that get AR seed noise, z-scores and
    within-noise flags; ``fid_features`` says where the FID features come from; ``compile_note`` (progress) and
    ``compile_reason`` (table) why a method has no compiled throughput rows. ``pipe`` is the loaded pipeline (its
    ``decoding_config`` gives the defaults).
    """

    kind: ClassVar[str]
    noise_metrics: ClassVar[tuple[str, ...]]
    fid_features: ClassVar[str]
    compile_note: ClassVar[str]
    compile_reason: ClassVar[str]

    def __init__(self, cfg: ImageBenchConfig, folder: str, pipe: Any):
        self.cfg, self.folder, self.pipe = cfg, folder, pipe
        self.reference: Optional[Tensor] = None  # FID features of the real images (set by real_stats)
        self.model_note: Optional[str] = None  # an inflated transformer: whose logits at which cost (set by inflate)
        self.inflation: Optional[dict] = None  # and its sizes (InflationPlan.to_dict)

    @classmethod
    @abstractmethod
    def check(cls, cfg: ImageBenchConfig, folder: str) -> None:
        """ValueError for a folder of another kind or options that do not fit this task; loads nothing."""

    @classmethod
    @abstractmethod
    def load(cls, cfg: ImageBenchConfig, folder: str) -> "ImageTask":
        """The pipeline (on ``cfg.device``, progress bar off) and the quality model."""

    @abstractmethod
    def check_method(self, method: str) -> None:
        """ValueError for a decoding method this pipeline cannot run (acceptance tables are built here)."""

    @abstractmethod
    def compilable(self, method: str) -> bool:
        """Whether ``compile=True`` applies to ``method`` (else: eager throughput rows only)."""

    @abstractmethod
    def conditions(self, n: int) -> Sequence:
        """The conditions of images ``0 .. n-1`` (deterministic in ``cfg.seed``; a prefix of a longer list)."""

    @abstractmethod
    def warm_up(self) -> None:
        """One untimed generation (allocations, first-call costs)."""

    @abstractmethod
    def generate(self, method: str, conditions: Sequence, seeds: list[int], batch_size: int, compile: bool = False,
                 tick: Tick = None) -> tuple[Images, list[dict], float]:
        """``(uint8 images in the order of conditions, per-image stats, wall seconds)``: image ``i`` from
        ``conditions[i]`` with a generator seeded ``seeds[i]``; ``tick(n)`` after every batch of ``n`` images."""

    def generate_items(self, method: str, conditions: Sequence, seeds: list[int], batch_size: int,
                       ) -> tuple[Images, list[dict], list[dict[str, Tensor]], float]:
        """As :meth:`generate`, with per image the tensors a stored result keeps (here: the uint8 image)."""
        images, stats, wall = self.generate(method, conditions, seeds, batch_size)
        return images, stats, [{"image": image} for image in images], wall

    @abstractmethod
    def real_stats(self, n: int) -> dict:
        """The quality metrics of real held-out images and the FID floor; keeps ``n`` of them as the FID reference."""

    @abstractmethod
    def judge(self, images: Images, conditions: Sequence) -> list[tuple[dict, dict[str, Tensor]]]:
        """Per image, what the quality metrics need of it: record entries (JSON: the evaluator's class, the scene
        checks, a CLIP cosine) and tensors (``fid_features``, float64 ``[D]``). Computed where the images are
        made (each process judges its own, :mod:`vispec.eval.bench.distributed`); an image's entries depend on the
        images judged with it only through float rounding of a batched forward."""

    @abstractmethod
    def quality_of(self, judged: Sequence[tuple[dict, dict[str, Tensor]]], conditions: Sequence) -> dict:
        """The quality metrics (``noise_metrics`` among them) from every image's :meth:`judge` entries, in order."""

    def quality(self, images: Images, conditions: Sequence) -> dict:
        """The quality metrics of generated images against their conditions."""
        return self.quality_of(self.judge(images, conditions), conditions)

    @staticmethod
    @abstractmethod
    def describe_real(real: dict) -> str:
        """One line on the real images (:meth:`real_stats`), for the progress and the table."""

    def inflate(self, name: str, target: str) -> None:
        """Replace the pipeline's transformer (a LlamaGen GPT or a Chameleon) by its inflation to GPT config ``target``
        (``<name>@<target>``: the same logits at the target's cost, :func:`vispec.models.inflate.inflate`, extra weights
        from ``cfg.seed``). Drafters (``drafter``, ``gad_drafter``) stay as they are: they read tokens, not the
        transformer's hidden states; GSD's token-embedding distances do not change under zero padding."""
        from vispec.models.inflate import inflate, inflation_note

        transformer = inflate(self.pipe.transformer, target, seed=self.cfg.seed)
        self.pipe.register_modules(transformer=transformer)
        self.model_note = inflation_note(name, transformer.inflation)
        self.inflation = transformer.inflation.to_dict()

    def run_config(self) -> dict:
        """What the result's ``config`` records about the task (and ``model_note`` for an inflated model)."""
        return {"task": self.kind, "fid_features": self.fid_features,
                **({"model_note": self.model_note, "inflation": self.inflation} if self.model_note else {})}

    def _reference(self) -> Tensor:
        if self.reference is None:
            raise RuntimeError("real_stats() must run before quality(): it sets the FID reference")
        return self.reference


# ------------------------------------------------------------------------------------------- class-to-image
class ClassImageTask(ImageTask):
    """A ``LlamaGenPipeline`` (tiny-c2i): class labels, the evaluator's accuracy and FID (module docstring).

    Generation and FID go through :func:`vispec.eval.bench.image.generate_uint8` and
    :func:`~vispec.eval.bench.image.fid_score` (looked up at call time)."""

    kind = "class-to-image"
    noise_metrics = ("fid", "accuracy")
    fid_features = "tiny-c2i evaluator penultimate layer (float64 Fréchet distance, torchmetrics' formulas)"
    compile_note = "run(s) their drafter eagerly"
    compile_reason = "draft-model decoding runs its drafter eagerly"

    def __init__(self, cfg: ImageBenchConfig, folder: str, pipe: Any, evaluator: nn.Module):
        super().__init__(cfg, folder, pipe)
        self.evaluator = evaluator
        self.num_classes: int = pipe.transformer.config.num_classes
        self._fid_model: Optional[nn.Module] = None

    @staticmethod
    def evaluator_path(cfg: ImageBenchConfig, folder: str) -> str:
        return cfg.evaluator or os.path.join(folder, "evaluator")

    @classmethod
    def check(cls, cfg: ImageBenchConfig, folder: str) -> None:
        from vispec.models.checkpoints import check_pipeline_folder

        check_pipeline_folder(folder, "LlamaGenPipeline", TEXT_MODEL_HINT)
        if cfg.clip is not None:
            raise ValueError(f"--clip is for text-to-image models; {cfg.model} is a class-to-image LlamaGenPipeline, "
                             f"judged by its evaluator (--evaluator)")
        path = cls.evaluator_path(cfg, folder)
        if not os.path.isdir(path):
            raise ValueError(f"no evaluator at {path}: pass --evaluator (a CropClassifier folder)")

    @classmethod
    def load(cls, cfg: ImageBenchConfig, folder: str) -> "ClassImageTask":
        from vispec.eval.bench.evaluator import CropClassifier
        from vispec.models.checkpoints import diffusers_load_kwargs
        from vispec.pipelines import LlamaGenPipeline

        pipe = LlamaGenPipeline.from_pretrained(folder).to(cfg.device)
        pipe.set_progress_bar_config(disable=True)
        evaluator = CropClassifier.from_pretrained(cls.evaluator_path(cfg, folder), **diffusers_load_kwargs()).eval()
        return cls(cfg, folder, pipe, evaluator)

    def check_method(self, method: str) -> None:
        from vispec.decoding import DecodingConfig

        config = DecodingConfig.parse(method, base=self.pipe.decoding_config)
        if config.strategy == "sd" and self.pipe.drafter is None:
            raise ValueError(f"method {method!r} needs a drafter, but the pipeline {self.cfg.model!r} has none")
        if config.strategy == "gad" and getattr(self.pipe, "gad_drafter", None) is None:
            raise ValueError(f"method {method!r} needs a gad_drafter, but the pipeline {self.cfg.model!r} has none")
        self.pipe.acceptance_rule(config.rule)

    def compilable(self, method: str) -> bool:
        """``sd`` and ``gad`` run their drafter rounds eagerly (:func:`vispec.decoding.decode`)."""
        from vispec.decoding import DecodingConfig

        return DecodingConfig.parse(method).strategy in ("ar", "sjd", "mc-sjd", "sjd-pac", "auto")

    def conditions(self, n: int) -> Tensor:
        return torch.arange(n) % self.num_classes

    def warm_up(self) -> None:
        self.pipe(class_labels=[0], decoding="sjd", output_type="latent")

    def generate(self, method: str, conditions: Sequence, seeds: list[int], batch_size: int, compile: bool = False,
                 tick: Tick = None) -> tuple[Tensor, list[dict], float]:
        return bench_image.generate_uint8(self.pipe, method, conditions, seeds, batch_size, self.cfg, compile=compile,
                                          tick=tick)

    def generate_items(self, method: str, conditions: Sequence, seeds: list[int], batch_size: int,
                       ) -> tuple[Tensor, list[dict], list[dict[str, Tensor]], float]:
        """As :meth:`generate`, keeping each image's tokens (the images follow from them through the VQ decoder)."""
        tokens: list[Tensor] = []
        images, stats, wall = bench_image.generate_uint8(self.pipe, method, conditions, seeds, batch_size, self.cfg,
                                                         tokens=tokens)
        return images, stats, [{"tokens": t} for t in torch.cat(tokens)], wall

    def _features(self, images: Tensor) -> Tensor:
        """float64 FID features of uint8 images (a float64 copy of the evaluator, made once)."""
        from vispec.eval.bench.evaluator import FIDFeatures

        if self._fid_model is None:
            self._fid_model = FIDFeatures(copy.deepcopy(self.evaluator).double())
        return bench_image.evaluator_features(self._fid_model, images)

    def real_stats(self, n: int) -> dict:
        """Evaluator accuracy on ``n`` held-out crops (labels ``i % num_classes``), FID to ``n`` other ones."""
        from vispec.eval.bench.data import CropSampler
        from vispec.eval.bench.evaluator import classify_accuracy

        labels = torch.arange(2 * n) % self.num_classes
        real, _ = CropSampler("eval").sample(2 * n, torch.Generator().manual_seed(self.cfg.seed + REAL_SEED_OFFSET),
                                             labels=labels)
        features = self._features(real)
        self.reference = features[:n]
        return {"accuracy": classify_accuracy(self.evaluator, real[:n], labels[:n]),
                "fid_real_vs_real": bench_image.frechet_distance(features[:n], features[n:]), "images": n}

    @torch.no_grad()
    def judge(self, images: Images, conditions: Sequence) -> list[tuple[dict, dict[str, Tensor]]]:
        """The evaluator's class (float32, as :func:`~vispec.eval.bench.evaluator.classify_accuracy`) and the FID
        features of each image."""
        predicted = [p for lo in range(0, images.shape[0], 256)
                     for p in self.evaluator(images[lo : lo + 256].float() / 127.5 - 1.0).argmax(-1).tolist()]
        features = self._features(images)
        return [({"predicted": p}, {"fid_features": f}) for p, f in zip(predicted, features)]

    def quality_of(self, judged: Sequence[tuple[dict, dict[str, Tensor]]], conditions: Sequence) -> dict:
        labels = [int(c) for c in conditions]
        correct = sum(record["predicted"] == label for (record, _), label in zip(judged, labels))
        fake = torch.stack([tensors["fid_features"] for _, tensors in judged])
        return {"accuracy": correct / len(judged), "fid": bench_image.frechet_distance(self._reference(), fake)}

    @staticmethod
    def describe_real(real: dict) -> str:
        return f"real held-out crops: accuracy {real['accuracy']:.3f}, FID real vs real {real['fid_real_vs_real']:.3f}"


# -------------------------------------------------------------------------------------------- text-to-image
class CLIPFIDFeatures(nn.Module):
    """FID features of a text-to-image model's images: uint8 ``[N, 3, H, W]`` (or a list of ``[3, H, W]`` of any
    sizes) in, the CLIP's projected image embeddings ``[N, projection_dim]`` out (the processor resizes every
    image to the CLIP's input size). Also usable as ``torchmetrics FrechetInceptionDistance(feature=...)``."""

    def __init__(self, model: nn.Module, processor: Any):
        from vispec.eval.bench.clip_score import FeatureModel

        super().__init__()
        self.clip = FeatureModel(model)
        self.processor = processor
        self.num_features = int(model.config.projection_dim)

    def forward(self, images: Tensor) -> Tensor:
        weight = next(self.clip.parameters())  # the CLIP's device and dtype
        pixels = self.processor(images=[image.cpu() for image in images], return_tensors="pt")["pixel_values"]
        return self.clip.get_image_features(pixels.to(weight.device, weight.dtype))


def to_uint8(images: Tensor) -> Tensor:
    """The pipeline's ``output_type="pt"`` images (``[B, 3, H, W]`` in ``[0, 1]``) as uint8, rounded (as PIL output)."""
    return (images.float().clamp(0, 1) * 255).round().to(torch.uint8)


def generate_text_uint8(pipe: Any, method: str, prompts: Sequence[Prompt], seeds: list[int], batch_size: int,
                        cfg: ImageBenchConfig, compile: bool = False,
                        tick: Tick = None) -> tuple[list[Tensor], list[dict], float]:
    """uint8 ``[3, H, W]`` images, per-image stats and wall time of a ``UnifiedImagePipeline``, in the order of
    ``prompts``: one pipeline call per size and batch of up to ``batch_size`` images of that size (sizes in the
    order they first occur), image ``i`` with a generator seeded ``seeds[i]``; ``tick(n)`` after every call.
    ``compile`` is passed on only when True (the unified pipeline has no such argument today)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"prompts and seeds must have the same length, got {len(prompts)} and {len(seeds)}")
    groups: dict[tuple[int, int], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault((prompt.height, prompt.width), []).append(i)
    images: list[Optional[Tensor]] = [None] * len(prompts)
    stats: list[dict] = [{}] * len(prompts)
    extra = {"compile": True} if compile else {}
    start = time.perf_counter()
    for (height, width), indices in groups.items():
        for lo in range(0, len(indices), batch_size):
            chunk = indices[lo : lo + batch_size]
            out = pipe(prompt=[prompts[i].caption for i in chunk], height=height, width=width, decoding=method,
                       generator=[torch.Generator().manual_seed(seeds[i]) for i in chunk],
                       guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       output_type="pt", **extra)
            for i, image, stat in zip(chunk, to_uint8(out.images).cpu(), out.stats):
                images[i], stats[i] = image, stat
            if tick is not None:
                tick(len(chunk))
    if torch.device(pipe.device).type == "cuda":
        torch.cuda.synchronize(pipe.device)
    return images, stats, time.perf_counter() - start  # type: ignore[return-value]


class TextImageTask(ImageTask):
    """A ``UnifiedImagePipeline`` (tiny-t2i): held-out captions, scene checks, CLIP score, CLIP-feature FID."""

    kind = "text-to-image"
    noise_metrics = ("fid", "accuracy", "clip_score")
    fid_features = "CLIP projected image embeddings (float64 Fréchet distance, torchmetrics' formulas)"
    compile_note = "decode eagerly (a unified-token text-to-image model: UnifiedTokenModel refuses compile=True)"
    compile_reason = "unified-token models decode eagerly"

    def __init__(self, cfg: ImageBenchConfig, folder: str, pipe: Any, clip: tuple[nn.Module, Any], clip_path: str):
        super().__init__(cfg, folder, pipe)
        self.clip_model, self.clip_processor = clip
        self.clip_path = clip_path
        self._compiles = self.compile_supported(pipe)
        self._fid_model: Optional[nn.Module] = None

    @staticmethod
    def compile_supported(pipe: Any) -> bool:
        """Whether the unified adapter can compile and the pipeline takes ``compile`` (neither today)."""
        import inspect

        from vispec.models.unified import UnifiedTokenModel

        return bool(UnifiedTokenModel.compilable) and "compile" in inspect.signature(type(pipe).__call__).parameters

    @staticmethod
    def clip_folder(cfg: ImageBenchConfig, folder: str) -> str:
        return cfg.clip or os.path.join(folder, "clip")

    @classmethod
    def check(cls, cfg: ImageBenchConfig, folder: str) -> None:
        from vispec.models.checkpoints import check_pipeline_folder

        check_pipeline_folder(folder, "UnifiedImagePipeline")
        if cfg.evaluator is not None:
            raise ValueError(f"--evaluator is for class-to-image models; {cfg.model} is a text-to-image "
                             f"UnifiedImagePipeline, judged by scene checks and a CLIP (--clip)")
        path = cls.clip_folder(cfg, folder)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"no CLIP at {path}: pass --clip (a folder with a saved CLIPModel and CLIPProcessor)")

    @classmethod
    def load(cls, cfg: ImageBenchConfig, folder: str) -> "TextImageTask":
        from vispec.eval.bench.clip_score import load_clip
        from vispec.pipelines import UnifiedImagePipeline

        pipe = UnifiedImagePipeline.from_pretrained(folder).to(cfg.device)
        pipe.set_progress_bar_config(disable=True)
        path = cls.clip_folder(cfg, folder)
        return cls(cfg, folder, pipe, load_clip(path), path)

    def run_config(self) -> dict:
        from vispec.eval.bench.scenes import DEFAULT_SIZES

        return {**super().run_config(), "clip": self.clip_path, "sizes": [list(hw) for hw in DEFAULT_SIZES],
                "conditions": f"held-out captions: SceneSampler('test', seed={self.cfg.seed})",
                "reference": f"held-out renders: SceneSampler('test', seed={self.cfg.seed + REAL_SEED_OFFSET})"}

    def check_method(self, method: str) -> None:
        from vispec.decoding import DecodingConfig

        config = DecodingConfig.parse(method, base=self.pipe.decoding_config)
        if config.strategy == "sd":
            raise ValueError(f"method {method!r} needs a drafter model; the text-to-image pipeline {self.cfg.model!r} "
                             f"has none: use ar, sjd or mc-sjd (with any acceptance rule)")
        height, width = self.pipe.config.default_height, self.pipe.config.default_width
        self.pipe.acceptance_rule(config.rule, self.pipe.unified_model(self.pipe.layout(height, width)))

    def compilable(self, method: str) -> bool:
        return self._compiles

    def conditions(self, n: int) -> list[Prompt]:
        return held_out_prompts(n, self.cfg.seed)

    def warm_up(self) -> None:
        prompt = self.conditions(1)[0]
        self.pipe(prompt=[prompt.caption], height=prompt.height, width=prompt.width, decoding="sjd", output_type="latent")

    def generate(self, method: str, conditions: Sequence, seeds: list[int], batch_size: int, compile: bool = False,
                 tick: Tick = None) -> tuple[list[Tensor], list[dict], float]:
        if compile and not self._compiles:
            raise ValueError("compile=True: unified-token (text-to-image) models decode eagerly")
        return generate_text_uint8(self.pipe, method, conditions, seeds, batch_size, self.cfg, compile=compile, tick=tick)

    def _features(self, images: Images) -> Tensor:
        """float64 FID features (the CLIP's projected image embeddings, a float64 copy of the CLIP made once) of
        uint8 images, 256 at a time; the processor squeezes every size to the CLIP's input."""
        if self._fid_model is None:
            # not .set_dtype-style casting of everything: the CLIP's integer buffers (position ids) stay integers
            self._fid_model = CLIPFIDFeatures(copy.deepcopy(self.clip_model).double().eval(), self.clip_processor)
        images = list(images)
        with torch.no_grad():
            return torch.cat([self._fid_model(images[lo : lo + 256]).double().cpu() for lo in range(0, len(images), 256)])

    def judge(self, images: Images, conditions: Sequence) -> list[tuple[dict, dict[str, Tensor]]]:
        """The scene checks (per attribute: right, wrong or not asked), the CLIP cosine to the caption and the FID
        features of each image."""
        from vispec.eval.bench.clip_score import clip_cosines
        from vispec.eval.bench.scene_checks import ATTRIBUTES, check_image

        images = list(images)
        captions = [c.caption if isinstance(c, Prompt) else c for c in conditions]
        cosines = clip_cosines(images, captions, self.clip_model, self.clip_processor).tolist()
        features = self._features(images)
        out = []
        for image, caption, cosine, feature in zip(images, captions, cosines, features):
            checks = check_image(image, caption)
            out.append(({"checks": {a: checks[a] for a in (*ATTRIBUTES, "overall")}, "clip_cosine": cosine},
                        {"fid_features": feature}))
        return out

    def quality_of(self, judged: Sequence[tuple[dict, dict[str, Tensor]]], conditions: Sequence) -> dict:
        """Scene-check accuracy (``accuracy`` = every asked attribute right) and per attribute, torchmetrics' CLIP
        score ``max(100 * mean cos, 0)`` and the CLIP-feature FID to the real renders."""
        from vispec.eval.bench.scene_checks import ATTRIBUTES

        by_attribute = {}
        for attribute in (*ATTRIBUTES, "overall"):
            judged_here = [r["checks"][attribute] for r, _ in judged if r["checks"][attribute] is not None]
            by_attribute[attribute] = sum(judged_here) / len(judged_here) if judged_here else None
        cosines = torch.tensor([r["clip_cosine"] for r, _ in judged], dtype=torch.float64)
        fake = torch.stack([tensors["fid_features"] for _, tensors in judged])
        return {"accuracy": by_attribute["overall"], "accuracy_by_attribute": by_attribute,
                "clip_score": float(max(100 * cosines.mean(), 0.0)),
                "fid": bench_image.frechet_distance(self._reference(), fake)}

    def real_stats(self, n: int) -> dict:
        """Scene checks and CLIP score of ``n`` held-out renders (true and rolled captions), FID to ``n`` other ones."""
        from vispec.eval.bench.clip_score import to_uint8 as float_to_uint8
        from vispec.eval.bench.scenes import SceneSampler

        batch = SceneSampler("test", seed=self.cfg.seed + REAL_SEED_OFFSET).sample(2 * n)
        return self._real_renders(float_to_uint8(batch.images), batch.captions[:n])  # uint8 levels in [-1, 1]: exact

    def _real_renders(self, real: Tensor, captions: list[str]) -> dict:
        """:meth:`real_stats` of ``2n`` uint8 renders, the first ``n`` with their ``captions``: the quality metrics of
        those ``n`` (against rolled captions too), the FID reference (they) and floor (to the other ``n``)."""
        from vispec.eval.bench.clip_score import clip_score

        n = len(captions)
        features = self._features(real)
        self.reference = features[:n]
        out = self.quality_of(TextImageTask.judge(self, real[:n], captions), captions)
        out.pop("fid")
        out["clip_score_mismatched"] = clip_score(real[:n], captions[1:] + captions[:1], self.clip_model,
                                                  self.clip_processor)
        out["fid_real_vs_real"] = bench_image.frechet_distance(features[:n], features[n:])
        out["images"] = n
        return out

    @staticmethod
    def describe_real(real: dict) -> str:
        return (f"real held-out renders: accuracy {real['accuracy']:.3f}, CLIP {real['clip_score']:.2f} with their captions "
                f"vs {real['clip_score_mismatched']:.2f} with mismatched ones, FID real vs real {real['fid_real_vs_real']:.3f}")


# ------------------------------------------------------------------------------------------- image-to-image
class EditRequest(NamedTuple):
    """One image-to-image condition: the edit ``instruction``, the ``source`` picture (uint8 ``[3, H, W]``), the
    caption the edited picture must match, the edit's kind and ``kept``: the fraction of the source's VQ codes the
    true edit keeps (the target render's codes aligned to the source outside the edit, then compared), how much of the
    picture must change."""

    instruction: str
    source: Tensor
    target_caption: str
    kind: str
    kept: float


KEPT_BINS = (0.0, 0.6, 0.7, 0.8, 0.9, 1.0)  # the step-compression table's bins of ``kept``


def kept_bin(kept: float) -> str:
    """The :data:`KEPT_BINS` interval holding ``kept`` (the last one closed), as a label."""
    for lo, hi in zip(KEPT_BINS, KEPT_BINS[1:]):
        if kept < hi or hi == KEPT_BINS[-1]:
            return f"{lo:.2f}-{hi:.2f}"
    raise ValueError(f"kept must lie in [0, 1], got {kept}")  # pragma: no cover


class EditImageTask(TextImageTask):
    """A ``UnifiedImagePipeline`` trained for image-to-image (``image_to_image`` in its config; tiny-edit): held-out
    scene pairs (:class:`~vispec.eval.bench.scene_edits.EditSampler` ``("test", seed)``), each an instruction and a
    source picture; the edited picture is judged against the target caption (scene checks: the edited attribute and
    the untouched ones), by CLIP score of the target caption and by CLIP-feature FID to held-out target renders.
    Per image the stats carry the request's ``request_kept`` (:class:`EditRequest`) and the output's
    ``source_kept``, so :func:`vispec.eval.bench.image.format_kept_table` shows step compression against how much
    of the picture the edit keeps."""

    kind = "image-to-image"

    @classmethod
    def check(cls, cfg: ImageBenchConfig, folder: str) -> None:
        super().check(cfg, folder)
        if not image_to_image(folder):
            raise ValueError(f"{cfg.model} is not an image-to-image model (image_to_image in its model_index.json)")

    def run_config(self) -> dict:
        return {**ImageTask.run_config(self), "clip": self.clip_path, "sizes": [[64, 64]],
                "conditions": f"held-out scene pairs: EditSampler('test', seed={self.cfg.seed})",
                "reference": f"held-out target renders: EditSampler('test', seed={self.cfg.seed + REAL_SEED_OFFSET})"}

    def conditions(self, n: int) -> list[EditRequest]:
        from vispec.eval.bench.clip_score import to_uint8 as float_to_uint8
        from vispec.eval.bench.scene_edits import EditSampler, aligned_target_codes
        from vispec.models.llamagen_vq import encode_to_tokens

        pairs = EditSampler("test", seed=self.cfg.seed).sample(n)
        if not pairs:
            return []
        with torch.no_grad():
            device = self.pipe._execution_device
            source_px, target_px = torch.stack([p.source for p in pairs]), torch.stack([p.target for p in pairs])
            source = encode_to_tokens(self.pipe.vqvae, source_px.to(device)).cpu()
            target = aligned_target_codes(source, encode_to_tokens(self.pipe.vqvae, target_px.to(device)).cpu(),
                                          source_px, target_px)
        kept = (source == target).flatten(1).float().mean(1).tolist()
        return [EditRequest(p.instruction, float_to_uint8(p.source[None])[0], p.target_caption, p.kind, k)
                for p, k in zip(pairs, kept)]

    def warm_up(self) -> None:
        request = self.conditions(1)[0]
        self.pipe(prompt=[request.instruction], image=request.source[None].float() / 255, decoding="sjd",
                  output_type="latent")

    def generate(self, method: str, conditions: Sequence, seeds: list[int], batch_size: int, compile: bool = False,
                 tick: Tick = None) -> tuple[list[Tensor], list[dict], float]:
        if compile:
            raise ValueError("compile=True: unified-token (image-to-image) models decode eagerly")
        if len(conditions) != len(seeds):
            raise ValueError(f"conditions and seeds must have the same length, got {len(conditions)} and {len(seeds)}")
        images: list[Tensor] = []
        stats: list[dict] = []
        cfg = self.cfg
        start = time.perf_counter()
        for lo in range(0, len(conditions), batch_size):
            chunk = conditions[lo : lo + batch_size]
            out = self.pipe(prompt=[c.instruction for c in chunk], image=torch.stack([c.source for c in chunk]).float() / 255,
                            decoding=method, generator=[torch.Generator().manual_seed(s) for s in seeds[lo : lo + batch_size]],
                            guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k,
                            top_p=cfg.top_p, output_type="pt")
            images += list(to_uint8(out.images).cpu())
            stats += [{**stat, "request_kept": c.kept, "edit_kind": c.kind} for stat, c in zip(out.stats, chunk)]
            if tick is not None:
                tick(len(chunk))
        if torch.device(self.pipe.device).type == "cuda":
            torch.cuda.synchronize(self.pipe.device)
        return images, stats, time.perf_counter() - start

    def judge(self, images: Images, conditions: Sequence) -> list[tuple[dict, dict[str, Tensor]]]:
        return super().judge(images, [c.target_caption if isinstance(c, EditRequest) else c for c in conditions])

    def real_stats(self, n: int) -> dict:
        """Scene checks and CLIP score of ``n`` held-out target renders (their captions, and rolled ones), FID to ``n``
        other ones."""
        from vispec.eval.bench.clip_score import to_uint8 as float_to_uint8
        from vispec.eval.bench.scene_edits import EditSampler

        pairs = EditSampler("test", seed=self.cfg.seed + REAL_SEED_OFFSET).sample(2 * n)
        return self._real_renders(float_to_uint8(torch.stack([p.target for p in pairs])),
                                  [p.target_caption for p in pairs[:n]])

    @staticmethod
    def describe_real(real: dict) -> str:
        return (f"real held-out edit targets: accuracy {real['accuracy']:.3f}, CLIP {real['clip_score']:.2f} with their "
                f"captions vs {real['clip_score_mismatched']:.2f} with mismatched ones, FID real vs real "
                f"{real['fid_real_vs_real']:.3f}")


TASKS: dict[str, type[ImageTask]] = {ClassImageTask.kind: ClassImageTask, TextImageTask.kind: TextImageTask,
                                     EditImageTask.kind: EditImageTask}


def image_to_image(folder: str) -> bool:
    """Whether a pipeline folder's ``model_index.json`` marks its model as trained for image-to-image requests."""
    import json

    with open(os.path.join(folder, "model_index.json")) as f:
        return bool(json.load(f).get("image_to_image", False))


def task_class(folder: str) -> type[ImageTask]:
    """The task of a pipeline folder: image-to-image for a ``UnifiedImagePipeline`` marked ``image_to_image``,
    text-to-image for another one, else class-to-image (whose check names any other kind)."""
    from vispec.models.checkpoints import pipeline_kind

    if pipeline_kind(folder) == "UnifiedImagePipeline":
        return EditImageTask if image_to_image(folder) else TextImageTask
    return ClassImageTask


def load_task(cfg: ImageBenchConfig) -> ImageTask:
    """Resolve ``cfg.model``, pick its task, check the folder and the options (before loading anything), load it.
    ``<model>@<GPT config>``: its transformer (LlamaGen or Chameleon) inflated to that size (:meth:`ImageTask.inflate`)."""
    from vispec.eval.bench.configs import check_inflated_model, split_inflated_name
    from vispec.pipelines.embedded import resolve_model_path

    name, target = split_inflated_name(cfg.model)
    if target is not None:
        check_inflated_model(cfg.model, trained=None)
    folder = resolve_model_path(name)
    cls = task_class(folder)
    cls.check(cfg, folder)
    task = cls.load(cfg, folder)
    if target is not None:
        task.inflate(name, target)
    return task
