"""dvc.yaml, params.yaml and the stage Configs stay in sync.

* every params.yaml section has a stage Config and validates;
* each dvc.yaml stage runs its own module, lists it as a dep, reads exactly its params
  section, and lists exactly the rlhf/ modules it imports (transitively), except the
  infrastructure modules that cannot change an output (environment, params validation,
  MLflow tracking);
* rlhf/ imports neither stages/ nor flows/, and stages/ does not import flows/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from stages import SECTIONS, load_all

REPO = Path(__file__).resolve().parent.parent
INFRASTRUCTURE = {"rlhf/__init__.py", "rlhf/environment.py", "rlhf/params.py", "rlhf/tracking/runs.py"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def rlhf_closure(path: Path) -> set[str]:
    """rlhf/ files imported by `path`, directly or through other rlhf modules or through
    another stage module it reuses (stage `verifier` runs stage `sft`'s trainer)."""
    return {f for f in code_closure(path) if f.startswith("rlhf/")}


def code_closure(path: Path) -> set[str]:
    """rlhf/ and stages/ module files imported by `path`, transitively (the `stages`
    package itself, which only validates params, excluded)."""
    seen: set[str] = set()
    todo = [path]
    while todo:
        for name in imported_modules(todo.pop()):
            if name.startswith(("rlhf", "stages.")) and name != "rlhf":
                file = REPO / (name.replace(".", "/") + ".py")
                rel = file.relative_to(REPO).as_posix()
                if file.exists() and rel not in seen:
                    seen.add(rel)
                    todo.append(file)
    return seen


def dvc_stages() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def test_params_yaml_sections_match_the_stage_configs_and_validate():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert set(params) == set(SECTIONS)
    load_all(str(REPO / "params.yaml"))


def test_each_stage_lists_its_module_params_and_rlhf_imports():
    module_of = {section: module.split(".")[1] for section, module in SECTIONS.items()}
    for name, stage in dvc_stages().items():
        body = stage.get("do", stage)
        if name == "check_params":
            assert set(body["deps"]) == {"stages", "params.yaml"} and "params" not in body
            continue
        assert "reports/params.ok" in body["deps"], f"stage {name} must run after check_params"
        module = re.match(r"python -m stages\.(\w+)", body["cmd"]).group(1)
        assert module_of[name] == module, f"stage {name} runs stages.{module}"
        source = f"stages/{module}.py"
        assert source in body["deps"], f"stage {name} must depend on its module {source}"
        reused = {f for f in code_closure(REPO / source) if f.startswith("stages/")}
        assert reused <= set(body["deps"]), f"stage {name} must depend on the stage modules it runs: {sorted(reused)}"
        listed = {d for d in body["deps"] if d.startswith("rlhf/")}
        needed = rlhf_closure(REPO / source) - INFRASTRUCTURE
        assert listed == needed, f"stage {name}: rlhf deps listed {sorted(listed)} but imports {sorted(needed)}"
        expected_params = {"policy.${item}"} if name == "policy" else {name}
        if name in ("evaluate", "merge"):
            expected_params.add("policy.methods")
        assert set(body["params"]) == expected_params, f"stage {name} params"


def test_layering():
    for path in (REPO / "rlhf").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in {"stages", "flows"}}
        assert not bad, f"{path.name} imports {bad}"
    for path in (REPO / "stages").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.split(".")[0] == "flows"}
        assert not bad, f"{path.name} imports {bad}"
