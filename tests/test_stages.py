"""Every stage, run in process on a tiny budget in a fresh project, in DAG order.

The chain runs once per module (a fixture); each test asserts what one stage must have
written: models whose weights changed, metrics that are present and finite, the gate's
verdict and the MLflow runs and registry alias that go with it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.conftest import make_project, run, run_stages_in

pytestmark = pytest.mark.slow  # trains real models: the full suite runs it, the quick tier does not


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def changed(a: dict, b: dict, prefix: str = "") -> list[str]:
    return [k for k in a if k in b and k.startswith(prefix) and not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny project after running every stage's main() in order, with a temporary
    MLflow store."""
    import stages.base
    import stages.check_params
    import stages.evaluate
    import stages.gate
    import stages.infer
    import stages.merge
    import stages.policy
    import stages.prepare
    import stages.prm
    import stages.rm
    import stages.sft
    import stages.validate
    import stages.verifier
    from tests.conftest import deep_update, tiny_params

    # The model as it came, scored beside the candidates (evaluate.baselines).
    params = deep_update(tiny_params(), {"evaluate": {"baselines": ["base"]}})
    root = make_project(tmp_path_factory.mktemp("stages") / "project", params)
    with pytest.MonkeyPatch.context() as mp:
        run_stages_in(mp, root, f"sqlite:///{root / 'mlflow.db'}")
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "stages-test")
        stages.check_params.main()
        stages.prepare.main()
        stages.base.main()
        stages.sft.main()
        stages.verifier.main()
        stages.rm.main()
        stages.prm.main()
        stages.policy.main(["dpo"])
        stages.merge.main()
        stages.evaluate.main()
        stages.validate.main()
        stages.gate.main()
        stages.infer.main()
    return root


def test_check_params_writes_its_constant_stamp(project):
    assert (project / "reports/params.ok").read_text() == "params.yaml is valid\n"


def test_prepare_writes_every_contract(project):
    manifest = json.loads((project / "data/prepared/manifest.json").read_text())
    assert manifest["source"] == "builtin"
    assert manifest["rows"] == {
        "sft": 400, "prefs": 64, "prefs_eval": 24, "unpaired": 32, "prm": 32, "prm_eval": 16, "prompts": 32,
        "eval_dev": 24, "eval_test": 24, "compress": 0,
    }  # fmt: skip
    for name in manifest["rows"]:
        path = f"data/prepared/eval/{name[5:]}.parquet" if name.startswith("eval_") else f"data/prepared/{name}.parquet"
        assert (project / path).is_file(), path
    import pandas as pd

    dev, test = (pd.read_parquet(project / f"data/prepared/eval/{s}.parquet") for s in ("dev", "test"))
    assert not set(dev["prompt"]) & set(test["prompt"]), "dev and test share no problem"
    training = set(pd.read_parquet(project / "data/prepared/sft.parquet")["prompt"])
    assert not (set(dev["prompt"]) | set(test["prompt"])) & training, "no eval problem is trained on"
    assert set(dev["difficulty"]) <= {"3", "4", "5"}


def test_base_builds_a_loadable_model_and_tokenizer(project):
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(project / "models/base")
    model = load_causal_lm(project / "models/base")
    ids = tokenizer("12+3\n", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "12+3\n"  # character-level, lossless
    assert model.config.vocab_size == len(tokenizer)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}],
        tokenize=False,
        return_assistant_tokens_mask=False,
    )
    assert rendered == "<|user|>1+1<|end|><|assistant|>2<|end|>"


def test_sft_changes_weights_and_reports_a_finite_loss(project):
    metrics = json.loads((project / "metrics/sft.json").read_text())
    assert metrics["steps"] == 4 and math.isfinite(metrics["train_loss"])
    assert changed(weights(project / "models/base"), weights(project / "models/sft"))
    curve = (project / "plots/sft/loss.csv").read_text().splitlines()
    assert curve[0].startswith("step,loss") and len(curve) == 1 + 4  # logging_steps=1
    assert not (project / "checkpoints/sft").exists(), "checkpoints are discarded once the stage succeeds"


