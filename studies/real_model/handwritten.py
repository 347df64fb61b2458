"""Word problems written by hand (handwritten.jsonl: 60, in phrasings the generator never
writes, fixed before any real-model result and tuned on by nothing), answered by model
folders loaded with plain transformers: the chat template, greedy decoding, and GSM8K's
answer check (task kind gsm8k, with its flexible fallback: the instruct model states its
answers in prose). Prints one JSON line per model and, with two or more, the paired
difference of each later model against the first.

It generates with transformers alone on purpose, not through rlhf.models.generation: what
it checks is that a model folder the pipeline wrote works for someone who has only
transformers (its chat template, its generation config, its weights).

    .venv/bin/python studies/real_model/handwritten.py models/base models/champion
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PROBLEMS = Path(__file__).resolve().parent / "handwritten.jsonl"


def answer(folder: str, questions: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Each question answered greedily by the model in `folder` through its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    replies = []
    for start in range(0, len(questions), batch_size):
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions[start : start + batch_size]
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        replies += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="model folders (the first is the baseline of the differences)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write every reply and the scores here (JSON)")
    args = parser.parse_args()

    from rlhf.evaluation.statistics import bootstrap_interval, paired_difference
    from rlhf.tasks import TaskConfig, get_task

    task = get_task(TaskConfig(kind="gsm8k"))
    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines() if line.strip()]
    questions = [row["question"] for row in rows]
    results, outcomes = {}, {}
    for folder in args.models:
        replies = answer(folder, questions, args.max_new_tokens, args.batch_size)
        correct = [float(task.is_correct(reply, row["answer"])) for reply, row in zip(replies, rows)]
        low, high = bootstrap_interval(correct)
        outcomes[folder] = correct
        results[folder] = {"accuracy": sum(correct) / len(correct), "low": low, "high": high,
                           "problems": len(correct), "replies": replies}  # fmt: skip
        print(json.dumps({"model": folder, **{k: v for k, v in results[folder].items() if k != "replies"}}))
    first = args.models[0]
    for folder in args.models[1:]:
        results[folder]["over_" + Path(first).name] = paired = paired_difference(outcomes[folder], outcomes[first])
        print(json.dumps({"model": folder, "over": first, **paired}))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
