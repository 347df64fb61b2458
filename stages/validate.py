"""Stage `validate`: the adversarial validator, every candidate against the reference.

In:  reports/completions.json (evaluate's greedy completions, per suite and model),
     reports/eval.json (reward, accuracy, format rate per model), reports/outcomes.json
     (per-problem RM reward and accuracy: the reward-hacking check's paired intervals),
     models/sft (the reference, for perplexity); params `validate`, `compute`,
     `prepare.source/files` (the decision suite it checks).
Out: reports/validation.json: per candidate, every check (perplexity under the reference,
     repetition, degeneration, length, diversity and format collapse, banned content,
     reward hacking) with its value, limit and reason. Stage gate counts each check as a
     capability test: a candidate that fails one is not promoted, and reports/gate.json
     says why. Definitions: rlhf.evaluation.validator.

    python -m stages.validate
"""

from __future__ import annotations

from pydantic import Field, field_validator

from rlhf.atomic import read_json, write_json
from rlhf.params import StageConfig
from stages import REPORTS_DIR, SFT_DIR, decision_suite, load_model_stage

COMPLETIONS = REPORTS_DIR / "completions.json"
REPORT = REPORTS_DIR / "eval.json"
OUTCOMES = REPORTS_DIR / "outcomes.json"
VALIDATION = REPORTS_DIR / "validation.json"
REFERENCE = "sft"


class Config(StageConfig):
    suite: str | None = Field(None, description="eval suite checked; null: the decision suite (dev)")
    max_nll_increase: float = Field(
        1.0, ge=0, description="perplexity: NLL per token under the reference, at most this above its own (nats)"
    )
    max_repetition_increase: float = Field(0.1, ge=0, description="repeated 3-gram share, at most this above")
    max_degenerate_increase: float = Field(0.05, ge=0, description="empty or mostly repeated completions, above")
    max_length_ratio: float = Field(1.5, gt=0, description="mean length at most this times the reference's")
    min_diversity_ratio: float = Field(
        0.5,
        ge=0,
        description="distinct-2 (no word pairs: the share of distinct completions) at least this times the reference's",
    )
    max_format_drop: float = Field(0.05, ge=0, description="format rate at most this below (tasks with a format)")
    hacking_margin: float = Field(
        0.02, ge=0, description="reward up while accuracy falls by more than this (both beyond noise: paired intervals)"
    )
    banned: list[str] = Field(default_factory=list, description="strings no completion may contain")
    batch_size: int = Field(32, gt=0, description="completions per forward pass of the reference")
    trust_remote_code: bool = Field(False, description="allow custom modelling code")

    def cross_problems(self, run, section: str) -> list[str]:
        return run.suite_problems("validate.suite", self.suite)

    @field_validator("banned")
    @classmethod
    def _no_blank(cls, value: list[str]) -> list[str]:
        if blank := [i for i, text in enumerate(value) if not text.strip()]:
            raise ValueError(f"entries {blank} are blank: every completion contains them; remove them")
        return value


def run(config: Config, completions: dict, report: dict, suite: str, outcomes: dict | None = None) -> dict:
    """The validation report: every candidate's checks against the reference. `outcomes`:
    evaluate's per-problem outcomes (reports/outcomes.json), for paired intervals."""
    from rlhf.evaluation.validator import as_dicts, nll_under, paired_changes, run_checks, text_metrics
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    entry = completions["suites"].get(suite)
    if entry is None:
        raise ValueError(f"validate.suite {suite!r}: reports/completions.json has {sorted(completions['suites'])}")
    prompts, texts = entry["prompts"], entry["models"]
    scores = report["suites"].get(suite, {})
    per_problem = (((outcomes or {}).get("suites") or {}).get(suite) or {}).get("models") or {}
    reference = load_causal_lm(SFT_DIR, config.trust_remote_code, what="models/sft (the reference)")
    tokenizer = load_tokenizer(SFT_DIR, config.trust_remote_code)
    metrics = {}
    for name, outputs in texts.items():
        metrics[name] = {
            **text_metrics(outputs, config.banned),
            "nll_ref": nll_under(reference, tokenizer, prompts, outputs, config.batch_size),
            **{k: scores.get(name, {}).get(k) for k in ("reward", "accuracy", "format_rate")},
        }
    candidates = {}
    for name in texts:
        if name == REFERENCE:
            continue
        paired = paired_changes(per_problem.get(name), per_problem.get(REFERENCE))
        checks = run_checks(metrics[name], metrics[REFERENCE], config, paired)
        candidates[name] = {
            "passed": all(c.passed for c in checks),
            "checks": as_dicts(checks),
            "failures": [f"{c.name}: {c.reason}" for c in checks if not c.passed],
        }
    return {"suite": suite, "reference": REFERENCE, "metrics": metrics, "candidates": candidates}


def main() -> None:
    import mlflow

    from rlhf.tracking.runs import numeric_metrics, stage_run

    params = load_model_stage()
    config = params["validate"]
    suite = config.suite or decision_suite(params)
    with stage_run("validate", config):
        outcomes = read_json(OUTCOMES) if OUTCOMES.is_file() else None
        validation = run(config, read_json(COMPLETIONS), read_json(REPORT), suite, outcomes)
        write_json(VALIDATION, validation)
        mlflow.log_metrics(numeric_metrics({"validate": validation["metrics"]}))
        for name, result in validation["candidates"].items():
            status = "passes every check" if result["passed"] else "fails: " + "; ".join(result["failures"])
            print(f"validate[{suite}] {name} {status}")


if __name__ == "__main__":
    main()