def test_reward_ensemble_members_differ_and_accuracy_is_reported(project):
    metrics = json.loads((project / "metrics/rm.json").read_text())
    assert set(metrics["members"]) == {"member_0", "member_1"}
    assert 0.0 <= metrics["ensemble_accuracy"] <= 1.0 and metrics["eval_pairs"] == 24
    w0, w1 = weights(project / "models/rm/member_0"), weights(project / "models/rm/member_1")
    assert changed(w0, w1, "model.layers"), "members train from different seeds: different data orders"
    assert (project / "models/rm/member_0/reward_head.json").is_file(), "the default kind is likelihood"


def test_dpo_changes_the_policy(project):
    metrics = json.loads((project / "metrics/policy/dpo.json").read_text())
    assert metrics["method"] == "dpo" and metrics["steps"] == 2 and math.isfinite(metrics["train_loss"])
    assert changed(weights(project / "models/sft"), weights(project / "models/policy/dpo"))


def test_evaluate_reports_every_metric_for_reference_and_candidates(project):
    report = json.loads((project / "reports/eval.json").read_text())
    assert report["reference"] == "sft" and report["candidates"] == ["dpo", "merged"]
    assert report["baselines"] == ["base"]  # scored, never a candidate
    assert set(report["suites"]) == {"dev", "test"}
    dev = report["suites"]["dev"]
    for name in ("sft", "dpo", "merged", "base"):
        assert set(dev[name]) >= {
            "accuracy", "accuracy_low", "accuracy_high", "accuracy_by_difficulty", "format_rate", "kl_to_ref",
            "reward", "reward_std", "win_rate", "distinct_1", "distinct_2",
        }  # fmt: skip
        assert dev[name]["accuracy_low"] <= dev[name]["accuracy"] <= dev[name]["accuracy_high"]
        counts = dev[name]["problems_by_difficulty"]
        assert sum(counts.values()) == 24
        by_level = dev[name]["accuracy_by_difficulty"]
        assert sum(by_level[k] * counts[k] for k in counts) / 24 == pytest.approx(dev[name]["accuracy"])
        intervals = dev[name]["accuracy_by_difficulty_interval"]
        assert set(intervals) == set(by_level)
        assert all(low <= by_level[k] <= high for k, (low, high) in intervals.items())
    assert dev["sft"]["kl_to_ref"] == 0.0 and dev["sft"]["win_rate"] == 0.5
    assert dev["base"]["reward"] is None and dev["base"]["kl_to_ref"] is None  # a baseline is not judged
    assert dev["dpo"]["kl_to_ref"] >= 0.0
    outcomes = json.loads((project / "reports/outcomes.json").read_text())
    per_problem = outcomes["suites"]["dev"]["models"]["dpo"]["accuracy"]
    assert len(per_problem) == 24 and sum(per_problem) / 24 == pytest.approx(dev["dpo"]["accuracy"])
    labels = outcomes["suites"]["dev"]["difficulty"]  # aligned with the accuracy outcomes
    assert len(labels) == 24 and {label: labels.count(label) for label in set(labels)} == counts
    # The baseline's outcomes are kept (a paired comparison with it), its completions are not
    # validate's to check, and the gate judges the candidates only.
    assert len(outcomes["suites"]["test"]["models"]["base"]["accuracy"]) == 24
    completions = json.loads((project / "reports/completions.json").read_text())
    assert set(completions["suites"]["dev"]["models"]) == {"sft", "dpo", "merged"}
    assert set(json.loads((project / "reports/gate.json").read_text())["candidates"]) == {"dpo", "merged"}
    samples = json.loads((project / "reports/samples.json").read_text())
    assert set(samples["dev"]) == {"sft", "dpo", "merged", "base"}


def test_gate_promotes_into_models_champion_and_the_registry(project):
    verdict = json.loads((project / "reports/gate.json").read_text())
    assert verdict["promoted"] and verdict["champion"] == "dpo"
    record = json.loads((project / "models/champion/champion.json").read_text())
    assert record["candidate"] == "dpo"
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    version = client.get_model_version_by_alias("rlhf-policy", "champion")
    assert str(version.version) == record["model_version"]


def test_every_stage_logged_an_mlflow_run_with_params_and_commit(project):
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("stages-test")
    runs = client.search_runs([experiment.experiment_id])
    by_stage = {r.data.tags.get("rlhf.stage"): r for r in runs if r.data.tags.get("rlhf.stage")}
    assert set(by_stage) == {
        "prepare", "base", "sft", "verifier", "rm", "prm", "policy@dpo", "merge", "evaluate", "validate", "gate",
        "infer",
    }  # fmt: skip
    sft = by_stage["sft"]
    assert sft.data.params["max_steps"] == "4"
    assert "loss" in sft.data.metrics, "training curves come from transformers' MLflow callback"
    assert len(sft.data.tags["mlflow.source.git.commit"]) >= 40


