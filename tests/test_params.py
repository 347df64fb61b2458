"""params.yaml validation (rlhf.params) against the real stage Configs (stages.all_configs)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

import stages
from rlhf.params import ParamsError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def repo_params() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def write_params(tmp_path: Path, params: dict, name: str = "params.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return str(path)


def params_error(path: str) -> ParamsError:
    with pytest.raises(ParamsError) as error:
        stages.load_all(path)
    return error.value


def test_repo_params_validate(repo_params):
    """The committed params.yaml validates, and every scalar key in it is what the Config
    holds (nothing silently dropped or defaulted)."""
    configs = stages.load_all(str(REPO / "params.yaml"))
    assert set(configs) == set(stages.SECTIONS)
    for section, values in repo_params.items():
        for key, value in (values or {}).items():
            if not isinstance(value, dict | list):
                assert getattr(configs[section], key) == value, f"{section}.{key}"


def test_params_yaml_writes_out_the_config_defaults():
    """One source of defaults: every section of params.yaml validates to exactly its
    Config's defaults, so a value changed in one place and not the other fails here."""
    configs = stages.load_all(str(REPO / "params.yaml"))
    classes = stages.all_configs()
    differ = [
        f"{section}: params.yaml {configs[section].model_dump()} != Config() {classes[section]().model_dump()}"
        for section in stages.SECTIONS
        if configs[section] != classes[section]()
    ]
    assert differ == []


