"""Stages side by side: the flow with `--jobs 2` against `--jobs 1`, on the same stages.

Both runs force the same stages (by default every stage downstream of `sft`, whose
independent lanes are what `--jobs` can overlap; `sft` itself has nothing to run beside it)
in this project, one after the other, and print the ratio of their wall times, with each
run's peak memory: the sum of the proportional set sizes (PSS: a page shared by k processes
counts 1/k in each) of the flow and every process under it, sampled every 0.2 s.
`/usr/bin/time` reports the largest single process, which undercounts two stages at once.

    python benchmarks/flow_jobs.py [--stages policy@dpo rm ...] [--order 2,1]
    python benchmarks/flow_jobs.py --only -- bash scripts/pipeline.sh   # wall and peak of any command

Run it after the pipeline has run once (`bash scripts/pipeline.sh`); it reruns stages in
place, so the project ends as it began, up to date.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def measure(command: list[str], cwd: Path = ROOT, log: Path | None = None, period: float = 0.2):
    """Run `command` (its output to `log` when given); return (wall seconds, peak summed
    PSS in bytes of it and its descendants, its exit code)."""
    start = time.perf_counter()
    out = open(log, "w") if log else None  # noqa: SIM115 (closed below)
    process = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT if out else None)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        root = psutil.Process(process.pid)
        while not done.is_set():
            total = 0
            try:
                members = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for member in members:
                try:
                    total += member.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peak = max(peak, total)
            done.wait(period)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = process.wait()
    done.set()
    sampler.join()
    if out:
        out.close()
    return time.perf_counter() - start, peak, code


def downstream_of(stage: str) -> list[str]:
    from flows.pipeline import stage_graph

    order, upstream = stage_graph(ROOT)
    below: set[str] = set()
    for address in order:  # dependencies first
        if any(u == stage or u in below for u in upstream[address]):
            below.add(address)
    return [a for a in order if a in below]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="*", default=None, help="stages to force (default: all after sft)")
    parser.add_argument("--order", default="1,2", help="the --jobs values, in the order they run")
    parser.add_argument("--only", action="store_true", help="measure the command after -- instead")
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.only:
        if not command:
            raise SystemExit("--only: name the command after --, e.g. --only -- bash scripts/pipeline.sh")
        wall, peak, code = measure(command)
        print(f"{' '.join(command)}: {wall:.1f} s, peak memory (PSS) {peak / 2**30:.2f} GiB (exit {code})")
        raise SystemExit(code)
    sys.path.insert(0, str(ROOT))
    stages = args.stages or downstream_of("sft")
    print(f"forcing {len(stages)} stages: {' '.join(stages)}")
    logs = Path(tempfile.mkdtemp(prefix="flow_jobs-"))
    results = {}
    for jobs in (int(j) for j in args.order.split(",")):
        command = [sys.executable, "-m", "flows.pipeline", "--jobs", str(jobs), "--force", *stages]
        wall, peak, code = measure(command, log=logs / f"jobs{jobs}.log")
        if code != 0:
            raise SystemExit(f"the flow with --jobs {jobs} failed (exit {code}): {logs / f'jobs{jobs}.log'}")
        results[jobs] = wall
        print(f"--jobs {jobs}: {wall:.1f} s, peak memory (PSS) {peak / 2**30:.2f} GiB", flush=True)
    if {1, 2} <= set(results):
        print(f"ratio (--jobs 2 / --jobs 1): {results[2] / results[1]:.2f}  (flow logs: {logs})")


if __name__ == "__main__":
    main()