def test_gate_rejects_a_worse_candidate_and_the_champion_stays(project):
    """After `dpo` was promoted, a candidate whose dev accuracy is below the champion's
    recorded accuracy (and that has no per-problem outcomes, so the test compares point
    estimates) fails the `relative_to: champion` test: reports/gate.json lists the
    reason, models/champion is byte-for-byte the same, and the registry alias does not move."""
    import shutil

    import stages.gate
    from tests.test_pipeline_e2e import tree_digest

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    alias_before = client.get_model_version_by_alias("rlhf-policy", "champion").version
    champion_before = tree_digest(project / "models/champion")
    record = json.loads((project / "models/champion/champion.json").read_text())
    champion_accuracy = record["metrics"]["dev"]["accuracy"]

    shutil.copytree(project / "models/sft", project / "models/policy/worse")
    report = json.loads((project / "reports/eval.json").read_text())
    worse = dict(report["suites"]["dev"]["dpo"], accuracy=champion_accuracy - 0.10)
    report["candidates"] = ["worse"]
    report["suites"]["dev"]["worse"] = worse
    report["suites"]["dev"]["sft"]["accuracy"] = champion_accuracy - 0.20  # passes the SFT test
    (project / "reports/eval.json").write_text(json.dumps(report))
    # The validator passes it as it passed dpo: the one failure is the champion test.
    validation = json.loads((project / "reports/validation.json").read_text())
    validation["candidates"]["worse"] = validation["candidates"]["dpo"]
    (project / "reports/validation.json").write_text(json.dumps(validation))

    params = project / "params.yaml"
    original = params.read_text()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "stages-test")
        import yaml

        data = yaml.safe_load(original)
        data["gate"]["tests"].append({"metric": "accuracy", "relative_to": "champion", "op": ">=", "threshold": 0.0})
        params.write_text(yaml.safe_dump(data))
        try:
            stages.gate.main()
        finally:
            params.write_text(original)

    verdict = json.loads((project / "reports/gate.json").read_text())
    assert verdict["promoted"] is False and verdict["champion"] == "dpo"
    failures = verdict["candidates"]["worse"]["failures"]
    assert len(failures) == 1 and "champion" in failures[0] and f"{champion_accuracy - 0.10:.4f}" in failures[0]
    assert tree_digest(project / "models/champion") == champion_before
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == alias_before


def test_merge_of_one_candidate_is_that_candidate(project):
    """A linear merge of the one policy (weight 1, normalised) is the policy itself."""
    merged, dpo = weights(project / "models/merged"), weights(project / "models/policy/dpo")
    assert set(merged) == set(dpo)
    worst = max(float((merged[k] - dpo[k]).abs().max()) for k in dpo)
    assert worst <= 1e-6, f"largest difference {worst}"
    assert json.loads((project / "metrics/merge.json").read_text())["members"] == ["dpo"]


def test_infer_reports_every_strategy(project):
    """Each strategy's accuracy is a fraction of the tiny suite; sampling strategies draw
    their budgets (best-of-n: n; full vote: max_samples; early stop: at most that)."""
    report = json.loads((project / "reports/infer.json").read_text())
    strategies = report["strategies"]
    assert set(strategies) == {"greedy", "best_of_n", "self_consistency", "self_consistency_full", "mcts"}
    assert all(0.0 <= s["accuracy"] <= 1.0 and s["tokens_per_problem"] > 0 for s in strategies.values())
    assert strategies["greedy"]["samples_per_problem"] == 1 and strategies["best_of_n"]["samples_per_problem"] == 2
    assert strategies["self_consistency_full"]["samples_per_problem"] == 4
    assert strategies["self_consistency"]["samples_per_problem"] <= 4
    samples = json.loads((project / "reports/infer_samples.json").read_text())
    assert set(samples) == set(strategies) - {"self_consistency_full"}