def test_validation_imports_no_training_library():
    """Validating params imports no torch, transformers, TRL, datasets or MLflow (what made
    check_params and gate take 10-14 s), so a bad key fails in about a second."""
    code = (
        "import sys, stages; stages.load_all(); "
        "print(sorted(m for m in ('torch', 'transformers', 'trl', 'datasets', 'mlflow') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_check_params_imports_no_training_library(tmp_path):
    """Stage check_params on the default params, run as DVC runs it, imports none of them
    either (its chat-template check loaded transformers and torch for every project, 5-10 s
    a run, when only a local template and a local conversation file need it)."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    code = (
        "import runpy, sys; runpy.run_module('stages.check_params', run_name='__main__'); "
        "print(sorted(m for m in ('torch', 'transformers', 'trl', 'datasets', 'mlflow') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines() == ["check_params: params.yaml is valid", "[]"], result.stdout


def test_every_section_has_a_config():
    configs = stages.all_configs()
    assert set(configs) == set(stages.SECTIONS)
    assert all(issubclass(config, BaseModel) for config in configs.values())


def test_the_loader_collects_each_sections_own_cross_section_rules():
    """A rule that spans sections lives in the Config that asks for it (`cross_problems`);
    the loader asks every section, in order, and says a message two sections give once."""
    from rlhf.params import StageConfig, cross_section_problems, validate_params

    class Names(StageConfig):
        known: list[str] = ["a", "b"]

    class Reader(StageConfig):
        reads: str = "a"

        def cross_problems(self, run, section):
            known = run["names"].known
            return [] if self.reads in known else [f"{section}.reads: no name {self.reads!r} (names.known: {known})"]

    class Echo(StageConfig):
        def cross_problems(self, run, section):
            return ["names.known: said by two sections"] * 2

    configs = {"names": Names, "first": Reader, "second": Reader, "echo": Echo}
    params = validate_params({"first": {"reads": "c"}, "second": {"reads": "b"}}, configs)
    assert cross_section_problems(params, params) == [
        "first.reads: no name 'c' (names.known: ['a', 'b'])",
        "names.known: said by two sections",
    ]
    # The real sections: stages/__init__.py holds no rule of its own; each is a Config's.
    assert [s for s, c in stages.all_configs().items() if hasattr(c, "cross_problems")] == [
        "prepare", "sft", "verifier", "rm", "prm", "compress", "policy", "merge", "evaluate", "validate", "gate", "infer",
        "improve",
    ]  # fmt: skip
    source = (REPO / "stages/__init__.py").read_text()  # reads prepare's suites only, of the stages' sections
    read = [s for s, c in stages.SECTIONS.items() if c.startswith("stages.") and f'params["{s}"]' in source]
    assert read == ["prepare"]


def test_every_config_field_is_documented():
    """STYLE: each Config field has its one-line description beside it."""

    def undocumented(model: type[BaseModel], prefix: str) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{prefix}.{name}")
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                missing += undocumented(annotation, f"{prefix}.{name}")
        return missing

    missing = [key for section, config in stages.all_configs().items() for key in undocumented(config, section)]
    assert missing == []


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("sft", "learnin_rate", 0.1, "sft.learnin_rate: unknown key"),
        ("sft", "max_steps", "many", "sft.max_steps: Input should be a valid integer"),
        ("rm", "num_members", 0, "rm.num_members: Input should be greater than or equal to 1 (got 0)"),
        ("sft", "loss_on", "prompt", "sft.loss_on: String should match pattern"),
        ("base", "max_length", 8, "base.max_length: Input should be greater than 8 (got 8)"),
        # A typo here failed only once the trainer was built (PPO: after every model loaded);
        # cosine_with_min_lr needs scheduler arguments no param gives.
        ("sft", "lr_scheduler_type", "cosin", "sft.lr_scheduler_type: Input should be 'linear', 'cosine', "),
        ("sft", "lr_scheduler_type", "cosine_with_min_lr", "sft.lr_scheduler_type: Input should be 'linear', "),
        # Every completion contains "": every candidate failed the validator, after evaluation.
        ("validate", "banned", ["as an AI", " "], "validate.banned: entries [1] are blank"),
    ],
)
def test_one_bad_key(tmp_path, repo_params, section, key, value, expected):
    params = copy.deepcopy(repo_params)
    params[section][key] = value
    error = params_error(write_params(tmp_path, params))
    assert len(error.problems) == 1
    assert error.problems[0].startswith(expected), error.problems[0]


def test_every_problem_in_one_error(tmp_path, repo_params):
    """Seven independent mistakes across five sections and two nesting levels: one
    ParamsError, one line per mistake, each naming its full dotted key."""
    params = copy.deepcopy(repo_params)
    params["sft"]["learnin_rate"] = 0.1  # typo
    params["sft"]["max_steps"] = "many"  # wrong type
    params["rm"]["num_members"] = 0  # out of range (1..16)
    params["policy"]["dpo"]["loss_type"] = "sigmoidd"  # unknown DPO loss
    params["gate"]["tests"] = [{"metric": "accuracy"}, {"metric": "kl_to_ref", "op": "=="}]  # not a comparison
    params["prepare"]["builtin"]["min_operands"] = 6  # more than max_operands (5)
    params["rewards"] = {"k": 1}  # unknown section
    path = write_params(tmp_path, params)
    error = params_error(path)
    message = str(error)
    assert message.startswith(f"{path}: 7 problem(s):")
    assert len(error.problems) == 7
    for expected in [
        "sft.learnin_rate: unknown key",
        "sft.max_steps: Input should be a valid integer",
        "rm.num_members: Input should be greater than or equal to 1 (got 0)",
        "policy.dpo.loss_type: unknown DPO loss type(s) ['sigmoidd']",
        "gate.tests.1.op: Input should be '>=', '<=', '>' or '<' (got '==')",
        "prepare.builtin: min_operands (6) is larger than max_operands (5)",
        "rewards: unknown section (known: task, compute, model, prepare, base, sft, verifier, rm, prm, compress, "
        "policy, merge, evaluate, validate, gate, infer, improve)",
    ]:
        assert sum(problem.startswith(expected) for problem in error.problems) == 1, expected
    assert "(got 'many')" in message  # says what was given


def test_unknown_dpo_loss_type_lists_the_known_ones(tmp_path, repo_params):
    params = copy.deepcopy(repo_params)
    params["policy"]["dpo"]["loss_type"] = ["sigmoid", "ipo2"]
    error = params_error(write_params(tmp_path, params))
    assert len(error.problems) == 1
    assert error.problems[0].startswith("policy.dpo.loss_type: unknown DPO loss type(s) ['ipo2']")
    assert "'hinge'" in error.problems[0]


def test_policy_losses_trl_refuses_fail_with_the_params(tmp_path, repo_params):
    """GRPO's loss type failed after the first batch was sampled and scored, DPO's exo_pair
    without label smoothing when the trainer was built: both are params errors now."""
    params = copy.deepcopy(repo_params)
    params["policy"]["grpo"]["loss_type"] = "gspo"
    params["policy"]["dpo"]["loss_type"] = "exo_pair"
    error = params_error(write_params(tmp_path, params))
    assert len(error.problems) == 2, error.problems
    assert error.problems[0].startswith("policy.dpo: loss_type exo_pair needs label_smoothing > 0")
    assert error.problems[1].startswith("policy.grpo.loss_type: Input should be 'grpo', 'dr_grpo', 'dapo'")
    params["policy"]["grpo"]["loss_type"] = "dr_grpo"
    params["policy"]["dpo"]["label_smoothing"] = 1e-3
    stages.load_all(write_params(tmp_path, params))
    params["policy"]["dpo"]["loss_type"] = "sigmoid"  # TRL's sigmoid loss never reads label_smoothing
    (problem,) = params_error(write_params(tmp_path, params)).problems
    assert problem.startswith("policy.dpo: label_smoothing 0.001: not read by loss_type sigmoid")
    params["policy"]["dpo"]["loss_type"] = "robust"
    stages.load_all(write_params(tmp_path, params))
    params["policy"]["dpo"]["label_smoothing"] = 0.0
    params["policy"]["dpo"]["loss_type"] = ["sigmoid", "sft"]  # with the default sft_weight 5: NLL twice
    (problem,) = params_error(write_params(tmp_path, params)).problems
    assert problem.startswith("policy.dpo: loss_type lists sft and sft_weight is 5.0")


def test_unknown_policy_method(tmp_path, repo_params):
    params = copy.deepcopy(repo_params)
    params["policy"]["offline"] = ["dpo", "ppoo"]
    error = params_error(write_params(tmp_path, params))
    assert [p.split(":")[0] for p in error.problems] == ["policy.offline"]
    assert "unknown method(s) ['ppoo']" in error.problems[0]


def test_online_method_listed_as_offline(tmp_path, repo_params):
    """grpo reads prompts and rewards, so it belongs in policy.online (its own DVC template)."""
    params = copy.deepcopy(repo_params)
    params["policy"]["offline"] = ["dpo", "grpo"]
    error = params_error(write_params(tmp_path, params))
    assert error.problems == ["policy.offline: ['grpo'] belong in policy.online (got ['dpo', 'grpo'])"]


def test_a_key_the_kind_ignores_is_an_error(tmp_path, repo_params):
    """The likelihood PRM trains no weights: a training key under it fails, naming the key."""
    params = copy.deepcopy(repo_params)
    params["prm"]["max_steps"] = 400
    error = params_error(write_params(tmp_path, params))
    assert len(error.problems) == 1
    assert error.problems[0].startswith("prm: max_steps: not read by kind likelihood")
    assert "(got" not in error.problems[0], "a check of the whole block: its keys are not dumped after the message"
    params["prm"]["kind"] = "classifier"
    assert stages.load_all(write_params(tmp_path, params))["prm"].max_steps == 400


def test_missing_section_takes_defaults(tmp_path, repo_params):
    """Without `rm` and `evaluate` (and with an empty `sft:`), those sections equal their
    Configs' defaults; the sections still given keep their values."""
    params = copy.deepcopy(repo_params)
    del params["rm"], params["evaluate"]
    params["sft"] = None
    configs = stages.load_all(write_params(tmp_path, params))
    classes = stages.all_configs()
    for section in ("rm", "evaluate", "sft"):
        assert configs[section] == classes[section](), section
    assert configs["gate"].select_metric == repo_params["gate"]["select_metric"]


def test_empty_file_is_all_defaults(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("# nothing set\n")
    configs = stages.load_all(str(path))
    classes = stages.all_configs()
    assert all(configs[section] == classes[section]() for section in stages.SECTIONS)


def test_section_that_is_not_a_mapping(tmp_path, repo_params):
    params = copy.deepcopy(repo_params)
    params["sft"] = [1, 2]
    params["rm"]["num_members"] = 17  # reported alongside
    error = params_error(write_params(tmp_path, params))
    assert error.problems[0] == "sft: must be a mapping of keys, got list"
    assert error.problems[1].startswith("rm.num_members: Input should be less than or equal to 16")


def test_bad_yaml(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("sft:\n  max_steps: [10\n  learning_rate: 0.1\n")
    error = params_error(str(path))
    assert str(error).startswith(f"{path}: 1 problem(s):")
    assert "not valid YAML" in error.problems[0]


def test_top_level_not_a_mapping(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("- sft\n- rm\n")
    assert params_error(str(path)).problems == ["the top level must be a mapping of stage sections"]


def test_missing_params_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.yaml not found"):
        stages.load_all(str(tmp_path / "nowhere.yaml"))


def test_validation_fails_fast_from_a_cold_start(tmp_path, repo_params):
    """A typo fails the whole-file check in a fresh interpreter, imports included, in well
    under 30 s, exiting non-zero with the bad key in stderr: the message alone, no traceback
    (stages.report_input_errors)."""
    params = copy.deepcopy(repo_params)
    params["sft"]["learnin_rate"] = 0.1
    bad = write_params(tmp_path, params, "BAD.yaml")
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", f"import stages; stages.load_all({bad!r})"],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 1
    assert result.stderr.startswith(f"{bad}: 1 problem(s):\n  sft.learnin_rate: unknown key")
    assert "Traceback" not in result.stderr
    assert elapsed < 30, f"validation took {elapsed:.1f} s"


def test_a_stage_prints_an_input_error_without_a_traceback_and_other_errors_with_one(tmp_path, repo_params):
    """`python -m stages.check_params` with a bad key prints `check_params: <the message>`
    and exits 1; an error that is not the user's input (here a KeyError raised in a stage
    process) keeps its traceback."""
    params = copy.deepcopy(repo_params)
    params["sft"]["learnin_rate"] = 0.1
    write_params(tmp_path, params, "params.yaml")
    for name in ("rlhf", "stages"):
        (tmp_path / name).symlink_to(REPO / name)
    result = subprocess.run(
        [sys.executable, "-m", "stages.check_params"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert result.stderr == (
        "check_params: params.yaml: 1 problem(s):\n"
        "  sft.learnin_rate: unknown key (check the spelling; see the stage's Config for the keys it takes)\n"
    )
    code = "import stages; raise KeyError('not an input error')"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback") and "KeyError: 'not an input error'" in result.stderr


def test_an_input_error_that_names_its_stage_is_not_prefixed_twice(monkeypatch, capsys):
    """stages/sft.py's error `sft: the SFT data ...` is printed as it is, not `sft: sft:`;
    a message that does not start with the stage's name gets it."""
    from rlhf.params import InputError

    class DataError(InputError, ValueError):
        pass

    monkeypatch.setattr(sys, "argv", [str(REPO / "stages/sft.py")])
    for message in ("sft: the SFT data holds conversations", "data/raw/x.jsonl: 1 problem(s) found"):
        stages.report_input_errors(DataError, DataError(message), None)
    assert capsys.readouterr().err == (
        "sft: the SFT data holds conversations\nsft: data/raw/x.jsonl: 1 problem(s) found\n"
    )


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("prepare", "files", {"eval_../../outside": {"path": "params.yaml"}}, "prepare.files.eval_../../outside"),
        ("evaluate", "suites", ["dev", "/tmp/outside"], "evaluate.suites.1"),
        ("improve", "rounds", {"../r1": {}}, "improve.rounds.../r1"),
    ],
)
def test_a_name_that_would_write_outside_the_project_is_refused(tmp_path, repo_params, section, key, value, expected):
    """Names that become output paths (a prepared table, an eval suite's bar plot, a round's
    folder) are plain names: a params.yaml cannot point a stage's writes out of the project."""
    params = copy.deepcopy(repo_params)
    params[section][key] = value
    error = params_error(write_params(tmp_path, params))
    assert len(error.problems) == 1, error.problems
    assert error.problems[0].startswith(expected), error.problems[0]
    assert "not a plain name" in error.problems[0] and "no '..'" in error.problems[0]


def test_check_params_names_keys_dvc_reads_that_the_file_lacks(tmp_path, repo_params, monkeypatch):
    """A section left out takes its defaults in Python, but DVC refuses to run a stage whose
    params are missing (after the stages before it ran): the stage check names each key
    with what to write. `verifier: {}` (or null) and every key present pass."""
    from stages.check_params import listed_params_problems

    monkeypatch.chdir(REPO)  # dvc.yaml
    params = copy.deepcopy(repo_params)
    del params["verifier"], params["evaluate"]["kl_prompts"]
    params["policy"]["offline"] = ["dpo", "kto"]
    params["policy"].pop("kto", None)
    validated = stages.load_all(write_params(tmp_path, params))
    found = listed_params_problems(params, validated)
    assert [p.split(": missing")[0] for p in found] == ["verifier", "policy.kto", "evaluate.kl_prompts"]
    assert "stage policy@kto reads it" in found[1] and found[1].endswith("write `kto: {}` to take the defaults")
    assert found[2].endswith("write `kl_prompts: 200` (its default)")
    assert listed_params_problems(repo_params, stages.load_all(str(REPO / "params.yaml"))) == []
    params.update(
        verifier=None, policy={**params["policy"], "kto": {}}, evaluate={**params["evaluate"], "kl_prompts": 8}
    )
    assert listed_params_problems(params, stages.load_all(write_params(tmp_path, params))) == []


def test_a_key_written_twice_and_a_flag_for_a_number_are_named(tmp_path, repo_params):
    """PyYAML keeps a duplicated key's last value (DVC refuses the file); pydantic reads
    `max_steps: true` as one step. Both are errors naming the key."""
    path = tmp_path / "params.yaml"
    path.write_text("sft:\n  max_steps: 3\nrm: {}\nsft:\n  max_steps: 4\n")
    assert "key 'sft' written twice in one mapping (first on line 1)" in str(params_error(str(path)))
    params = copy.deepcopy(repo_params)
    params["sft"]["max_steps"] = True
    params["sft"]["learning_rate"] = False
    params["infer"]["mcts"]["simulations"] = True
    params["model"]["gradient_checkpointing"] = True  # a flag where a flag belongs
    problems = params_error(write_params(tmp_path, params)).problems
    assert problems == [
        "sft.max_steps: a number, not true",
        "sft.learning_rate: a number, not false",
        "infer.mcts.simulations: a number, not true",
    ]


def test_check_params_names_what_would_fail_at_the_last_stages(tmp_path, repo_params, monkeypatch):
    """Caught by stage infer or the gate after every model trained (or ignored): an infer
    candidate or member no stage writes, a draft that is not there, a registered model name
    MLflow refuses, a name MLflow refuses as a metric key, seed or max_length of a built-in
    model given to one's own, settings of a strategy not run."""
    monkeypatch.chdir(tmp_path)
    params = copy.deepcopy(repo_params)
    params["infer"]["candidate"] = "policy/kto"
    params["infer"]["strategies"] = ["greedy", "ensemble", "speculative"]
    params["infer"]["ensemble"] = {"members": ["sft", "models/policy/dpo"]}
    params["infer"]["speculative"] = {"draft": "my/draft"}
    found = params_error(write_params(tmp_path, params)).problems
    written = "(one of ['sft', 'merged', 'champion', 'policy/dpo'])"
    assert found == [
        f"infer.candidate: policy/kto is not a model a stage writes under models/ {written}; name a trained "
        "method as policy/<method>",
        f"infer.ensemble.members[1]: models/policy/dpo is not a model a stage writes under models/ {written}; name "
        "a trained method as policy/<method>",
        "infer.speculative.draft: my/draft does not exist (the draft is a model folder of yours)",
    ]
    params = copy.deepcopy(repo_params)
    params["gate"]["registered_model"] = "team/rlhf-policy"
    params["base"] = {"model": "gpt2", "seed": 3}
    params["infer"]["ensemble"] = {"members": ["sft", "merged"]}
    params["prepare"]["files"] = {"eval_a+b": {"path": "data/raw/x.jsonl"}}
    found = [p.split(" (got")[0] for p in params_error(write_params(tmp_path, params)).problems]
    assert (
        found[0] == "prepare.files.eval_a+b.[key]: 'eval_a+b' is not a plain name: names become file and folder "
        "names under the project, and MLflow metric names, so use letters, digits and _ . - only (no '/', no '..')"
    )
    assert "base: seed: not read by a model of your own (they shape a built-in model); remove it" in found
    assert (
        "gate.registered_model: 'team/rlhf-policy': a registered model name is not empty and holds no '/' or ':' "
        "(MLflow's rule) nor quotes (the rollback command searches the registry by name)" in found
    )
    assert "infer: ensemble: not read unless infer.strategies lists ensemble; remove it" in found


def test_check_params_names_a_device_this_machine_lacks(tmp_path, repo_params, monkeypatch):
    """compute.device: cuda on a machine without a GPU passed the check, and stage base
    failed with a traceback after DVC had removed models/base. (The check's main runs in
    this process: that a stage's input error prints one message and no traceback is
    test_a_stage_prints_an_input_error_without_a_traceback_and_other_errors_with_one's.)"""
    import torch

    from stages import check_params

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    params = copy.deepcopy(repo_params)
    params["compute"]["device"] = "cuda"
    write_params(tmp_path, params)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParamsError) as error:
        check_params.main()
    assert (
        "compute.device is 'cuda' but torch sees no CUDA GPU; use compute.device: auto or cpu" in error.value.problems
    )
    assert not (tmp_path / check_params.STAMP).exists()


def test_check_params_names_what_a_sharded_launch_cannot_save(tmp_path, repo_params):
    """FSDP or ZeRO-3 gather plain models only: a LoRA stage, or the likelihood reward
    model, failed at the end of its own training (after loading, sharding and DPO's
    reference pass). The check names each such key first; DDP and ZeRO-2 pass."""
    from stages.check_params import sharding_problems

    def problems(config: str, **sections) -> list[str]:
        params = copy.deepcopy(repo_params)
        params["compute"].update(launcher="accelerate", processes=2, accelerate_config=str(REPO / config))
        for section, values in sections.items():
            params[section].update(values)
        found = sharding_problems(stages.load_all(write_params(tmp_path, params)))
        if params["compute"].get("device") == "cpu":
            return found
        return [p for p in found if not p.startswith("compute.accelerate_config")]  # on a CPU: below

    fsdp = problems("configs/accelerate/fsdp.yaml", sft={"lora": {"enabled": True}})
    assert [p.split(":")[0] for p in fsdp] == ["sft.lora.enabled", "rm.kind"]
    assert fsdp[0].startswith(f"sft.lora.enabled: FSDP (compute.accelerate_config {REPO}/configs/accelerate/fsdp.yaml)")
    assert "set rm.kind: classifier" in fsdp[1]
    zero3 = problems("configs/accelerate/deepspeed_zero3.yaml", rm={"kind": "classifier"})
    assert zero3 == []
    zero3 = problems("configs/accelerate/deepspeed_zero3.yaml", rm={"kind": "classifier", "lora": {"enabled": True}})
    assert len(zero3) == 1 and zero3[0].startswith("rm.lora.enabled: DeepSpeed ZeRO-3")
    policy = copy.deepcopy(repo_params["policy"])
    policy["dpo"] = {**policy.get("dpo", {}), "lora": {"enabled": True}}
    found = problems("configs/accelerate/fsdp.yaml", rm={"kind": "classifier"}, policy=policy)
    assert [p.split(":")[0] for p in found] == ["policy.dpo.lora.enabled"]
    assert problems("configs/accelerate/ddp.yaml", sft={"lora": {"enabled": True}}) == []
    assert problems("configs/accelerate/deepspeed_zero2.yaml", sft={"lora": {"enabled": True}}) == []
    # On a CPU, accelerate turns FSDP and ZeRO-3 into plain data parallelism: refused, naming the key.
    for config, strategy in (("fsdp.yaml", "FSDP"), ("deepspeed_zero3.yaml", "DeepSpeed ZeRO-3")):
        on_cpu = problems(f"configs/accelerate/{config}", compute={"device": "cpu"}, rm={"kind": "classifier"})
        assert len(on_cpu) == 1 and on_cpu[0].startswith(f"compute.accelerate_config: {strategy} (")
        assert "use configs/accelerate/ddp.yaml here" in on_cpu[0]
    assert problems("configs/accelerate/ddp.yaml", compute={"device": "cpu"}) == []


def test_check_params_names_a_chat_template_sft_cannot_mask_when_model_and_data_are_local(tmp_path, repo_params):
    """A local base model whose template TRL cannot give generation markers (Llama 3.1's),
    with conversations in a local SFT file and sft.loss_on: completion, is named at the
    check, before any stage; text rows, loss_on: all, or base.chat_template: llama3 pass."""
    import json

    from rlhf.models.loading import build_tiny_model, build_tokenizer, save_model
    from rlhf.models.templates import trl_templates_dir
    from stages.check_params import template_problems

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (trl_templates_dir() / "llama3_1.jinja").read_text()
    save_model(build_tiny_model("micro", tokenizer, seed=0), tokenizer, tmp_path / "llama")
    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1"},
                                              {"role": "assistant", "content": "2"}]}) + "\n")  # fmt: skip
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"prompt": "1+1", "completion": "2"}) + "\n")
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")

    def problems(sft_file, **updates) -> list[str]:
        params = copy.deepcopy(repo_params)
        params["base"].update(model=str(tmp_path / "llama"), **updates.pop("base", {}))
        params["prepare"].update(
            source="files", files={"sft": {"path": str(sft_file)}, "eval_heldout": {"path": str(suite)}}
        )
        params["sft"].update(updates)
        params["policy"].update(offline=[], online=["grpo"])
        return template_problems(stages.load_all(write_params(tmp_path, params)))

    (found,) = problems(turns)
    assert found.startswith("sft.loss_on: completion trains on the assistant's messages only") and "llama3" in found
    assert problems(texts) == []
    assert problems(turns, loss_on="all") == []
    assert problems(turns, base={"chat_template": "llama3"}) == []


