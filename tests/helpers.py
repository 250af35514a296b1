"""Tiny models and exact distributions shared by the tests."""

from __future__ import annotations

import itertools

import torch
from diffusers import VQModel
from torch import Tensor

from vispec.decoding import DecodingConfig
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.models.llamagen_vq import llamagen_vq_config
from vispec.pipelines import LlamaGenPipeline, MaskedDiffusionLMPipeline
from vispec.sampling import SamplingConfig, process_logits


def tiny_gpt(
    vocab_size: int = 4,
    block_size: int = 9,
    num_classes: int = 3,
    dim: int = 32,
    n_layer: int = 2,
    n_head: int = 2,
    std: float = 0.15,
    seed: int = 0,
    **overrides,
) -> LlamaGenGPT:
    """A randomly initialised c2i GPT whose next-token distributions are peaked and context dependent
    (large init std), so that sampler bugs change the output distribution visibly."""
    torch.manual_seed(seed)
    model = LlamaGenGPT(
        vocab_size=vocab_size,
        dim=dim,
        n_layer=n_layer,
        n_head=n_head,
        num_classes=num_classes,
        block_size=block_size,
        initializer_range=std,
        token_dropout_p=0.0,
        resid_dropout_p=0.0,
        ffn_dropout_p=0.0,
        **overrides,
    )
    torch.nn.init.normal_(model.output.weight, std=std)
    return model.eval()


TREE_SAMPLING = SamplingConfig(temperature=0.9, top_k=3, guidance_scale=2.0)  # the SJD-PAC / shape-chooser tests
TREE_LABELS = [0, 1, 2, 0, 1]


def tree_gpt() -> LlamaGenGPT:
    """The 8-token, 16-position model the SJD-PAC and shape-chooser tests decode (3 classes, CFG dropout)."""
    return tiny_gpt(vocab_size=8, block_size=16, num_classes=3, class_dropout_prob=0.1)


def tree_decode(model: LlamaGenGPT, spec, labels=TREE_LABELS, seeds=None, **kwargs):
    """Decode 16 tokens (a 4-wide grid) per label with ``spec``, one seeded generator per sample."""
    from vispec.decoding import decode

    seeds = range(len(labels)) if seeds is None else seeds
    return decode(model, LlamaGenCondition(class_labels=torch.tensor(labels)), num_tokens=16, sampling=TREE_SAMPLING,
                  decoding=spec, generator=[torch.Generator().manual_seed(s) for s in seeds], grid_width=4, **kwargs)


@torch.no_grad()
def exact_joint(model: LlamaGenGPT, class_label: int, num_tokens: int, sampling: SamplingConfig) -> tuple[Tensor, Tensor]:
    """All ``V ** num_tokens`` sequences and their exact AR probabilities (float64), by enumeration."""
    seqs, probs = exact_conditionals(model, class_label, num_tokens, sampling)
    return seqs, probs.gather(-1, seqs[..., None]).squeeze(-1).prod(dim=1)


@torch.no_grad()
def exact_conditionals(model: LlamaGenGPT, class_label: int, num_tokens: int, sampling: SamplingConfig) -> tuple[Tensor, Tensor]:
    """All ``V ** num_tokens`` sequences ``[S, N]`` and the processed targets ``[S, N, V]`` (float64) of each
    position given the sequence's prefix."""
    vocab = model.image_vocab_size
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=num_tokens)), dtype=torch.long)
    count = seqs.shape[0]
    condition = LlamaGenCondition(class_labels=torch.full((count,), class_label, dtype=torch.long))
    state, first = model.prefill(condition, guidance=sampling.uses_guidance, max_new_tokens=num_tokens, window=num_tokens)
    cond, uncond = first.cond, first.uncond
    if num_tokens > 1:
        rest = model.forward_window(state, seqs[:, :-1])
        cond = torch.cat([cond, rest.cond], dim=1)
        uncond = None if uncond is None else torch.cat([uncond, rest.uncond], dim=1)
    positions = torch.arange(num_tokens)[None].expand(count, -1)
    return seqs, process_logits(cond.double(), None if uncond is None else uncond.double(), positions, sampling)


