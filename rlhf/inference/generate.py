"""The `generate` command: any saved candidate, any inference-time strategy.

    rlhf-generate --model models/champion "12+7-3"
    rlhf-generate --model models/sft --strategy best_of_n --prm models/prm --n 8 "12+7-3"
    rlhf-generate --model models/sft --strategy mcts --prm models/prm "12+7-3"
    rlhf-generate --model models/sft --strategy speculative --draft models/draft "12+7-3"
    rlhf-generate --model models/sft --strategy ensemble --members models/sft,models/policy/dpo "12+7-3"
    rlhf-generate --model my-chat-model --chat "What is 12+7-3?"
    rlhf-generate --model models/sft --chat --context notes.txt --compressor models/compressor/k32 "How many?"

(`python -m rlhf.inference.generate` is the same command.) Prompts come from the
arguments or, with none, one per line on stdin; the task (the `task` block of the project's
params.yaml, or `--task`, else the built-in one) puts them in the form the model was
trained on and reads their answers and steps; `--chat` sends each as a user message
through the model's chat template (for a model trained on conversations: without it the
model reads plain text it never saw). `--context FILE` puts a long context before every
prompt: read whole, or, with `--compressor` (stage compress's folder for this model), as
the compressor's slots (rlhf.models.compressor; greedy). Prints one JSON object per prompt:
the completion, its answer, tokens generated and samples drawn. Every setting a flag does
not give keeps the default of `rlhf.inference.settings.Strategies`, the same default that
params.yaml `infer` has. Best-of-n reranks with the PRM (`--prm`) unless `--reward-model`
names an RM ensemble.
"""

from __future__ import annotations

import argparse
import json
import sys

import rlhf  # noqa: F401  (offline environment)
from rlhf.inference.settings import STRATEGIES, Strategies
from rlhf.tasks import TASKS, TaskConfig, get_task

