"""dvc.yaml, params.yaml and the stage Configs stay in sync.

* every params.yaml section has a Config and validates;
* each dvc.yaml stage runs its own module, lists it as a dep, lists exactly the params
  sections its module reads (and of `policy`, in stages other than the policy ones, only
  the method lists), and lists exactly the rlhf/ modules it imports (transitively), except
  the infrastructure modules that cannot change an output (environment, params validation,
  MLflow tracking, docstring-only package files);
* offline policy methods depend on no reward model;
* rlhf/ imports neither stages/ nor flows/, stages/ does not import flows/, and rlhf/ has no
  import cycle.

The files a stage reads at run time are checked against its deps by the end-to-end test
(tests/test_pipeline_e2e.py), which traces every file each stage opens.
"""

from __future__ import annotations

import ast
import re
from functools import partial
from pathlib import Path

import yaml

from rlhf.cli import dvc_deps
from rlhf.cli.dvc_deps import LAUNCHER, imported_modules, parsed
from stages import SECTIONS, load_all

REPO = Path(__file__).resolve().parent.parent
code_closure = partial(dvc_deps.code_closure, REPO)
module_files = partial(dvc_deps.module_files, REPO)
rlhf_closure = partial(dvc_deps.rlhf_closure, REPO)
MODULE_OF = {section: target.split(":")[0] for section, target in SECTIONS.items()}
# Each stage runs the module of its name (test_stages_holds_exactly_the_dvc_stages...).
STAGE_MODULE = {name: f"stages.{name}" for name in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]}


# Helpers of the `stages` package and the sections they read.
HELPER_SECTIONS = {
    "load_model_stage": ("compute", "model"),
    "eval_suites": ("prepare",),
    "decision_suite": ("prepare",),
    "report_suite": ("prepare",),
}


def sections_read(path: Path, own_section: str) -> set[str]:
    """params.yaml sections a stage module reads: `load_config("x")` and `params["x"]`;
    `load_config(variable)` reads the stage's own section (stage verifier runs stage sft's
    trainer with its own section); the `stages` helpers read theirs (HELPER_SECTIONS)."""
    sections = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in HELPER_SECTIONS:
            sections.update(HELPER_SECTIONS[node.func.id])
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_config" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant):
                sections.add(arg.value)
            else:
                sections.add(own_section)
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "params":
            sections.add(node.slice.value if isinstance(node.slice, ast.Constant) else own_section)
    return sections


def dvc_stages() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def test_params_yaml_sections_match_the_configs_and_validate():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert set(params) == set(SECTIONS)
    load_all(str(REPO / "params.yaml"))


def test_each_stage_lists_its_module_params_and_rlhf_imports():
    assert set(dvc_stages()) == set(STAGE_MODULE)
    for name, stage in dvc_stages().items():
        body = stage.get("do", stage)
        if name == "check_params":
            files = {"data/raw", "rlhf/data/contracts.py", "rlhf/data/readers.py", "rlhf/evaluation/suites.py"}
            # (the difficulties of file suites)
            files |= {"rlhf/models/compute.py"}  # the device check
            files |= {"rlhf/models/settings.py", "rlhf/training/trl_fields.json"}  # packages; TRL's options
            assert set(body["deps"]) == {"stages", "rlhf/tasks", "params.yaml", *files} and "params" not in body
            continue
        assert "reports/params.ok" in body["deps"], f"stage {name} must run after check_params"
        launched, module = re.match(r"python -m (rlhf\.cli\.launch )?(stages\.\w+)", body["cmd"]).groups()
        assert STAGE_MODULE[name] == module, f"stage {name} runs {module}"
        if launched:  # the launcher reads params `compute` and is the stage's code too
            assert LAUNCHER in body["deps"] and "compute" in body.get("params", []), name
            assert "configs/accelerate" in body["deps"], f"stage {name}: its accelerate config decides how it runs"
        source = REPO / (module.replace(".", "/") + ".py")
        assert source.relative_to(REPO).as_posix() in body["deps"], f"stage {name} must depend on {source.name}"
        reused = {f for f in code_closure(source) if f.startswith("stages/") and f != "stages/__init__.py"}
        assert reused <= set(body["deps"]), f"stage {name} must depend on the stage modules it runs: {sorted(reused)}"
        listed = set().union(*(module_files(d) for d in body["deps"] if d.startswith("rlhf/")))
        needed = rlhf_closure(source) | (rlhf_closure(REPO / LAUNCHER) | {LAUNCHER} if launched else set())
        assert listed == needed, f"stage {name}: rlhf deps listed {sorted(listed)} but imports {sorted(needed)}"

        params = body.get("params", [])
        files = {source.relative_to(REPO).as_posix(), *reused}
        read = set().union(*(sections_read(REPO / f, name) for f in files))
        assert {p.split(".")[0] for p in params} == read, f"stage {name}: params {params} but reads {sorted(read)}"
        if name not in ("policy", "rl"):
            policy_keys = {p for p in params if p.startswith("policy")}
            assert policy_keys in (set(), {"policy.offline", "policy.online"}), f"stage {name}: {policy_keys}"
        if name != "prepare":  # the suites' roles: which files prepare reads, not how
            prepare_keys = {p for p in params if p.startswith("prepare")}
            # ... and the rounds generate built-in problems as large as prepare's.
            allowed = {"prepare.source", "prepare.files"} | (
                {"prepare.builtin.max_value"} if name == "improve" else set()
            )
            assert prepare_keys in (set(), allowed), f"stage {name}: {prepare_keys}"