def test_a_ppo_batch_the_processes_cannot_share_is_named_before_any_stage(tmp_path, repo_params):
    """Each process samples an equal share of PPO's rollout batch: a batch of 3 over 2
    processes failed in every rank after the models loaded."""
    params = copy.deepcopy(repo_params)
    params["compute"].update(launcher="torchrun", processes=2)
    params["policy"]["online"] = ["ppo"]
    params["policy"]["ppo"].update(rollout_batch_size=9, mini_batch_size=3)
    assert params_error(write_params(tmp_path, params)).problems == [
        "policy.ppo.rollout_batch_size: 9 is not a multiple of compute.processes (2): each process samples an "
        "equal share of the batch"
    ]


def test_numbers_inside_lists_and_mappings_are_numbers():
    """true/false, NaN and infinity where a list or mapping holds numbers (merge weights,
    per-layer weights, the built-in task's table sizes, NoPE layers) fail naming the item:
    pydantic read [true, 1] as [1.0, 1.0] and .nan as a weight."""
    import math

    import yaml

    from rlhf.params import ParamsError, validate_params

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["merge"]["weights"] = [True, 1.0]
    data["prepare"]["builtin"]["sizes"] = {"sft": math.nan}
    data["base"]["nope_layers"] = [1, False]
    data["merge"]["normalize"] = None
    data["gate"]["confidence"] = math.inf
    with pytest.raises(ParamsError) as error:
        validate_params(data, stages.all_configs())
    problems = error.value.problems
    assert "merge.weights[0]: a number, not true" in problems
    assert any(p.startswith("prepare.builtin.sizes.sft: ") and "finite number" in p for p in problems)
    assert "base.nope_layers[1]: a number, not false" in problems
    assert "gate.confidence: a finite number, not inf" in problems
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["merge"]["weights"] = [[1, 0.5], [0, True]]
    with pytest.raises(ParamsError, match=r"merge\.weights\[1\]\[1\]: a number, not true"):
        validate_params(data, stages.all_configs())


def test_remote_code_from_the_hub_needs_a_pinned_commit_or_an_explicit_override():
    """trust_remote_code with a Hub id runs its Python code; a branch or tag (or none: the
    default branch) can change under a pipeline that reruns it."""
    from pydantic import ValidationError

    from stages.base import Config

    with pytest.raises(ValidationError, match="pin base.revision to a commit"):
        Config(model="someone/custom-model", trust_remote_code=True)
    with pytest.raises(ValidationError, match="revision 'main' can change"):
        Config(model="someone/custom-model", trust_remote_code=True, revision="main")
    assert Config(model="someone/custom-model", trust_remote_code=True, revision="a" * 40)
    assert Config(model="someone/custom-model", trust_remote_code=True, trust_unpinned_code=True)
    assert Config(model="someone/plain-model", revision="main"), "no code run: a branch is fine"