def test_gate_promotes_the_merged_candidate_when_it_is_best(project):
    """`merged` is a candidate like any policy: with the best dev accuracy it passes
    and is promoted, and models/champion holds models/merged's weights."""
    import stages.gate

    report = json.loads((project / "reports/eval.json").read_text())
    dev = report["suites"]["dev"]
    best = max(m["accuracy"] for m in dev.values() if isinstance(m, dict))
    report["candidates"] = ["dpo", "merged"]
    dev["merged"] = dict(dev["dpo"], accuracy=best + 0.1)
    (project / "reports/eval.json").write_text(json.dumps(report))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "stages-test")
        stages.gate.main()
    verdict = json.loads((project / "reports/gate.json").read_text())
    assert verdict["promoted"] is True and verdict["promote"] == "merged" and verdict["champion"] == "merged"
    champion, merged = weights(project / "models/champion"), weights(project / "models/merged")
    assert set(champion) == set(merged) and not changed(champion, merged)


def run_gate_on(project, report: dict, **env) -> dict:
    """Stage gate on a doctored eval report (the candidates' weights are the real ones)."""
    import stages.gate

    (project / "reports/eval.json").write_text(json.dumps(report))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "stages-test")
        for key, value in env.items():
            mp.setenv(key, value)
        stages.gate.main()
    return json.loads((project / "reports/gate.json").read_text())


def report_where_best(project, name: str) -> dict:
    """The eval report with `name` 0.2 above every model on dev (no per-problem outcomes
    for it: the gate compares point estimates)."""
    report = json.loads((project / "reports/eval.json").read_text())
    dev = report["suites"]["dev"]
    best = max(m["accuracy"] for m in dev.values() if isinstance(m, dict))
    report["candidates"] = ["dpo", "merged"]
    dev[name] = dict(dev["dpo"], accuracy=best + 0.2)
    return report


def test_a_gate_that_cannot_reach_the_tracking_store_writes_its_verdict_first(project):
    """The verdict is written before any tracking call: with the tracking store down the
    gate fails with one message, its verdict on disk and nothing promoted; once the store
    answers, the next run decides the promotion."""
    import stages.gate
    from rlhf.tracking.champion import registry_champion

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    before = registry_champion(client, "rlhf-policy")
    down = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    with pytest.raises(stages.gate.TrackingUnreachableError, match=r"tracking store at http://127.0.0.1:9"):
        run_gate_on(project, report_where_best(project, "dpo"), **down)
    verdict = json.loads((project / "reports/gate.json").read_text())
    assert verdict["promote"] == "dpo" and verdict["promoted"] is False and "rerun `dvc repro`" in verdict["pending"]
    assert registry_champion(client, "rlhf-policy") == before
    verdict = run_gate_on(project, report_where_best(project, "dpo"))
    assert "pending" not in verdict and (verdict["promoted"] or verdict["held_back"])


