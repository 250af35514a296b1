"""Synthetic text tasks: formats, splits, GSM8K scoring, the word tokenizer, the SFT trainer and greedy decoding."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from vispec.eval.bench.text_tasks import (
    TASKS, ArithmeticTask, flexible_extract, get_task, gsm8k_scores, is_test_prompt, split_items, strict_match_extract,
)
from vispec.eval.train.mdlm import (
    MDLMTrainConfig, build_model, decode_low_confidence, encode_items, evaluate_greedy, sft_loss, train_mdlm,
)
from vispec.eval.train.tokenizer import (
    EOT, MASK, PAD, answer_ids, decode_answer, eot_token_id, load_text_tokenizer, prompt_ids, train_task_tokenizer,
)
from vispec.models.llada import LLaDAModelLM


@pytest.fixture(scope="module")
def tokenizer():
    return train_task_tokenizer(n_per_task=300)


def test_splits_are_deterministic_large_and_disjoint():
    for name in TASKS:
        test = split_items(name, "test", 500)
        assert len({item.prompt for item in test}) == 500 and all(is_test_prompt(item.prompt) for item in test)
        assert test == split_items(name, "test", 500)
        assert split_items(name, "test", 20) == test[:20]
        train = split_items(name, "train", 5000, seed=3)
        assert not {item.prompt for item in train} & {item.prompt for item in test}
        assert train[:10] == split_items(name, "train", 10, seed=3) != split_items(name, "train", 10, seed=4)


def test_arithmetic_solutions_are_correct_gsm8k_style_and_small():
    task = get_task("arithmetic")
    for item in split_items(task, "train", 2000):
        steps = re.findall(r"(\d+) ([+-]) (\d+) = (\d+) \.", item.answer)
        assert 2 <= len(steps) <= 3 and item.answer.endswith(f"#### {item.target}")
        assert int(steps[0][0]) <= 20 and steps[0][0] == item.prompt.split()[2]
        for a, op, b, c in steps:
            assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)) and 0 <= int(c) <= 99
            assert 1 <= int(b) <= 10
        assert [s[3] for s in steps[:-1]] == [s[0] for s in steps[1:]] and steps[-1][3] == item.target
        assert len(item.prompt.split()) <= 31 and len(item.answer.split()) <= 20
        assert task.score(item.answer, item) == {"strict_match": 1.0, "flexible_extract": 1.0}
    with pytest.raises(ValueError, match="min_steps"):
        ArithmeticTask(min_steps=3, max_steps=2)


def test_parallel_and_control_tasks_are_exact_match():
    sort, reverse = get_task("sort"), get_task("reverse")
    item = sort.sample(random.Random(0))
    values = [int(v) for v in item.prompt.split(":")[1].split()]
    assert item.answer == " ".join(map(str, sorted(values))) and 5 <= len(values) <= 8
    assert sort.score(item.answer, item) == {"exact_match": 1.0} and sort.score(item.answer + " 1", item) == {"exact_match": 0.0}
    repeats = sum(len(set(i.answer.split())) < len(i.answer.split()) for i in split_items(sort, "test", 500))
    assert repeats > 400  # most lists have repeats
    item = reverse.sample(random.Random(0))
    assert item.answer.split() == item.prompt.split(":")[1].split()[::-1]
    with pytest.raises(ValueError, match="unknown task"):
        get_task("sudoku")


@pytest.mark.parametrize("text, strict, flexible", [
    ("3 + 4 = 7 . 7 - 2 = 5 . #### 5", "5", "5"),
    ("so she has 1,234 apples.\n#### 1,234", "1,234", "1,234"),
    ("The answer is $42.", None, "$42."),
    ("#### -3 then 8", "-3", "8"),
    ("no numbers here", None, None),
])
def test_strict_and_flexible_extraction_follow_lm_eval(text, strict, flexible):
    assert strict_match_extract(text) == strict
    assert flexible_extract(text) == flexible


def test_gsm8k_scores_normalise_like_lm_eval():
    assert gsm8k_scores("so 1,234 in all . #### 1,234", "1234") == {"strict_match": 1.0, "flexible_extract": 1.0}
    assert gsm8k_scores("The answer is $42.", "work ... #### 42") == {"strict_match": 0.0, "flexible_extract": 1.0}
    assert gsm8k_scores("#### 41 and then 42", "42") == {"strict_match": 0.0, "flexible_extract": 1.0}


def test_word_tokenizer_special_tokens_numbers_and_round_trip(tmp_path, tokenizer):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (PAD, MASK, EOT)}
    assert len(set(ids.values())) == 3 and tokenizer.pad_token_id != tokenizer.mask_token_id
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.bos_token_id is not None and tokenizer.padding_side == "left"
    for n in range(100):
        assert len(tokenizer(str(n), add_special_tokens=False)["input_ids"]) == 1
    item = split_items("arithmetic", "test", 1)[0]
    p, a = prompt_ids(tokenizer, item.prompt), answer_ids(tokenizer, item.answer, 32)
    assert p[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in p + a
    assert len(a) == 32 and a[-1] == tokenizer.eos_token_id and eot_token_id(tokenizer) in a
    assert decode_answer(tokenizer, a) == item.answer
    tokenizer.save_pretrained(tmp_path / "tok")
    again = load_text_tokenizer(tmp_path / "tok")
    assert prompt_ids(again, item.prompt) == p and answer_ids(again, item.answer, 32) == a
    with pytest.raises(ValueError, match="does not fit answer length 4"):
        answer_ids(tokenizer, item.answer, 4)


class _Recorder(torch.nn.Module):
    """Wraps a model and records the inputs it sees."""

    def __init__(self, model: LLaDAModelLM):
        super().__init__()
        self.inner, self.config, self.seen = model, model.config, []

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, attention_mask=None):
        self.seen.append(input_ids.clone())
        return self.inner(input_ids, attention_mask)


def _tiny(tokenizer) -> LLaDAModelLM:
    torch.manual_seed(0)
    return build_model(MDLMTrainConfig(d_model=32, n_layers=1, n_heads=2, mlp_hidden_size=48), tokenizer)


def test_sft_loss_masks_only_the_answer(tokenizer):
    items = [split_items(t, "train", 1)[0] for t in TASKS]
    ids, mask = encode_items(tokenizer, items, 32)
    assert ids.shape[1] == mask.shape[1] and (mask[:, -32:] == 1).all() and (ids[mask == 0] == tokenizer.pad_token_id).all()
    rec = _Recorder(_tiny(tokenizer))
    loss = sft_loss(rec, ids, mask, 32, torch.Generator().manual_seed(0))
    loss.backward()
    noisy = rec.seen[0]
    assert torch.equal(noisy[:, :-32], ids[:, :-32])  # the prompt is never masked
    masked = noisy[:, -32:] == tokenizer.mask_token_id
    assert masked.any() and torch.equal(noisy[:, -32:][~masked], ids[:, -32:][~masked])
    assert torch.isfinite(loss) and loss.item() > 0


def test_low_confidence_decoding_commits_one_token_per_step(tokenizer):
    rec = _Recorder(_tiny(tokenizer))
    items = split_items("sort", "test", 3)
    ids, mask = encode_items(tokenizer, items, 16, with_answers=False)
    out = decode_low_confidence(rec, ids, mask, 16)
    assert out.shape == (3, 16) and not (out == tokenizer.mask_token_id).any()
    counts = [int((x[:, -16:] == tokenizer.mask_token_id).sum(-1).unique().item()) for x in rec.seen]
    assert counts == list(range(16, 0, -1))  # every row: one commit per forward


@pytest.mark.slow
def test_train_mdlm_runs_reproducibly_and_saves_everything(tmp_path):
    cfg = dict(steps=3, batch_size=4, d_model=32, n_layers=1, n_heads=2, mlp_hidden_size=48, log_every=1, warmup=2,
               eval_every=2, eval_n=2, final_eval_n=2, tokenizer_corpus=200, answer_length=24,
               task_options={"arithmetic": {"max_steps": 2}})
    first = train_mdlm(MDLMTrainConfig(out=str(tmp_path / "a"), **cfg))
    second = train_mdlm(MDLMTrainConfig(out=str(tmp_path / "b"), **cfg))
    assert first["final_loss"] == second["final_loss"] and first["steps_done"] == 3
    assert set(first["eval"]) == {"arithmetic", "sort", "reverse"}
    assert set(first["eval"]["arithmetic"]) == {"task", "n", "strict_match", "flexible_extract"}
    assert [p["step"] for p in first["progress"]] == [2]
    log = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [0, 1, 2] and any("eval" in r for r in log)
    model = LLaDAModelLM.from_pretrained(tmp_path / "a" / "transformer", low_cpu_mem_usage=False)
    tok = load_text_tokenizer(tmp_path / "a" / "tokenizer")
    assert model.config.mask_token_id == tok.mask_token_id and model.config.vocab_size == len(tok)
    result = evaluate_greedy(model, tok, "reverse", 3, answer_length=24, batch_size=2)
    assert result["n"] == 3 and 0.0 <= result["exact_match"] <= 1.0 and len(result["examples"]) == 2
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["config"]["steps"] == 3
    with pytest.raises(ValueError, match="task_options names tasks that are not trained"):
        train_mdlm(MDLMTrainConfig(out=str(tmp_path / "c"), tasks=("sort",), task_weights=(1.0,),
                                   task_options={"arithmetic": {}}))
