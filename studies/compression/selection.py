"""How a `select` compressor's picks do on a suite (docs/results/context-compression.md):
its selector's recall (the share of problems whose every relevant sentence sits in the
chunks it picks), the accuracy with its picks, and the accuracy with the chunks that hold
the facts given by label (`selected(..., must=labels)`, topped up by score), with 95%
bootstrap intervals, and the accuracy on the problems where a chunk boundary cuts a relevant
sentence in two and on the others. It reads the probe project run.py made.

    .venv/bin/python studies/compression/selection.py --work /tmp/compression \\
        --compressor /tmp/compression/compressors/select2-3000/k32 --suite dev
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--compressor", type=Path, required=True)
    parser.add_argument("--suite", default="dev")
    args = parser.parse_args()
    root = (args.work / "project").resolve()
    os.chdir(root)
    sys.path.insert(0, str(root))

    import torch

    from rlhf.data.prepared import read_prepared
    from rlhf.evaluation.suites import answer_difficulty, summarise
    from rlhf.models.compressor import ContextCompressor, relevant_chunks
    from rlhf.models.generation import PLAIN_DECODING, format_prompt, stop_token_ids
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.tasks import get_task
    from stages import load_all

    params = load_all()
    task, config = get_task(params["task"]), params["evaluate"]
    tokenizer = load_tokenizer("models/sft")
    compressor = ContextCompressor.from_pretrained(args.compressor, load_causal_lm("models/sft"))
    suite = read_prepared(Path(f"data/prepared/eval/{args.suite}.parquet"), "selection")
    contexts, prompts = suite["context"].tolist(), suite["prompt"].tolist()
    labels = relevant_chunks(
        tokenizer, contexts, suite["relevant"].tolist(), compressor.chunk_tokens, compressor.chunk_by
    )
    chat = not isinstance(prompts[0], str)
    cut = [  # a relevant sentence spread over two chunks
        any(
            sum(chunks) > 1
            for chunks in relevant_chunks(
                tokenizer, [c] * len(facts), facts, compressor.chunk_tokens, compressor.chunk_by
            )
        )
        for c, facts in ((c, re.split(r"(?<=[.?!])\s+", r.strip())) for c, r in zip(contexts, suite["relevant"]))
    ]
    for mode in ("picked", "facts' chunks by label"):
        texts, recall = [], []
        with torch.inference_mode():
            for start in range(0, len(prompts), 32):
                part = slice(start, start + 32)
                slots, mask, scores = compressor.compress_prompts(tokenizer, contexts[part], prompts[part], scores=True)
                holds = torch.zeros_like(scores, dtype=torch.bool)
                for row, chunks in enumerate(labels[part]):
                    holds[row, : len(chunks)] = torch.tensor(chunks)
                picked = compressor.selected(mask, scores)[:, :: compressor.tokens].bool()
                recall += [bool((holds[row] <= picked[row]).all()) for row in range(len(holds))]
                mask = compressor.selected(mask, scores, must=holds if mode != "picked" else None)
                pieces = [
                    tokenizer(format_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts[part]
                ]
                embeds, attention, positions = compressor.decoder_inputs(slots, mask, pieces)
                with compressor.reading():
                    out = compressor.model.generate(
                        inputs_embeds=embeds, attention_mask=attention, position_ids=positions,
                        max_new_tokens=config.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=stop_token_ids(compressor.model, tokenizer, chat=chat), **PLAIN_DECODING,
                    )  # fmt: skip
                texts += tokenizer.batch_decode(out, skip_special_tokens=True)
        right = [float(task.is_correct(text, answer)) for text, answer in zip(texts, suite["answer"])]
        metrics = summarise(config, {"accuracy": right, "format_rate": []}, answer_difficulty(suite))
        found = [r for r, whole in zip(right, recall) if whole]
        split = {k: [r for r, c in zip(right, cut) if c == k] for k in (True, False)}
        print(json.dumps({
            "mode": mode, "accuracy": metrics["accuracy"], "low": metrics["accuracy_low"],
            "high": metrics["accuracy_high"], "selector_recall": sum(recall) / len(recall),
            "relevant_chunks_mean": sum(map(sum, labels)) / len(labels),
            "accuracy_where_the_picks_hold_every_fact": sum(found) / max(1, len(found)),
            "problems_with_a_fact_cut_by_a_chunk_boundary": len(split[True]),
            "accuracy_fact_cut": sum(split[True]) / max(1, len(split[True])),
            "accuracy_facts_whole": sum(split[False]) / max(1, len(split[False])),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
