"""What an inference-time strategy reads besides the candidate, checked before any strategy
runs (stage infer and the `generate` command): a failure after greedy and MCTS had run lost
their results, and a wrong model given quietly gives wrong numbers.

* A speculative draft and ensemble members share the candidate's tokenizer: token ids pass
  between the models (the target verifies the draft's; members' logits are added id by id).
* A PRM (MCTS's, best-of-N's `prm` reward) was written by stage prm and splits steps on the
  task's separator (it would score other steps than the model writes); an RM ensemble
  (best-of-N's `reward_model` reward) holds members.

`keys` names each input as the caller's user gives it (a params key or a flag).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlhf.inference.settings import Strategies
from rlhf.rewards.functions import ModelDirs, model_path
from rlhf.tasks.base import Task

STAGE_KEYS = {
    "draft": "infer.speculative.draft",
    "member": "infer.ensemble.members[{index}]",
    "prm": "infer.prm",
    "reward": "infer.best_of_n.rewards[{index}].path",
}


def check_same_tokenizer(path, tokenizer, key: str, trust_remote_code: bool, what: str) -> None:
    """`path` is a model directory whose tokenizer is the candidate's (`tokenizer`), else an
    error naming `key`; `what` says what to give instead."""
    from rlhf.models.folders import UnusableModelError, check_model_dir, resolve_model_dir
    from rlhf.models.loading import load_tokenizer

    check_model_dir(resolve_model_dir(path), key)
    theirs, ours = load_tokenizer(path, trust_remote_code).get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise UnusableModelError(
            f"{key} {path}: its tokenizer is not the candidate's ({len(theirs)} tokens against {len(ours)}, "
            f"{differ} token-id pairs not shared); {what}"
        )


def check_inputs(
    strategies: Sequence[str],
    settings: Strategies,
    tokenizer,
    task: Task,
    model_dirs: ModelDirs | None = None,
    keys: Mapping[str, str] = STAGE_KEYS,
) -> None:
    """Check what `strategies` read besides the candidate (module docstring); `model_dirs`
    gives the scorers' folders where the settings name none."""
    from rlhf.rewards.prm import check_prm

    model_dirs = model_dirs or {}
    trust = settings.trust_remote_code
    if "speculative" in strategies:
        what = "give a smaller model of the candidate's family, trained with the same tokenizer"
        check_same_tokenizer(settings.speculative.draft, tokenizer, keys["draft"], trust, what)
    if "ensemble" in strategies:
        what = "ensemble members are models trained from the candidate's base"
        for index, member in enumerate(settings.ensemble.members):
            check_same_tokenizer(member, tokenizer, keys["member"].format(index=index), trust, what)
    prm = settings.prm or model_dirs.get("prm")
    if "mcts" in strategies and prm is not None:
        check_prm(prm, task.step_separator, keys["prm"])
    if "best_of_n" in strategies:
        from rlhf.models.folders import ModelNotFoundError
        from rlhf.rewards.ensemble import member_dirs

        for index, reward in enumerate(settings.best_of_n.rewards):
            key = keys["reward"].format(index=index)
            if reward.name == "prm":
                check_prm(model_path(reward, model_dirs), task.step_separator, key)
            elif reward.name == "reward_model":
                try:
                    member_dirs(model_path(reward, model_dirs))
                except FileNotFoundError as error:
                    raise ModelNotFoundError(f"{key}: {error}") from None