def test_every_listed_param_is_in_params_yaml():
    """DVC fails a stage whose listed param key is missing from params.yaml, whatever the
    Config's default: every key a stage lists must be written out."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for name, stage in dvc_stages().items():
        body = stage.get("do", stage)
        items = [None]
        if name == "improve":  # one stage per entry of improve.rounds (a dict: `${key}`)
            items = list(params["improve"]["rounds"]) or ["<no round>"]
        elif "foreach" in stage:
            items = params["policy"]["offline" if name == "policy" else "online"] or [
                "dpo" if name == "policy" else "grpo"
            ]
        for item in items:
            for key in body.get("params", []):
                if item == "<no round>" and "${key}" in key:
                    continue
                value = params
                for part in key.replace("${item}", str(item)).replace("${key}", str(item)).split("."):
                    assert isinstance(value, dict) and part in value, f"stage {name}: params.yaml has no {key}"
                    value = value[part]


def test_policy_templates_read_their_own_method_list():
    """policy@<m> iterates policy.offline and rl@<m> policy.online, each with the method's
    own section and the shared trust flag but not the list itself (adding a method does not
    retrain the others); the offline template depends on no reward model, so retraining the
    RM or PRM leaves an offline method up to date."""
    stages = dvc_stages()
    assert stages["policy"]["foreach"] == "${policy.offline}"
    assert stages["rl"]["foreach"] == "${policy.online}"
    for name in ("policy", "rl"):
        expected = {"policy.trust_remote_code", "policy.${item}", "task", "compute", "model"}
        assert set(stages[name]["do"]["params"]) == expected
    offline_deps = set(stages["policy"]["do"]["deps"])
    assert not offline_deps & {"models/rm", "models/prm", "models/verifier", "data/prepared/prompts.parquet"}


def test_layering_and_no_import_cycles():
    """rlhf/ below stages/ below flows/: rlhf/ (its `rlhf` command, rlhf/cli/, included)
    never imports stages/ or flows/, and nothing else in rlhf/ imports rlhf/cli/."""
    cli = REPO / "rlhf/cli"
    for path in (REPO / "rlhf").rglob("*.py"):
        below = {"stages", "flows"}
        bad = {m for m in imported_modules(path) if m.split(".")[0] in below}
        if cli not in path.parents:
            bad |= {m for m in imported_modules(path) if m.startswith("rlhf.cli")}
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"
    for path in (REPO / "stages").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.split(".")[0] == "flows"}
        assert not bad, f"{path.name} imports {bad}"
    for path in [*(REPO / "rlhf").rglob("*.py"), *(REPO / "stages").glob("*.py"), *(REPO / "flows").glob("*.py")]:
        rel = path.relative_to(REPO).as_posix()
        # Packages followed too (`from stages import X` runs stages/__init__.py), lazy imports included.
        assert rel not in dvc_deps.code_closure(REPO, path, packages=True), f"{rel} imports itself through a cycle"


# The library's floors, lowest first: a module imports its own package and the floors below
# it, never a floor above nor a neighbour on its own floor (stages/ and flows/ stand above
# them all: test_layering_and_no_import_cycles).
FLOORS = (
    {"environment", "layout", "params", "atomic", "recipes", "params_docs", "lockfile"},
    {"__init__", "tasks", "models"},
    {"data"},
    {"rewards", "tracking", "feedback"},
    {"evaluation", "inference"},
    {"training", "rules"},
    {"cli"},
)


def test_no_import_runs_up_the_floors():
    """rlhf/'s packages stand on floors (FLOORS): tasks and models on the ground's params and
    files; the data (which the built-in tasks generate); rewards, tracking and feedback;
    evaluation and inference; then training and the rules; the `rlhf` command on top. An
    import up a floor (or sideways) is named."""
    floor = {name: level for level, names in enumerate(FLOORS) for name in names}
    listed = {p.relative_to(REPO / "rlhf").parts[0].removesuffix(".py") for p in (REPO / "rlhf").glob("*")}
    assert listed - {"__pycache__"} <= set(floor), f"give each of rlhf/'s packages a floor: {listed - set(floor)}"
    upward = []
    for path in (REPO / "rlhf").rglob("*.py"):
        own = path.relative_to(REPO / "rlhf").parts[0].removesuffix(".py")
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] != "rlhf":
                continue
            target = parts[1] if len(parts) > 1 else "__init__"
            if target != own and floor.get(target, -1) >= floor[own]:
                upward.append(f"{path.relative_to(REPO)} imports {module}")
    assert not upward, upward


def test_stage_and_flow_modules_stay_thin_and_every_method_trains_one_way():
    """A stage or flow module reads top to bottom (at most 500 lines: its Config, run() and
    main(), the work in the library), and every method module, SFT included, has the one
    entry its stages call: `train(job, params, out_dir)`."""
    import inspect

    from rlhf.training.methods import METHODS

    long = {p.relative_to(REPO).as_posix(): n for p in [*(REPO / "stages").glob("*.py"), *(REPO / "flows").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > 500}  # fmt: skip
    assert not long, long
    for name, module in METHODS.items():
        assert list(inspect.signature(module.train).parameters) == ["job", "params", "out_dir"], name
    assert "sft" in METHODS


def test_stages_holds_exactly_the_dvc_stages_named_as_dvc_names_them():
    """`ls stages/` is `dvc stage list` (each foreach template once): one vocabulary for the
    stage, its module and (where it has one) its params section."""
    modules = {p.stem for p in (REPO / "stages").glob("*.py")} - {"__init__"}
    assert modules == set(dvc_stages())
    library = {"task", "compute", "model"}  # sections of the library's own Configs, read by every stage
    assert {section: module for section, module in MODULE_OF.items() if section not in library} == {
        section: f"stages.{section}" for section in set(SECTIONS) - library
    }, "a stage's params section is defined by the stage module of its name"


def test_the_suites_longest_modules_exist():
    """The order hint scripts/test.sh's workers take modules in (tests/conftest.py) names
    modules that exist: a renamed one would drop to the end and finish last."""
    from tests.conftest import LONGEST_MODULES

    missing = [name for name in LONGEST_MODULES if not (REPO / "tests" / f"{name}.py").is_file()]
    assert not missing


def test_dvc_yaml_lists_what_rlhf_dvc_deps_writes_and_the_command_repairs_a_stage():
    """The committed dvc.yaml is what `rlhf dvc-deps` writes; with a dep removed from one
    stage and a module it does not import added to another, it puts back the one, drops the
    other, says which, and leaves every other line as it was."""
    text = (REPO / "dvc.yaml").read_text()
    assert dvc_deps.rewritten(REPO, text) == (text, {})
    sft = yaml.safe_load(text)["stages"]["sft"]["deps"]
    removed = next(d for d in sft if d.startswith("rlhf/training/"))
    lines = text.split("\n")
    start = lines.index("  sft:")
    gone = next(i for i in range(start, len(lines)) if lines[i].strip() == f"- {removed}")
    del lines[gone]
    infer = lines.index("  infer:")
    stage_line = next(i for i in range(infer, len(lines)) if lines[i].strip() == "- stages/infer.py")
    lines.insert(stage_line + 1, "      - rlhf/training/ppo.py")
    broken = "\n".join(lines)
    repaired, changes = dvc_deps.rewritten(REPO, broken)
    assert changes == {"sft": ([removed], []), "infer": ([], ["rlhf/training/ppo.py"])}

    def sorted_deps(dvc: str) -> dict:  # where a put-back dep goes in its list does not matter
        stages = yaml.safe_load(dvc)["stages"]
        for stage in stages.values():
            body = stage.get("do", stage)
            body["deps"] = sorted(body["deps"])
        return stages

    assert sorted_deps(repaired) == sorted_deps(text)
    assert dvc_deps.rewritten(REPO, repaired)[1] == {}


def test_each_stage_lists_what_it_reads_before_its_code():
    """A reader finds a stage's edges (data, models, configs) at the top of its deps, the
    generated code deps after them; `rlhf dvc-deps` puts a data dep listed among the code
    back above it, and reports the stage."""
    text = (REPO / "dvc.yaml").read_text()
    for name, stage in dvc_stages().items():
        deps = stage.get("do", stage)["deps"]
        code = [dvc_deps.is_code(dep) for dep in deps]
        if name != "check_params":  # it validates with every stage's Config: its deps are code
            assert code == sorted(code), f"{name}: {deps}"
    lines = text.split("\n")
    start = lines.index("  sft:")
    data = next(i for i in range(start, len(lines)) if lines[i].strip() == "- data/prepared/sft.parquet")
    moved = lines[data]
    del lines[data]
    last_code = next(i for i in range(data, len(lines)) if lines[i].strip() == "params:") - 1
    lines.insert(last_code + 1, moved)
    repaired, changes = dvc_deps.rewritten(REPO, "\n".join(lines))
    assert changes == {"sft": ([], [])}
    assert repaired == text