def test_a_verdict_the_tracking_store_misses_after_a_promotion_is_logged_by_the_next_gate(project, monkeypatch, capsys):
    """The store stops answering once the champion has moved: the gate still exits 0 with the
    promotion on disk and in the registry, keeps the verdict's tags, metric and file in
    models/.tracking-owed (`rlhf status` says so), and the next gate logs them to that run
    before its own work."""
    import stages.gate
    from rlhf.cli import status

    promote = stages.gate.promote

    def promote_then_lose_the_store(*args, **kwargs):
        record = promote(*args, **kwargs)
        os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:9"  # nothing answers there (run_gate_on restores it)
        return record

    monkeypatch.setattr(stages.gate, "promote", promote_then_lose_the_store)
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    verdict = run_gate_on(project, report_where_best(project, "merged"), MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    assert verdict["promoted"] is True and verdict["champion"] == "merged"
    assert client.get_model_version_by_alias("rlhf-policy", "champion").tags["candidate"] == "merged"
    (owed,) = (project / "models/.tracking-owed").glob("*.json")
    run_id = owed.stem
    assert "gate.promoted" not in client.get_run(run_id).data.tags
    with monkeypatch.context() as mp:
        mp.chdir(project)
        capsys.readouterr()
        status([])
    assert f"the verdict of gate run(s) {run_id} is not logged yet" in capsys.readouterr().out
    monkeypatch.setattr(stages.gate, "promote", promote)
    verdict_then = json.loads((project / "reports/gate.json").read_text())
    run_gate_on(project, report_where_best(project, "merged"))
    assert not owed.exists()
    logged = client.get_run(run_id).data
    assert logged.tags["gate.promoted"] == "True" and logged.tags["gate.champion"] == "merged"
    assert logged.metrics["promoted"] == 1.0
    path = client.download_artifacts(run_id, "gate.json", str(project.parent))
    assert json.loads(Path(path).read_text()) == verdict_then


def test_a_queued_experiment_is_judged_against_the_workspaces_champion(project, tmp_path):
    """`dvc exp run --queue` runs the stages in a temporary copy without models/champion
    (models/ is not in git; DVC_ROOT names the workspace). Its gate compares with the
    workspace's champion, not with none, and never promotes, even with
    promote_in_experiments, whose champion folder would be discarded with the copy."""
    from tests.test_pipeline_e2e import tree_digest

    copy = tmp_path / "queued"
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("champion", "mlflow.db", "mlartifacts"))
    (copy / "reports/outcomes.json").unlink(missing_ok=True)  # point estimates: the doctored report decides
    params = yaml.safe_load((copy / "params.yaml").read_text())
    params["gate"]["tests"].append({"metric": "accuracy", "relative_to": "champion", "op": ">", "threshold": 0.01})
    (copy / "params.yaml").write_text(yaml.safe_dump(params))
    record = json.loads((project / "models/champion/champion.json").read_text())
    report = report_where_best(copy, "merged")
    report["suites"]["dev"]["merged"]["accuracy"] = record["metrics"]["dev"]["accuracy"]  # no gain over it
    before = tree_digest(project / "models/champion")
    env = {"DVC_EXP_NAME": "queued-1", "DVC_ROOT": str(project)}
    verdict = run_gate_on(copy, report, **env)
    assert verdict["previous_champion"] == record["candidate"], "the workspace's champion, not none"
    (failure,) = verdict["candidates"]["merged"]["failures"]
    assert failure.startswith("accuracy[dev] > champion+0.01: "), "judged against the workspace's champion"
    params["gate"]["promote_in_experiments"] = True
    (copy / "params.yaml").write_text(yaml.safe_dump(params))
    verdict = run_gate_on(copy, report_where_best(copy, "merged"), **env)
    assert verdict["promoted"] is False and "temporary copy of the project" in verdict["held_back"]
    assert tree_digest(project / "models/champion") == before


def test_a_dvc_experiment_does_not_move_the_champion(project):
    """Under `dvc exp run` (DVC_EXP_NAME set) a passing candidate is reported, not promoted."""
    from tests.test_pipeline_e2e import tree_digest

    before = tree_digest(project / "models/champion")
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    alias = client.get_model_version_by_alias("rlhf-policy", "champion").version
    verdict = run_gate_on(project, report_where_best(project, "merged"), DVC_EXP_NAME="try-beta")
    assert verdict["promoted"] is False and "DVC experiment 'try-beta'" in verdict["held_back"]
    assert tree_digest(project / "models/champion") == before
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == alias


