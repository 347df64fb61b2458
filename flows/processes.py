"""The flow's processes (flows/pipeline.py): how many stages run at once and each one's
share of the cores (`default_jobs`, `Slots`), the stage processes it has running, each in
its own process group, so that SIGTERM or SIGINT to the flow reaches every one and the flow
waits for them (`Stages`, `stop_on_signals`), and the lock that holds a workspace for one
flow run (`workspace_lock`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


SIDE_BY_SIDE_MEMORY = 4 * 2**30  # available memory below which the default is one stage at a time


def default_jobs(root: Path) -> int:
    """2 on a machine of at least 2 cores, no GPU and 4 GiB of memory available, else 1:
    stages would share the GPU, a stage of several processes (compute.processes) already
    takes the cores, and two training stages hold about twice the memory of one (the
    default pipeline's: 2.56 GiB of resident sets in all against 1.57, benchmarks/README.md)."""
    import psutil
    import yaml

    params = yaml.safe_load((root / "params.yaml").read_text()) if (root / "params.yaml").is_file() else None
    compute = (params or {}).get("compute") or {}
    if machine_cores() < 2 or int(compute.get("processes") or 1) > 1:
        return 1
    if psutil.virtual_memory().available < SIDE_BY_SIDE_MEMORY:
        return 1
    # Asked in a child process: torch in the flow's own process would hold its memory
    # for the whole run.
    probe = "import torch; print(torch.cuda.is_available() or torch.backends.mps.is_available())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    return 1 if done.stdout.strip() != "False" else 2


class Slots:
    """At most `jobs` stages at once, and each its share of the cores. A stage's share is
    fixed when it starts (a process cannot change its thread pool after): the cores divided
    by the number of stages that run or could run then (at most `jobs`). A stage is ready
    when every stage it depends on has completed."""

    def __init__(self, jobs: int, upstream: dict[str, list[str]], cores: int):
        self.jobs, self.upstream, self.cores = max(1, jobs), upstream, cores
        self.running: set[str] = set()
        self.done: set[str] = set()
        self.ended: set[str] = set()
        self.condition = threading.Condition()

    def ready(self) -> set[str]:
        return {
            address
            for address, needs in self.upstream.items()
            if address not in self.ended and address not in self.running and set(needs) <= self.done
        }

    @contextmanager
    def take(self, address: str):
        """Wait for a free slot; yield this stage's thread count (None: it runs alone, and
        torch's default of all cores stands)."""
        with self.condition:
            self.condition.wait_for(lambda: len(self.running) < self.jobs)
            self.running.add(address)
            sharing = min(self.jobs, len(self.running | self.ready()))
        completed = False
        try:
            yield None if sharing == 1 else max(1, self.cores // sharing)
            completed = True
        finally:
            with self.condition:
                self.running.discard(address)
                self.ended.add(address)
                if completed:
                    self.done.add(address)
                self.condition.notify_all()


class Stages:
    """The stage processes this flow has running (each `dvc repro` in its own process group,
    with the stage it starts), so that a signal to the flow reaches every one of them."""

    def __init__(self):
        self.running: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.stopping: str | None = None  # the signal's name, once the flow is told to stop

    def start(self, command: list[str], **kwargs) -> subprocess.Popen:
        with self.lock:
            if self.stopping:
                raise RuntimeError(f"not started: the flow is stopping ({self.stopping})")
            process = subprocess.Popen(command, start_new_session=True, **kwargs)
            self.running[process.pid] = process
        return process

    def done(self, process: subprocess.Popen) -> None:
        with self.lock:
            self.running.pop(process.pid, None)

    def stop(self, signum: int, grace: float) -> list[int]:
        """SIGTERM (or SIGINT) to every running stage's process group, then wait for them for
        up to `grace` seconds and SIGKILL what is left. Returns the pids it waited for."""
        import signal

        with self.lock:
            self.stopping = signal.Signals(signum).name
            processes = list(self.running.values())
        for process in processes:
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                pass
        # Wait for each whole group (dvc, its shell and the stage: a stage may outlive dvc,
        # ending its work), reaping dvc; at the deadline, kill what is left.
        deadline = time.monotonic() + grace
        alive = list(processes)
        while alive and time.monotonic() < deadline:
            for process in list(alive):
                process.poll()  # reap dvc, so that its zombie does not count
                if not group_alive(process.pid):
                    alive.remove(process)
            time.sleep(0.1)
        for process in alive:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in processes:
            process.wait()
        return [process.pid for process in processes]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


STAGES = Stages()
STOP_GRACE_SECONDS = 60  # what a stage gets to end after SIGTERM before it is killed


class FlowStopped(BaseException):
    """The flow was told to stop (SIGTERM, SIGINT): its stages have ended."""


@contextmanager
def stop_on_signals():
    """While the flow runs: SIGTERM or SIGINT reaches every running stage (its process group),
    the flow waits for them (at most STOP_GRACE_SECONDS, then kills them), and only then
    raises FlowStopped, so that the workspace lock is released after the stages are gone."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if STAGES.stopping:
            return  # the second signal of a double Ctrl-C: the first is already stopping them
        waited = STAGES.stop(signum, STOP_GRACE_SECONDS)
        raise FlowStopped(f"{signal.Signals(signum).name}: {len(waited)} running stage(s) stopped")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


LOCK_FILE = Path(".dvc/tmp/rlhf-flow.lock")  # one flow run per workspace


@contextmanager
def workspace_lock(root: Path):
    """Hold the workspace for one flow run: a second flow (a scheduled run while one is
    going, a second terminal) fails at once, naming the holder, before any stage starts.
    An advisory `flock`: the kernel drops it when the holder dies, even by `kill -9`."""
    import fcntl

    from prefect.runtime import flow_run

    path = root / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RuntimeError(
            f"another flow run holds this workspace ({root}): {holder}. Wait for it to end; "
            f"two runs in one workspace would overwrite each other's outputs ({path})"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"pid {os.getpid()}, flow run {flow_run.get_name() or '-'}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        handle.flush()
        yield
    finally:
        handle.close()
