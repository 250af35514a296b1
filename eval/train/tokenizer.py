"""A word-level tokenizer for the synthetic text tasks, trained with the ``tokenizers`` library.

Words are split on whitespace (the task texts put spaces around punctuation), so every number
``0..max_value`` and every letter is one token. It is saved and loaded as a transformers
``PreTrainedTokenizerFast`` (left padding) with LLaDA's special tokens:

=====================  ==============================  ======
role                   token                           id
=====================  ==============================  ======
pad                    ``<|pad|>``                     0
unknown                ``<|unk|>``                     1
BOS                    ``<|startoftext|>``             2
EOS (answer padding)   ``<|endoftext|>``               3
EoT (end of turn)      ``<|eot_id|>``                  4
mask                   ``<|mdm_mask|>``                5
chat headers           ``<|start_header_id|>``,        6, 7
                       ``<|end_header_id|>``
=====================  ==============================  ======

The chat template is LLaDA-Instruct's shape in words: ``BOS <|start_header_id|> user <|end_header_id|>
{prompt} <|eot_id|> <|start_header_id|> assistant <|end_header_id|>``; an answer is ``{answer}
<|eot_id|>`` followed by EOS up to the generation length (LLaDA SFT, spec ``dllm.md`` §1.2).
"""

from __future__ import annotations

import os
from typing import Iterable

from transformers import PreTrainedTokenizerFast

PAD, UNK, BOS, EOS, EOT, MASK = "<|pad|>", "<|unk|>", "<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>"
START_HEADER, END_HEADER = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS, EOT, MASK, START_HEADER, END_HEADER]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|> {{ message['role'] }} <|end_header_id|> "
    "{{ message['content'] }} <|eot_id|> {% endfor %}{% if add_generation_prompt %}<|start_header_id|> assistant "
    "<|end_header_id|>{% endif %}"
)


def train_word_tokenizer(texts: Iterable[str], extra_words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """Train a word-level tokenizer on ``texts``; ``extra_words`` (numbers, letters, roles) are added to the
    corpus so that they are in the vocabulary even when the sample misses them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    extra = " ".join(["user", "assistant", *extra_words])
    core.train_from_iterator(_chain([extra], texts), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS, mask_token=MASK,
        additional_special_tokens=[EOT, START_HEADER, END_HEADER], padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    check_special_ids(tokenizer)
    return tokenizer


def train_task_tokenizer(
    tasks: Iterable = ("arithmetic", "sort", "reverse"), n_per_task: int = 2000, seed: int = 0
) -> PreTrainedTokenizerFast:
    """The tokenizer of the task suite: trained on ``n_per_task`` train-side prompts and answers of each task
    (:mod:`vispec.eval.bench.text_tasks`), plus every word a task can produce (numbers, letters)."""
    from vispec.eval.bench.text_tasks import get_task, split_items

    tasks = [get_task(task) for task in tasks]
    texts = (f"{item.prompt} {item.answer}" for task in tasks for item in split_items(task, "train", n_per_task, seed))
    return train_word_tokenizer(texts, [word for task in tasks for word in task.words()])


def _chain(*parts: Iterable[str]) -> Iterable[str]:
    for part in parts:
        yield from part


def check_special_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    """Raise ``ValueError`` unless pad, unk, BOS, EOS, EoT and mask exist with distinct ids (pad != mask)."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if len(set(ids.values())) != len(ids) or tokenizer.pad_token_id == tokenizer.mask_token_id:
        raise ValueError(f"the tokenizer needs distinct ids for {SPECIAL_TOKENS}, got {ids}")


def eot_token_id(tokenizer: PreTrainedTokenizerFast) -> int:
    return tokenizer.convert_tokens_to_ids(EOT)


def load_text_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved with ``save_pretrained`` (a ``PreTrainedTokenizerFast`` folder)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.fspath(path))
    tokenizer.padding_side = "left"
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    check_special_ids(tokenizer)
    return tokenizer


def prompt_ids(tokenizer: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """Token ids of ``prompt`` inside the chat template, ending with the assistant header."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_ids(tokenizer: PreTrainedTokenizerFast, answer: str, length: int) -> list[int]:
    """``answer <|eot_id|>`` padded with EOS to ``length`` ids (the SFT target canvas)."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eot_token_id(tokenizer)]
    if len(ids) > length:
        raise ValueError(f"answer of {len(ids)} tokens (with <|eot_id|>) does not fit answer length {length}: {answer!r}")
    return ids + [tokenizer.eos_token_id] * (length - len(ids))


def decode_answer(tokenizer: PreTrainedTokenizerFast, ids: Iterable[int]) -> str:
    """Text of a generated answer: everything before the first EOS or EoT, special tokens dropped."""
    stop = {tokenizer.eos_token_id, eot_token_id(tokenizer)}
    kept = []
    for token in ids:
        if int(token) in stop:
            break
        kept.append(int(token))
    return tokenizer.decode(kept, skip_special_tokens=True).strip()