def test_the_champion_loads_from_the_registry_anywhere_and_rolls_back(project, tmp_path, monkeypatch):
    """Every promoted version is an MLflow transformers model: from another directory,
    `models:/rlhf-policy@champion` loads as a text-generation pipeline with the champion's
    weights. `rlhf rollback --version V`, run in a second clone pointed at the
    same tracking store, brings version V back: that clone's models/champion holds its
    weights and record, the alias points at it, and a run records the move."""
    import mlflow

    import rlhf.cli.rollback

    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(uri)
    if len(client.search_model_versions("name = 'rlhf-policy'")) < 2:
        assert run_gate_on(project, report_where_best(project, "merged"))["promoted"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # not the project
    pipe = mlflow.transformers.load_model("models:/rlhf-policy@champion")
    loaded = {k: v for k, v in pipe.model.state_dict().items()}
    champion = weights(project / "models/champion")
    assert not changed(champion, {k: loaded[k] for k in champion}), "the registry holds the champion's weights"
    assert isinstance(pipe("1+2+3\n", max_new_tokens=8)[0]["generated_text"], str)

    current = str(client.get_model_version_by_alias("rlhf-policy", "champion").version)
    target = next(
        str(v.version) for v in client.search_model_versions("name = 'rlhf-policy'") if str(v.version) != current
    )
    # The rollback runs in a second clone of the project pointed at the same tracking store:
    # the registry, not the first workspace, is where the versions live.
    second = tmp_path / "second"
    run(["git", "clone", "-q", str(project), str(second)], tmp_path)
    monkeypatch.chdir(second)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "stages-test")
    with pytest.raises(SystemExit, match="has no version 99"):
        rlhf.cli.rollback.main(["--version", "99"])
    with pytest.raises(SystemExit, match=f"version {current} is the champion already"):
        rlhf.cli.rollback.main(["--version", current])
    rlhf.cli.rollback.main(["--version", str(target)])
    assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == target
    record = json.loads((second / "models/champion/champion.json").read_text())
    assert record["model_version"] == target and record["restored"]["from_version"] == current
    restored = mlflow.transformers.load_model(f"models:/rlhf-policy/{target}").model.state_dict()
    champion = weights(second / "models/champion")
    assert not changed(champion, {k: restored[k] for k in champion})
    runs = client.search_runs(
        [client.get_experiment_by_name("stages-test").experiment_id], "tags.`rlhf.stage` = 'rollback'"
    )
    assert runs and runs[0].data.tags["rollback.to_version"] == target
    # --sync where the rollback ran has nothing to catch up: the same record, byte for byte
    # (its provenance kept), so nothing that starts from the champion reruns.
    rolled_back = (second / "models/champion/champion.json").read_bytes()
    rlhf.cli.rollback.main(["--sync"])
    assert (second / "models/champion/champion.json").read_bytes() == rolled_back
    # Pinned: the next gate (a scheduled run, say) holds back even a better candidate,
    # until --unpin.
    assert record["pinned"].startswith(f"rolled back from version {current} to version {target}")
    (second / "reports").mkdir(exist_ok=True)
    shutil.copytree(project / "models/policy", second / "models/policy", dirs_exist_ok=True)
    shutil.copy(project / "reports/eval.json", second / "reports/eval.json")
    verdict = run_gate_on(second, report_where_best(second, "dpo"), MLFLOW_TRACKING_URI=uri)
    assert verdict["promoted"] is False and "the champion is pinned: rolled back from" in verdict["held_back"]
    assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == target
    # The first workspace still holds version `current`: its gate (its scheduled run) does
    # not promote over the rollback either, and says how to catch up.
    verdict = run_gate_on(project, report_where_best(project, "dpo"))
    assert verdict["promoted"] is False
    assert (
        f"the registry's champion is version {target} and models/champion holds version {current}"
        in (verdict["held_back"])
    )
    assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == target
    rlhf.cli.rollback.main(["--unpin"])
    assert "pinned" not in json.loads((second / "models/champion/champion.json").read_text())
    with pytest.raises(SystemExit, match="is not pinned"):
        rlhf.cli.rollback.main(["--unpin"])
    monkeypatch.chdir(project)
    rlhf.cli.rollback.main(["--sync"])  # the first workspace catches up: the registry's champion, its pin cleared
    synced = json.loads((project / "models/champion/champion.json").read_text())
    assert synced["model_version"] == target and "pinned" not in synced
    assert not changed(champion, weights(project / "models/champion"))

    # The folder and the alias move together: an alias that cannot move (no such version)
    # leaves the folder as it was.
    from mlflow.exceptions import MlflowException

    from rlhf.tracking.champion import moving_champion
    from tests.test_pipeline_e2e import tree_digest

    before = tree_digest(project / "models/champion")
    with pytest.raises(MlflowException):
        with moving_champion(client, "rlhf-policy", "999", project / "models/champion") as staging:
            (staging / "config.json").write_text("{}")
    assert tree_digest(project / "models/champion") == before
    assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == target
    # Another clone moved the champion (or pinned it) while this one logged its model: the
    # alias and the folder stay, and the error says how to catch up.
    from rlhf.tracking.champion import ChampionMovedError, RegistryChampion, registry_champion

    seen = registry_champion(client, "rlhf-policy")
    stale = RegistryChampion(current, None, seen.run_id)
    with pytest.raises(ChampionMovedError, match=rf"moved while this ran \(version {current} -> {target}\)"):
        with moving_champion(client, "rlhf-policy", current, project / "models/champion", stale) as staging:
            (staging / "config.json").write_text("{}")
    assert tree_digest(project / "models/champion") == before
    assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == target

    # A version registered by hand (no gate run, no record), which another clone's alias
    # could name.
    source = client.get_model_version("rlhf-policy", target).source
    by_hand = str(client.create_model_version("rlhf-policy", source).version)
    # Putting the folder in place fails after the alias moved: the alias moves back, unless
    # another clone moved it in between (its move stands); nothing of the move is left.
    import rlhf.tracking.champion as champion_module

    real_forward = champion_module._move_forward

    def failing_after(other_clone: str | None):
        def forward(client_, intent, champion_dir):
            champion_module.set_champion_alias(client_, intent["registered_model"], intent["to_version"])
            if other_clone:
                client.set_registered_model_alias("rlhf-policy", "champion", other_clone)
            raise OSError("no space left on device")

        return forward

    for other_clone, expected in ((None, target), (by_hand, by_hand)):
        monkeypatch.setattr(champion_module, "_move_forward", failing_after(other_clone))
        with pytest.raises(OSError, match="no space left"):
            with moving_champion(client, "rlhf-policy", current, project / "models/champion") as staging:
                (staging / "config.json").write_text("{}")
        assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == expected
        assert tree_digest(project / "models/champion") == before
        assert not champion_module.move_dir(project / "models/champion").exists()
    monkeypatch.setattr(champion_module, "_move_forward", real_forward)
    client.set_registered_model_alias("rlhf-policy", "champion", target)

    # The version registered by hand cannot become the champion: refused before any
    # download (it failed after the weights came, on the missing record).
    with pytest.raises(SystemExit, match=rf"version {by_hand} of 'rlhf-policy' was not promoted by the gate"):
        rlhf.cli.rollback.main(["--version", by_hand])
    assert tree_digest(project / "models/champion") == before


