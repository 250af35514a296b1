"""Trainers of the embedded models (tiny-c2i VQ, GPT, evaluator and drafter; tiny-mdlm), the task tokenizer and
the assembly of trained parts into pipeline folders (``vispec train ...``)."""
