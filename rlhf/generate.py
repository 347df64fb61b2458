"""The `generate` command: any saved candidate, any inference-time strategy.

    python -m rlhf.generate --model models/champion "12+7-3"
    python -m rlhf.generate --model models/sft --strategy best_of_n --n 8 "12+7-3" "4+4+4"
    python -m rlhf.generate --model models/sft --strategy mcts --prm models/prm --simulations 16 "12+7-3"
    python -m rlhf.generate --model models/sft --strategy speculative --draft models/draft "12+7-3"
    python -m rlhf.generate --model models/sft --strategy ensemble --members models/sft models/policy/dpo "12+7-3"

Prompts come from the arguments or, with none, one per line on stdin (the built-in task's
prompts end with a newline, which is added when missing). Prints one JSON object per prompt:
the completion, its answer, tokens generated and samples drawn. Best-of-n reranks with the
PRM by default (`--prm`); `--reward-model` uses the RM ensemble instead.
"""

from __future__ import annotations

import argparse
import json
import sys

import rlhf  # noqa: F401  (offline environment)
from rlhf.inference import STRATEGIES, Strategies, answer_key, run_strategy
from rlhf.modeling import load_causal_lm, load_tokenizer
from rlhf.task import PROMPT_END


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    parser.add_argument("--model", required=True, help="a saved candidate: a local Hugging Face model directory")
    parser.add_argument("--strategy", choices=STRATEGIES, default="greedy")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (sampling strategies)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=8, help="best_of_n: samples per prompt")
    parser.add_argument("--prm", default="models/prm", help="process reward model (mcts; best_of_n scorer)")
    parser.add_argument("--reward-model", help="best_of_n: rerank with this RM ensemble instead of the PRM")
    parser.add_argument("--samples", type=int, default=16, help="self_consistency: most samples per prompt")
    parser.add_argument("--stop-share", type=float, default=0.75, help="self_consistency: early-stop share")
    parser.add_argument("--simulations", type=int, default=12, help="mcts: simulations per prompt")
    parser.add_argument("--draft", help="speculative: the draft model directory")
    parser.add_argument("--members", nargs="+", default=[], help="ensemble: member model directories")
    parser.add_argument("--ensemble-mode", choices=("logits", "vote"), default="logits")
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Strategies:
    scorer = (
        {"name": "reward_model", "path": args.reward_model} if args.reward_model else {"name": "prm", "path": args.prm}
    )
    return Strategies.model_validate(
        {
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "prm": args.prm,
            "trust_remote_code": args.trust_remote_code,
            "best_of_n": {"n": args.n, "temperature": args.temperature, "rewards": [scorer]},
            "self_consistency": {
                "max_samples": args.samples,
                "stop_share": args.stop_share,
                "temperature": args.temperature,
            },
            "mcts": {"simulations": args.simulations, "temperature": args.temperature},
            "speculative": {"draft": args.draft},
            "ensemble": {"members": args.members, "mode": args.ensemble_mode},
        }
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.strategy == "speculative" and not args.draft:
        raise SystemExit("--strategy speculative needs --draft DIR (a smaller model with the same tokenizer)")
    if args.strategy == "ensemble" and len(args.members) < 2:
        raise SystemExit("--strategy ensemble needs --members DIR DIR [...]")
    prompts = args.prompts or [line for line in sys.stdin.read().splitlines() if line.strip()]
    prompts = [p if p.endswith(PROMPT_END) else p + PROMPT_END for p in prompts]
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = load_causal_lm(args.model, args.trust_remote_code, what="--model")
    for prompt, answer in zip(prompts, run_strategy(args.strategy, settings_from(args), model, tokenizer, prompts)):
        record = {
            "prompt": prompt.rstrip(PROMPT_END),
            "completion": answer.completion,
            "answer": answer_key(answer.completion),
            "tokens": answer.tokens,
            "samples": answer.samples,
        }
        print(json.dumps(record))


if __name__ == "__main__":
    main()
