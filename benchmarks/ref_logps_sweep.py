"""A 3-value beta sweep of DPO with the reference log-prob cache against without it.

Without the cache, every DPO step runs the frozen reference model over its batch, in every
run of the sweep. With it (`policy.dpo.precompute_ref_log_probs: true`, the default),
the first run computes the reference log-probs of the whole preference set once and
stores them by content (rlhf/training/ref_logprobs.py); the other runs load them. Each run is a
fresh `python -m stages.policy dpo` process (imports included) in a scratch copy of the
project; the cache starts empty. Prints both totals and the speed-up (uncached / cached).

    python benchmarks/ref_logps_sweep.py [--betas 0.05 0.1 0.3]

Needs models/sft and data/prepared (runs `dvc repro sft` first if missing).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from timing import ensure_outputs, scratch_project, timed, write_params

INPUTS = ("models/sft", "data/prepared")


def set_dpo(beta: float, precompute: bool):
    def update(params: dict) -> None:
        params["policy"]["offline"], params["policy"]["online"] = ["dpo"], []
        params["policy"]["dpo"].update(beta=beta, precompute_ref_log_probs=precompute)

    return update


def sweep(work: Path, betas: list[float], precompute: bool, cache: Path) -> list[float]:
    times = []
    for beta in betas:
        write_params(work, set_dpo(beta, precompute))
        env = {"RLHF_REF_LOGPS_CACHE": str(cache)}
        times.append(timed(["python", "-m", "stages.policy", "dpo"], work, env))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.05, 0.1, 0.3])
    args = parser.parse_args()
    ensure_outputs("sft", needed=INPUTS)
    with tempfile.TemporaryDirectory() as tmp:
        work = scratch_project(Path(tmp), INPUTS)
        uncached = sweep(work, args.betas, precompute=False, cache=Path(tmp) / "unused")
        cached = sweep(work, args.betas, precompute=True, cache=Path(tmp) / "ref_logps")
    print(f"without cache: {sum(uncached):.1f} s  {[round(t, 1) for t in uncached]}")
    print(f"with cache:    {sum(cached):.1f} s  {[round(t, 1) for t in cached]} (first run fills it)")
    print(f"speed-up of the sweep: {sum(uncached) / sum(cached):.2f}x")


if __name__ == "__main__":
    main()