def sequence_index(tokens: Tensor, vocab: int) -> Tensor:
    """Row-major index of each sequence in the enumeration order of :func:`exact_joint`."""
    weights = vocab ** torch.arange(tokens.shape[1] - 1, -1, -1)
    return (tokens.long() * weights).sum(dim=1)


def left_padded(rows: list[Tensor], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Left-pad 1-D token rows into ``(ids [B, W], attention_mask [B, W])`` (1 = real token)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


TEXT_WORDS = "what is one plus two three four five six seven eight nine ten sort reverse the list a b c d".split()


def tiny_text_pipeline(scheduler=None):
    """A 2-layer LLaDA mask predictor with a word tokenizer over :data:`TEXT_WORDS`, in a
    ``MaskedDiffusionLMPipeline`` (gen length 8, blocks of 4, progress bars off)."""
    from vispec.dllm import LLaDAScheduler
    from vispec.eval.train.tokenizer import train_word_tokenizer
    from vispec.models.llada import LLaDAModelLM
    from vispec.pipelines import MaskedDiffusionLMPipeline

    tokenizer = train_word_tokenizer([" ".join(TEXT_WORDS)])
    torch.manual_seed(0)
    vocab = len(tokenizer)
    model = LLaDAModelLM(d_model=32, n_heads=4, n_layers=2, mlp_hidden_size=48, vocab_size=vocab, embedding_size=vocab,
                         max_sequence_length=64, rope_theta=10000.0, mask_token_id=tokenizer.mask_token_id,
                         eos_token_id=tokenizer.eos_token_id, eot_token_id=tokenizer.convert_tokens_to_ids("<|eot_id|>"),
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, init_std=0.3).eval()
    pipe = MaskedDiffusionLMPipeline(model=model, tokenizer=tokenizer, scheduler=scheduler or LLaDAScheduler(),
                                     default_gen_length=8, default_block_length=4)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------------- dummy pipelines (the pipeline tests)
def image_components(drafter: bool = True) -> dict:
    transformer = tiny_gpt(vocab_size=64, block_size=16, num_classes=5, std=0.3, seed=1)
    torch.manual_seed(2)
    vq_kwargs = llamagen_vq_config("VQ-4", codebook_size=64, codebook_embed_dim=8, z_channels=32, base_channels=32)
    vq_kwargs.update(layers_per_block=1, block_out_channels=(32, 32, 32))
    components = {"transformer": transformer, "vqvae": VQModel(**vq_kwargs).eval(),
                  "decoding_config": DecodingConfig(strategy="mc-sjd", window=4, guidance_scale=2.0, top_k=40)}
    if drafter:
        components["drafter"] = tiny_gpt(vocab_size=64, block_size=16, num_classes=5, std=0.3, seed=3, dim=16, n_layer=1)
    return components


def image_pipe(drafter: bool = True) -> LlamaGenPipeline:
    pipe = LlamaGenPipeline(**image_components(drafter))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gens(count: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


def image_inputs(count: int = 2, seed: int = 0, **overrides) -> dict:
    return {"class_labels": list(range(count)), "generator": gens(count, seed), "output_type": "latent", **overrides}


def text_pipe(scheduler=None) -> MaskedDiffusionLMPipeline:
    return tiny_text_pipeline(scheduler)


def tiny_llada():
    """The dLLM tests' tiny random LLaDA (vocabulary 61, mask 60, pad 0, EOS 1, EoT 2), in float64: padded and
    unpadded rows agree to ~1e-15, so arg-max ties cannot flip between batch compositions."""
    from vispec.models.llada import LLaDAModelLM

    torch.manual_seed(0)
    m = LLaDAModelLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=48, vocab_size=61, embedding_size=64,
                     max_sequence_length=96, rope_theta=10000.0, mask_token_id=60, eos_token_id=1, eot_token_id=2,
                     pad_token_id=0, bos_token_id=3, init_std=0.3)
    return m.to(torch.float64).eval()


def tiny_llada_prompts(lengths=(7, 4, 5), seed=1) -> list[torch.Tensor]:
    """Random prompts for :func:`tiny_llada` (ids 4..59: no special token), one per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 60, (n,), generator=gen) for n in lengths]
