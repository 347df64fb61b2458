"""params.yaml: loading and whole-file validation.

Every stage's section is a pydantic model (its `Config`, defined in the stage module).
`validate_params` checks the whole file against all of them at once and raises one
`ParamsError` that names every bad key (``sft.learning_rate``), what is wrong and what was
given, so a typo fails in a second instead of after an hour of training. Unknown keys are
errors: every section forbids extras. Then `cross_section_problems` collects the rules that
span sections from the Configs that ask for them (rlhf/rules.py).
"""

from __future__ import annotations

import math
import re
from collections import abc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

PARAMS_FILE = "params.yaml"


class InputError:
    """Marks an error in what the user gave (params, a data file, a model path) whose message
    alone says what to fix: a stage process prints that message, not a traceback
    (stages.report_input_errors). Mixed into the exception's own class, e.g.
    `class ParamsError(InputError, ValueError)`."""


@contextmanager
def input_errors_exit(prefix: str = "") -> Iterator[None]:
    """For a command: an `InputError` raised inside leaves as SystemExit with its message
    alone (after `prefix`), which says what to fix; any other error keeps its traceback."""
    try:
        yield
    except Exception as error:  # InputError is a mixin, not an exception class of its own
        if not isinstance(error, InputError):
            raise
        raise SystemExit(f"{prefix}{error}") from None


class ParamsError(InputError, ValueError):
    """params.yaml does not validate. The message lists every problem with its key."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.problems = problems
        super().__init__(f"{path}: {len(problems)} problem(s):\n" + "\n".join(f"  {p}" for p in problems))


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"{name!r} is not a plain name: names become file and folder names under the project, "
            "and MLflow metric names, so use letters, digits and _ . - only (no '/', no '..')"
        )
    return name


# A params value that becomes part of an output path (an eval suite, a prepared table, a
# round): a plain name, so no params.yaml can make a stage write outside the project.
SafeName = Annotated[str, AfterValidator(_check_name)]


class StageConfig(BaseModel):
    """Base of every stage Config and nested params block: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


def reject_unused(config: BaseModel, unused, why: str) -> None:
    """Raise when params set any key of `unused` that the config will not read (`why`
    says when): a key the chosen kind ignores is an error, not a silent no-op."""
    given = sorted(set(unused) & config.model_fields_set)
    if given:
        raise ValueError(f"{', '.join(given)}: not read {why}; remove {'it' if len(given) == 1 else 'them'}")


def reject_changed(config: BaseModel, unused, why: str) -> None:
    """`reject_unused` for keys that params.yaml writes out at their defaults: only a value
    other than the default is an error (one the user meant, that would be ignored)."""
    fields = type(config).model_fields
    changed = [key for key in unused if getattr(config, key) != fields[key].get_default(call_default_factory=True)]
    reject_unused(config, changed, why)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key written twice in one mapping: PyYAML keeps the last
    value and DVC refuses the file, so the check would pass what the run then stops on."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} written twice in one mapping (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_params(path: str | Path = PARAMS_FILE) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; run from the project root (where dvc.yaml is)")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        raise ParamsError(path, [f"not valid YAML: {error}"]) from error
    if not isinstance(data, dict):
        raise ParamsError(path, ["the top level must be a mapping of stage sections"])
    return data


