"""Every stage of dvc.yaml at real size, on this machine: Qwen2.5-0.5B's architecture and
shape (0.49 B parameters, its 151,936-token vocabulary, random weights in bfloat16; built
as benchmarks/real_size.py builds it), with LoRA, a few steps and a few problems a stage.

    python benchmarks/real_dag.py                      # every stage once (about an hour on 2 cores)
    python benchmarks/real_dag.py --keep /tmp/dag      # keep the project; a rerun skips what finished
    python benchmarks/real_dag.py --from evaluate      # start at a stage (the earlier ones done)
    python benchmarks/real_dag.py --only verifier      # one stage (the earlier ones done)

Each stage runs as the pipeline runs it (`python -m stages.<name> ...` in a fresh process, in
a scratch project of this checkout's code, its own MLflow store), under real_size.py's
probe, and prints one JSON line:

    {"stage": "policy@dpo", "peak_gib": 1.9, "seconds": 130, "above_imports_gib": 1.2, "models_gib": 5.1}

`peak_gib`: the process's high-water resident set; `above_imports_gib`: that less what it
held after importing torch, transformers, TRL, peft, datasets and MLflow (the stage's own
memory); `seconds`: the whole process; `models_gib`: what the project's models/ folder
holds on disk after the stage (every model written so far). The order is dvc.yaml's, and
the variants the acceptance asks for: rm and prm of both kinds (the likelihood kind last,
as the later stages read it), policy@dpo and policy@kto, rl@grpo and rl@ppo, merge,
evaluate (KL included), validate, gate, infer with every strategy, one improve round. A stage that fails
prints its error's last lines and the run stops there (`--keep` and `--from` go on).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_size import ROW, build_model, copy_code, measured, project, set_params  # noqa: E402

LORA = {"enabled": True, "r": 8, "alpha": 16, "target_modules": "all-linear"}
STEPS = {"max_steps": 2, "save_steps": 1000, "logging_steps": 1, "per_device_train_batch_size": 1}
LENGTH = ROW + 8

PRM_CLASSIFIER = {
    "max_steps": 2, "per_device_train_batch_size": 1, "max_length": LENGTH, "score_batch_size": 2, "lora": LORA,
}  # fmt: skip


def prm_kind(kind: str):
    """params for stage prm of `kind`: the classifier's training keys only with it (the
    likelihood kind trains no weights and refuses them)."""

    def update(params: dict) -> None:
        prm = params["prm"]
        for key in PRM_CLASSIFIER:
            prm.pop(key, None)
        prm["kind"] = kind
        if kind == "classifier":
            prm.update(PRM_CLASSIFIER)

    return update


def rm_kind(kind: str):
    def update(params: dict) -> None:
        params["rm"]["kind"] = kind

    return update


# (name, command, how this run of the stage changes params): dvc.yaml's order, with the variants.
STAGES = [
    ("prepare", ["stages.prepare"], None),
    ("base", ["stages.base"], None),
    ("sft", ["stages.sft"], None),
    ("verifier", ["stages.verifier"], None),
    ("rm (classifier)", ["stages.rm"], rm_kind("classifier")),
    ("rm (likelihood)", ["stages.rm"], rm_kind("likelihood")),
    ("prm (classifier)", ["stages.prm"], prm_kind("classifier")),
    ("prm (likelihood)", ["stages.prm"], prm_kind("likelihood")),
    ("policy@dpo", ["stages.policy", "dpo"], None),
    ("policy@kto", ["stages.policy", "kto"], None),
    ("rl@grpo", ["stages.rl", "grpo"], None),
    ("rl@ppo", ["stages.rl", "ppo"], None),
    ("merge", ["stages.merge"], None),
    ("evaluate", ["stages.evaluate"], None),
    ("validate", ["stages.validate"], None),
    ("gate", ["stages.gate"], None),
    ("infer", ["stages.infer"], None),
    ("improve@r1", ["stages.improve", "r1"], None),
]


PRM_FILE = "data/raw/prm.jsonl"


def write_step_labels(path: Path) -> None:
    """Step labels for stage prm (prepare.files.prm): random weights write no steps for it
    to label by rollouts. real_size.py's sums, solved in two steps (the sum of the first
    half, then the total), every other solution wrong from its first step."""
    import random

    rng = random.Random(1)
    with open(path, "w") as file:
        for row in range(64):
            numbers = [rng.randint(1, 99) for _ in range(30)]
            half, total = sum(numbers[:15]), sum(numbers)
            slip = 0 if row % 2 else rng.randint(1, 9)
            file.write(json.dumps({
                "prompt": " + ".join(map(str, numbers)) + " =",
                "completions": [f"the first fifteen add up to {half + slip}", f"the sum is {total + slip}"],
                "labels": [not slip, not slip],
            }) + "\n")  # fmt: skip


def real_dag_params(params: dict) -> None:
    """real_size.py's params (files of 256-token rows, task last_number, LoRA sft and DPO)
    with every other stage at a few steps and a few problems, and step labels from a file."""
    params["prepare"]["files"]["prm"] = {"path": PRM_FILE}
    params["verifier"].update(STEPS, max_length=LENGTH, lora=LORA)
    params["rm"].update(STEPS, num_members=2, max_length=LENGTH, lora=LORA)
    params["prm"].update(
        init="verifier", derive={"prompts": 4, "samples_per_prompt": 2, "rollouts": 2, "max_new_tokens": 16}
    )
    policy = params["policy"]
    policy.update(offline=["dpo", "kto"], online=["grpo", "ppo"])
    policy["dpo"].update(STEPS, max_length=LENGTH, lora=LORA)
    policy["kto"].update(STEPS, max_length=LENGTH, lora=LORA, per_device_train_batch_size=2)  # KTO: 2 or more
    policy["grpo"].update(
        max_steps=2, logging_steps=1, num_generations=2, per_device_train_batch_size=2, max_completion_length=16,
        lora=LORA, rewards=[{"name": "answer_match", "weight": 1.0}],
    )  # fmt: skip
    policy["ppo"].update(
        max_steps=2, rollout_batch_size=2, mini_batch_size=1, ppo_epochs=1, max_new_tokens=16, lora=LORA,
        max_length=LENGTH, rewards=[{"name": "answer_match", "weight": 1.0}],
    )  # fmt: skip
    params["merge"].update(method="linear", models=["dpo", "grpo"])
    params["evaluate"].update(max_new_tokens=16, batch_size=4, kl_prompts=4, samples=1)
    params["validate"].update(batch_size=2)
    params["infer"].update(
        limit=2, max_new_tokens=16, strategies=["greedy", "best_of_n", "self_consistency", "mcts"],
        best_of_n={"n": 2, "temperature": 0.7, "rewards": [{"name": "prm", "aggregate": "min"}]},
        self_consistency={"max_samples": 4, "round_size": 2, "stop_share": 0.75, "temperature": 0.7},
        mcts={"simulations": 2, "expand": 2, "max_depth": 2, "max_step_tokens": 8, "problems_per_batch": 2},
    )  # fmt: skip
    params["improve"]["defaults"].update(
        prompts=2, samples=2, max_new_tokens=16, train={**STEPS, "max_length": LENGTH, "lora": LORA}
    )
    params["improve"]["rounds"] = {"r1": {"after": "sft"}}


def folder_gib(folder: Path) -> float:
    """The bytes of the files under `folder` (every model the stages have written), in GiB."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder)")
    parser.add_argument("--from", dest="start", help="the first stage to run (the earlier ones done in --keep)")
    parser.add_argument("--only", help="run this one stage (the earlier ones done in --keep)")
    parser.add_argument("--sft-steps", type=int, default=2)
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="real-dag-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "qwen2.5-0.5b-random"
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    root = work / "project"
    if not (root / "params.yaml").exists():
        root = project(work, model_dir, args.sft_steps)
    else:  # a kept project: this checkout's code and these params take effect
        copy_code(root)
    write_step_labels(root / PRM_FILE)
    set_params(root, real_dag_params)
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(root)}
    names = [name for name, _, _ in STAGES]
    start = args.only or args.start
    first = names.index(start) if start else 0
    last = first + 1 if args.only else len(STAGES)
    results = []
    for name, command, update in STAGES[first:last]:
        if update:
            set_params(root, update)
        try:
            m = measured(command, root, env)
        except SystemExit as failed:
            print(json.dumps({"stage": name, "failed": str(failed)[-1500:]}), flush=True)
            break
        line = {"stage": name, "peak_gib": round(m["peak"], 2), "seconds": round(m["wall"], 1),
                "above_imports_gib": round(m["above"], 2), "models_gib": round(folder_gib(root / "models"), 2)}  # fmt: skip
        results.append(line)
        print(json.dumps(line), flush=True)
    (work / "real_dag.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