# flag -> where its value goes in the Strategies settings (None: the flag is not given)
_SETTINGS = {
    "max_new_tokens": ("max_new_tokens",),
    "batch_size": ("batch_size",),
    "seed": ("seed",),
    "n": ("best_of_n", "n"),
    "samples": ("self_consistency", "max_samples"),
    "stop_share": ("self_consistency", "stop_share"),
    "simulations": ("mcts", "simulations"),
    "draft": ("speculative", "draft"),
    "members": ("ensemble", "members"),
    "ensemble_mode": ("ensemble", "mode"),
    "prm": ("prm",),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = Strategies()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    parser.add_argument("--model", required=True, help="a saved candidate: a local Hugging Face model directory")
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        help="the task kind that shapes prompts and reads answers and steps (default: the `task` of --params, "
        "else the built-in task); a kind with settings (regex's pattern) takes them from --params",
    )
    parser.add_argument("--params", default="params.yaml", help="the project's params, for its `task` block")
    parser.add_argument("--strategy", choices=STRATEGIES, default="greedy")
    parser.add_argument("--max-new-tokens", type=int, help=f"default {defaults.max_new_tokens}")
    parser.add_argument(
        "--temperature", type=float, help="sampling temperature of every sampling strategy (default: each one's own)"
    )
    parser.add_argument("--batch-size", type=int, help=f"sequences generated at once (default {defaults.batch_size})")
    parser.add_argument("--seed", type=int, help=f"default {defaults.seed}")
    parser.add_argument("--n", type=int, help=f"best_of_n: samples per prompt (default {defaults.best_of_n.n})")
    parser.add_argument("--prm", help="process reward model directory (mcts; the best_of_n scorer)")
    parser.add_argument("--reward-model", help="best_of_n: rerank with this RM ensemble instead of the PRM")
    parser.add_argument(
        "--samples", type=int, help=f"self_consistency: most samples (default {defaults.self_consistency.max_samples})"
    )
    parser.add_argument(
        "--stop-share",
        type=float,
        help=f"self_consistency: early stop (default {defaults.self_consistency.stop_share})",
    )
    parser.add_argument("--simulations", type=int, help=f"mcts: simulations (default {defaults.mcts.simulations})")
    parser.add_argument("--draft", help="speculative: the draft model directory")
    parser.add_argument(
        "--members",
        action="extend",
        type=lambda value: [path for path in value.split(",") if path],
        help="ensemble: member model directories, comma-separated (or the flag repeated)",
    )
    parser.add_argument("--ensemble-mode", choices=("logits", "vote"), help=f"default {defaults.ensemble.mode}")
    parser.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message through the chat template"
    )
    parser.add_argument("--context", help="a text file the model reads before each prompt (a long context)")
    parser.add_argument(
        "--compressor", help="read --context through this context compressor (models/compressor/k<N>; greedy only)"
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Strategies:
    """The Strategies defaults, with every flag that was given put in its place."""
    settings = Strategies().model_dump()
    for flag, where in _SETTINGS.items():
        value = getattr(args, flag)
        if value is not None:
            target = settings
            for key in where[:-1]:
                target = target[key]
            target[where[-1]] = value
    if args.temperature is not None:
        for strategy in ("best_of_n", "self_consistency", "mcts"):
            settings[strategy]["temperature"] = args.temperature
    if args.reward_model:
        settings["best_of_n"]["rewards"] = [{"name": "reward_model", "path": args.reward_model}]
    elif args.prm:
        settings["best_of_n"]["rewards"] = [{"name": "prm", "path": args.prm}]
    settings["trust_remote_code"] = args.trust_remote_code
    return Strategies.model_validate(settings)


def command_task(kind: str | None, params_path: str):
    """The task of the command: the `task` block of the project's params (when the file is
    there and `kind` is not given or is its kind), else `kind` (default the built-in task)
    with its default settings; a kind that cannot run without settings says how to give them."""
    from pathlib import Path

    import yaml
    from pydantic import ValidationError

    block = {}
    if Path(params_path).is_file():
        block = (yaml.safe_load(Path(params_path).read_text()) or {}).get("task") or {}
    if kind is not None and block.get("kind", TaskConfig().kind) != kind:
        block = {"kind": kind}
    try:
        return get_task(TaskConfig(**block))
    except (ValueError, ValidationError) as error:
        shown = (
            error.errors()[0]["msg"].removeprefix("Value error, ") if isinstance(error, ValidationError) else str(error)
        )
        raise SystemExit(
            f"--task {block.get('kind', TaskConfig().kind)}: {shown}. Run the command where params.yaml (or "
            "--params FILE) sets `task` with that kind and its settings"
        ) from None


# A settings field -> the flag that gives it (for errors that name what the user typed).
_FLAGS = {where: "--" + flag.replace("_", "-") for flag, where in _SETTINGS.items()}
_KEYS = {
    "draft": "--draft",
    "member": "--members (member {index})",
    "prm": "--prm",
    "reward": "best_of_n's scorer (--prm or --reward-model)",
}


def checked_settings(args: argparse.Namespace) -> Strategies:
    """`settings_from`, with a value out of range failing as an error that names its flag."""
    from pydantic import ValidationError

    try:
        return settings_from(args)
    except ValidationError as error:
        first = error.errors()[0]
        where = tuple(str(part) for part in first["loc"])
        flag = "--temperature" if where[-1:] == ("temperature",) else _FLAGS.get(where, ".".join(where))
        raise SystemExit(f"{flag}: {first['msg'].removeprefix('Value error, ')}") from None


def read_context(path: str) -> str:
    from pathlib import Path

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"--context {path}: cannot be read as text ({error.__class__.__name__}); give a text file")
    if not text.strip():
        raise SystemExit(f"--context {path}: the file is empty")
    return text.strip()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.strategy == "speculative" and not args.draft:
        raise SystemExit("--strategy speculative needs --draft DIR (a smaller model with the same tokenizer)")
    if args.strategy == "ensemble" and len(args.members or []) < 2:
        raise SystemExit("--strategy ensemble needs --members DIR,DIR[,...]")
    if args.strategy == "mcts" and not args.prm:
        raise SystemExit("--strategy mcts needs --prm DIR (the pipeline writes models/prm)")
    if args.strategy == "best_of_n" and not (args.prm or args.reward_model):
        raise SystemExit("--strategy best_of_n needs a scorer: --prm DIR or --reward-model DIR")
    if args.compressor and not args.context:
        raise SystemExit("--compressor reads a long context: give it with --context FILE")
    if args.compressor and args.strategy != "greedy":
        raise SystemExit(f"--compressor decodes greedily; --strategy {args.strategy} reads the context whole")
    context = read_context(args.context) if args.context else None
    settings = checked_settings(args)
    task = command_task(args.task, args.params)
    prompts = args.prompts or [line for line in sys.stdin.read().splitlines() if line.strip()]
    shown = [p.strip() for p in prompts]
    if context is not None and not args.compressor:
        from rlhf.tasks.long_context import joined

        prompts = [joined(context, p) for p in prompts]
    prompts = [[{"role": "user", "content": p}] if args.chat else task.normalize_prompt(p) for p in prompts]

    from rlhf.inference.inputs import check_inputs
    from rlhf.inference.strategies import load_strategy
    from rlhf.models.folders import check_model_dir, resolve_model_dir
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.params import input_errors_exit

    with input_errors_exit():  # every folder the command reads, before any model loads
        check_model_dir(resolve_model_dir(args.model), "--model")
        tokenizer = load_tokenizer(args.model, args.trust_remote_code)
        check_inputs([args.strategy], settings, tokenizer, task, keys=_KEYS)
        model = load_causal_lm(args.model, args.trust_remote_code, what="--model")
        runner = load_strategy(args.strategy, settings, task)
        if args.compressor:
            from rlhf.inference.strategies import compressed_runner
            from rlhf.models.compressor import ContextCompressor

            compressor = ContextCompressor.from_pretrained(args.compressor, model)
            runner = compressed_runner(compressor, [context] * len(prompts), settings.max_new_tokens,
                                       settings.batch_size)  # fmt: skip
    for prompt, answer in zip(shown, runner(model, tokenizer, prompts)):
        record = {
            "prompt": prompt,
            "completion": answer.completion,
            "answer": task.extract_answer(answer.completion),
            "tokens": answer.tokens,
            "samples": answer.samples,
        }
        print(json.dumps(record))


if __name__ == "__main__":
    main()