def format_validation_error(section: str, error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        key = ".".join([section, *(str(part) for part in item["loc"])])
        if item["type"] == "extra_forbidden":
            problems.append(f"{key}: unknown key (check the spelling; see the stage's Config for the keys it takes)")
        elif item["type"] == "missing":
            problems.append(f"{key}: required key is missing")
        else:
            problems.append(f"{key}: {item['msg'].removeprefix('Value error, ')}{shown_input(item.get('input'))}")
    return problems


def shown_input(value) -> str:
    """` (got <value>)` for a value a check refused, up to 80 characters (cut with "…"); a
    mapping (a check of a whole block, whose message names what is wrong) not at all."""
    if isinstance(value, dict):
        return ""
    text = repr(value)
    return f" (got {text if len(text) <= 80 else text[:79] + '…'})"


def _kinds(annotation) -> set:
    return set(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else {annotation}


def _unwrapped(annotation):
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _expects_number(kinds: set) -> bool:
    return bool(kinds & {int, float}) and bool not in kinds


def number_problems(value, annotation, key: str) -> dict[str, object]:
    """The dotted keys (list items as `key[i]`, mapping values as `key.name`) where a field
    that takes numbers, anywhere in `value` (a params block, a list, a mapping), is given
    true/false, NaN or infinity, with that value: pydantic reads `max_steps: true` as 1
    step, `weights: [true, 1]` as [1.0, 1.0] and `.nan` as a threshold no value passes,
    without a word."""
    annotation = _unwrapped(annotation)
    kinds = {_unwrapped(k) for k in _kinds(annotation)}
    if isinstance(value, bool):
        return {key: value} if _expects_number(kinds) else {}
    if isinstance(value, float) and not math.isfinite(value):
        return {key: value} if kinds & {float} else {}
    found: dict[str, object] = {}
    for kind in kinds:
        origin, args = get_origin(kind), get_args(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel) and isinstance(value, Mapping):
            for name, item in value.items():
                field = kind.model_fields.get(name) if isinstance(name, str) else None
                if field is not None:
                    found |= number_problems(item, field.annotation, f"{key}.{name}")
        elif origin in (list, tuple, set, frozenset, abc.Sequence) and isinstance(value, list):
            for i, item in enumerate(value):
                if origin is tuple and args and args[-1] is not Ellipsis:
                    element = args[i] if i < len(args) else None
                else:
                    element = args[0] if args else None
                if element is not None:
                    found |= number_problems(item, element, f"{key}[{i}]")
        elif origin in (dict, abc.Mapping) and isinstance(value, Mapping) and len(args) == 2:
            for name, item in value.items():
                found |= number_problems(item, args[1], f"{key}.{name}")
    return found


def number_message(key: str, value) -> str:
    if isinstance(value, bool):
        return f"{key}: a number, not {str(value).lower()}"
    return f"{key}: a finite number, not {value}"


def validate_params(
    data: Mapping[str, Any], configs: Mapping[str, type[BaseModel]], path: str | Path = PARAMS_FILE
) -> dict[str, BaseModel]:
    """Validate every section of `data` against `configs` (section name -> Config).

    Sections missing from the file take their Config's defaults; sections with no Config
    are unknown keys."""
    problems: list[str] = []
    validated: dict[str, BaseModel] = {}
    for section in data:
        if section not in configs:
            problems.append(f"{section}: unknown section (known: {', '.join(configs)})")
    for section, config in configs.items():
        raw = data.get(section) or {}
        if not isinstance(raw, Mapping):
            problems.append(f"{section}: must be a mapping of keys, got {type(raw).__name__}")
            continue
        flags = number_problems(raw, config, section)
        problems.extend(number_message(key, value) for key, value in flags.items())
        try:
            validated[section] = config.model_validate(dict(raw))
        except ValidationError as error:  # a flagged key's own complaint is said once, above
            said = {key.split("[")[0] for key in flags} | set(flags)
            problems.extend(p for p in format_validation_error(section, error) if p.split(":")[0] not in said)
    if problems:
        raise ParamsError(path, problems)
    return validated


def cross_section_problems(params: Mapping[str, BaseModel], run) -> list[str]:
    """The rules that span sections, each checked by the section that asks for it: every
    Config's `cross_problems(run, section)` (run: an `rlhf.rules.Run` of these params),
    collected in section order; a message several sections give (a default every round
    inherits) once."""
    problems: list[str] = []
    for section, config in params.items():
        check = getattr(config, "cross_problems", None)
        if check is not None:
            problems += check(run, section)
    return list(dict.fromkeys(problems))


def load_section(section: str, config: type[BaseModel], path: str | Path = PARAMS_FILE, keys_of_config: bool = False):
    """One section of params.yaml validated with `config` alone, for a command that needs
    only it (the launcher's `compute`, the registry's name for rollback); the stages
    validate the whole file. `keys_of_config`: read only the section's keys that `config`
    defines (a slice of a stage's section), the others are the stage's to check."""
    raw = read_params(path).get(section) or {}
    if keys_of_config and isinstance(raw, Mapping):
        raw = {key: value for key, value in raw.items() if key in config.model_fields}
    return validate_params({section: raw}, {section: config}, path)[section]