def test_policy_plots_find_a_reward_under_the_name_trl_logs():
    """build_rewards numbers the functions (0_reward_model, 1_answer_match) and TRL logs
    each under its name: the accuracy curve is the answer reward's mean whatever its index."""
    from stages.policy import plotted_curves

    curve = [
        {
            "step": 1,
            "loss": 0.5,
            "reward": 0.2,
            "rewards/0_reward_model/mean": 0.1,
            "rewards/1_answer_match/mean": 0.25,
        },
        {"step": 2, "loss": 0.4, "reward": 0.3, "rewards/0_reward_model/mean": 0.2, "rewards/1_answer_match/mean": 0.5},
    ]
    plotted = plotted_curves(curve)
    assert plotted["accuracy"] == [
        {"step": 1, "rewards/1_answer_match/mean": 0.25},
        {"step": 2, "rewards/1_answer_match/mean": 0.5},
    ]
    assert set(plotted) == {"loss", "reward", "accuracy"}


@pytest.mark.slow
def test_a_stage_started_by_hand_names_inputs_that_differ_from_dvc_lock(tmp_path):
    """A bit flipped in a model after its run: `dvc status` sees it, but a stage started by
    hand (`python -m stages.<name>`, as the fault table starts them) read the damaged model
    without a word. In a real DVC repo: after `dvc repro`, a hand-run stage says nothing;
    with a byte of a dep flipped and params.yaml edited, it names both before it runs; run
    by DVC (DVC_STAGE set) it leaves the comparison to DVC."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    env.pop("DVC_STAGE", None)
    (tmp_path / "models/sft").mkdir(parents=True)
    (tmp_path / "models/sft/model.safetensors").write_bytes(bytes(range(256)) * 64)
    shutil.copy(repo / "params.yaml", tmp_path / "params.yaml")
    stage = {
        "cmd": "python -m stages.check_params",
        "deps": ["params.yaml", "models/sft"],
        "outs": ["reports/params.ok"],
    }
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"check_params": stage}}))

    def call(*command: str, **extra) -> subprocess.CompletedProcess:
        done = subprocess.run(command, cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    call("git", "init", "-q")
    call(sys.executable, "-m", "dvc", "init", "-q")
    call(sys.executable, "-m", "dvc", "repro", "-q")
    assert "dvc.lock" not in call(sys.executable, "-m", "stages.check_params").stderr
    weights = tmp_path / "models/sft/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0x01
    weights.write_bytes(bytes(data))
    with open(tmp_path / "params.yaml", "a") as params:
        params.write("# edited\n")
    said = call(sys.executable, "-m", "stages.check_params").stderr
    assert "check_params: started by hand, and what it reads differs from what dvc.lock recorded: " in said
    assert "models/sft (modified)" in said and "params.yaml (modified)" in said
    assert "dvc.lock" not in call(sys.executable, "-m", "stages.check_params", DVC_STAGE="check_params").stderr
