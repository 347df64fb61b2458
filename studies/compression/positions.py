"""Where the served model can read what it needs: the relevant-only reading of a suite with
the facts moved away from the question in position alone (docs/results/context-compression.md).

Each problem is the oracle prompt (the relevant sentences, then the question, in the chat
template), scored greedily, with the positions of everything after the facts shifted by a
gap of G (nothing inserted: the tokens are the same, only their distance changes), and
with the facts' own positions squeezed by a scale (0.5: two facts' tokens a position
apart). This is what a compressor's slots meet when the model reads them one after
another: a 1,000-token context at 4x puts about 250 slots before the question, most of them
further from it than any fact the model read in training.

    .venv/bin/python studies/compression/positions.py --work /tmp/compression --suite dev

--work is the study's folder of studies/compression/run.py (its project's SFT model is
read; run.py makes it). Prints one line per setting and writes --work/positions-<suite>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [(0, 1.0), (100, 1.0), (200, 1.0), (300, 1.0), (0, 0.5), (0, 0.25)]  # (gap, scale of the facts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--suite", default="dev")
    args = parser.parse_args()
    root = args.work / "project"
    if not (root / "models/sft/config.json").is_file():
        sys.exit(f"{root}/models/sft holds no model: run studies/compression/run.py --work {args.work} first")
    os.chdir(root)
    sys.path.insert(0, str(root))

    import torch

    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.statistics import bootstrap_interval
    from rlhf.models.compressor import question_text
    from rlhf.models.generation import format_prompt, stop_token_ids
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.tasks import get_task
    from stages import load_all

    task = get_task(load_all()["task"])
    tokenizer, model = load_tokenizer("models/sft"), load_causal_lm("models/sft").eval()
    stop = set(stop_token_ids(model, tokenizer, chat=True))
    suite = read_prepared(Path(f"data/prepared/eval/{args.suite}.parquet"), "study")
    marker = "\x00question\x00"
    rows = []
    for relevant, prompt in zip(suite["relevant"], suite["prompt"]):
        head, _, tail = format_prompt(tokenizer, [{"role": "user", "content": relevant + "\n" + marker}]).partition(
            marker
        )
        facts = tokenizer(head, add_special_tokens=False)["input_ids"]
        rest = tokenizer(question_text(prompt) + tail, add_special_tokens=False)["input_ids"]
        rows.append((facts, rest))

    @torch.inference_mode()
    def answer(facts: list[int], rest: list[int], gap: int, scale: float, budget: int = 64) -> str:
        after = (len(facts) - 1) * scale + 1 + gap
        positions = [i * scale for i in range(len(facts))] + [after + i for i in range(len(rest))]
        out = model(input_ids=torch.tensor([facts + rest]), position_ids=torch.tensor([positions]), use_cache=True)
        cache, last, written = out.past_key_values, positions[-1], []
        token = int(out.logits[0, -1].argmax())
        while token not in stop and len(written) < budget:
            written.append(token)
            last += 1
            out = model(
                input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[last]]), past_key_values=cache,
                use_cache=True,
            )  # fmt: skip
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        return tokenizer.decode(written, skip_special_tokens=True)

    results = {}
    for gap, scale in SETTINGS:
        correct = [float(task.is_correct(answer(f, r, gap, scale), a)) for (f, r), a in zip(rows, suite["answer"])]
        low, high = bootstrap_interval(correct)
        results[f"gap {gap}, scale {scale}"] = {"accuracy": sum(correct) / len(correct), "low": low, "high": high}
        print(f"gap {gap}, scale {scale}:", results[f"gap {gap}, scale {scale}"], flush=True)
    (args.work / f"positions-{args.suite}.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
