"""Memory and tokenisation at data size: a preference file of a few GB through prepare and
10 steps of policy@dpo, against the same run with a 20 MB file.

The benchmark builds a scratch project (this checkout's code, a DVC repo of its own) with
a small Llama-shaped model whose BPE tokenizer is trained on the generated text (so that a
row is a few hundred tokens, as real text is, not one token a character), a preference
JSONL of `--gb` gigabytes as `prepare.files.prefs` (a prompt and two replies of
pseudo-words a row), and `policy.dpo` at 10 steps. It runs `dvc repro policy@dpo` (prepare,
base, sft at 2 steps, policy@dpo) and samples every process of the run every 50 ms:

* `peak`: the process's own high-water mark of resident memory (VmHWM), which counts the
  pages of memory-mapped files it has touched (the Arrow tables datasets maps: page cache
  the kernel takes back under pressure);
* `anon`: the highest sampled anonymous resident memory (RssAnon): what the process
  itself allocated, the memory that grows with the data when a table is held whole.

Then it changes `policy.dpo.beta` and reruns: only policy@dpo runs again, on the same data.
The datasets progress bars the stage prints name each map (tokenisation, counting tokens,
converting Parquet to Arrow) with its time; a map found in the cache prints none. The
benchmark sums them for the first and the second run.

    python benchmarks/data_scale.py                    # 2 GB against 20 MB (about 40 min on 2 cores)
    python benchmarks/data_scale.py --gb 0.05 --small-mb 5   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = 6000  # pseudo-words of the generated text
VOCAB = 4096  # BPE vocabulary


def pseudo_words(rng: random.Random) -> list[str]:
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(WORDS)]


def sentence(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choices(words, k=n)).capitalize() + "."


def write_prefs(path: Path, size: int, seed: int) -> int:
    """A preference JSONL of about `size` bytes; its rows."""
    rng = random.Random(seed)
    words = pseudo_words(random.Random(0))
    written = rows = 0
    with open(path, "w") as file:
        while written < size:
            prompt = sentence(rng, words, rng.randint(20, 60)) + " " + sentence(rng, words, rng.randint(5, 20)) + "?"
            chosen = " ".join(sentence(rng, words, rng.randint(8, 20)) for _ in range(rng.randint(4, 12)))
            rejected = " ".join(sentence(rng, words, rng.randint(8, 20)) for _ in range(rng.randint(4, 12)))
            line = json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n"
            file.write(line)
            written += len(line)
            rows += 1
    return rows


def write_small_files(raw: Path) -> None:
    rng = random.Random(1)
    words = pseudo_words(random.Random(0))
    with open(raw / "sft.jsonl", "w") as file:
        for _ in range(500):
            row = {"prompt": sentence(rng, words, 30) + "?", "completion": sentence(rng, words, 40)}
            file.write(json.dumps(row) + "\n")
    with open(raw / "heldout.jsonl", "w") as file:
        for _ in range(50):
            file.write(json.dumps({"prompt": sentence(rng, words, 30) + "?"}) + "\n")


def build_model(path: Path, sample: Path) -> None:
    """A small Llama-shaped model (random weights) with a BPE tokenizer trained on `sample`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    special = ["<unk>", "<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    with open(sample) as file:
        lines = [line for _, line in zip(range(5000), file)]
    core.train_from_iterator(lines, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.model_max_length = 1024
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def project(work: Path, model_dir: Path, prefs: Path) -> Path:
    import yaml

    root = work / "project"
    shutil.rmtree(root, ignore_errors=True)
    for name in ("rlhf", "stages", "flows", "configs", "dvc.yaml", ".dvcignore"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, root / name)
    (root / "data/raw").mkdir(parents=True)
    write_small_files(root / "data/raw")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params.update(
        task={"kind": "none"},
        prepare={**params["prepare"], "source": "files", "files": {
            "sft": {"path": "data/raw/sft.jsonl"}, "prefs": {"path": str(prefs)},
            "eval_heldout": {"path": "data/raw/heldout.jsonl"}}},
        base={**params["base"], "model": str(model_dir)},
    )  # fmt: skip
    params["sft"].update(max_steps=2, max_length=256, per_device_train_batch_size=8)
    params["policy"]["offline"], params["policy"]["online"] = ["dpo"], []
    params["infer"]["strategies"] = ["greedy"]  # the others vote on or check answers: task none has none
    params["policy"]["dpo"].update(
        max_steps=10, max_length=512, per_device_train_batch_size=4, precompute_ref_log_probs=False, save_steps=1000
    )
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)
    return root


def status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def stage_name(cmdline: list[str]) -> str:
    """The stage a process runs (`python -m rlhf.cli.launch stages.policy dpo`: policy@dpo)."""
    modules = [i for i, token in enumerate(cmdline) if token.startswith("stages.") and token != "rlhf.cli.launch"]
    if modules:
        i = modules[-1]
        name = cmdline[i].split(".", 1)[1]
        return f"{name}@{cmdline[i + 1]}" if name == "policy" and i + 1 < len(cmdline) else name
    return "dvc" if any("dvc" in token for token in cmdline) else " ".join(cmdline)[:40]


def run_sampled(command: list[str], cwd: Path, env: dict, log: Path) -> dict:
    """Run `command`, sampling its process tree; per stage: peak (VmHWM) and anon (RssAnon), GiB."""
    import psutil

    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        seen: dict[int, dict] = {}
        done = threading.Event()

        def sample() -> None:
            parent = psutil.Process(process.pid)
            while not done.is_set():
                try:
                    tree = [parent, *parent.children(recursive=True)]
                except psutil.NoSuchProcess:
                    break
                for child in tree:
                    entry = seen.get(child.pid)
                    if entry is None:
                        try:
                            entry = seen[child.pid] = {"stage": stage_name(child.cmdline()), "peak": 0, "anon": 0}
                        except psutil.Error:
                            continue
                    entry["peak"] = max(entry["peak"], status_kib(child.pid, "VmHWM"))
                    entry["anon"] = max(entry["anon"], status_kib(child.pid, "RssAnon"))
                time.sleep(0.05)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        start = time.perf_counter()
        code = process.wait()
        done.set()
        thread.join()
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed; see {log}")
    stages: dict[str, dict] = {}
    for entry in seen.values():
        best = stages.setdefault(entry["stage"], {"peak": 0.0, "anon": 0.0})
        best["peak"] = max(best["peak"], entry["peak"] / 2**20)
        best["anon"] = max(best["anon"], entry["anon"] / 2**20)
    return {"seconds": time.perf_counter() - start, "stages": stages}


_BAR = re.compile(r"([A-Z][\w ]+?)(?: #\d+)?: 100%\|[^|]*\| *[\d,]+/[\d,]+ \[(?:(\d+):)?(\d+):(\d+)<[^\]]*examples/s")


def map_seconds(log: Path, stage: str) -> dict[str, float]:
    """The datasets maps of one stage in a run's log, by their progress bar's name: seconds."""
    text = log.read_text(errors="replace")
    part = text[text.find(f"Running stage '{stage}'") :] if f"Running stage '{stage}'" in text else text
    part = part[: part.find("Running stage", 20)] if part.find("Running stage", 20) > 0 else part
    seconds: dict[str, float] = {}
    for name, hours, minutes, secs in _BAR.findall(part.replace("\r", "\n")):
        seconds[name.strip()] = int(hours or 0) * 3600 + int(minutes) * 60 + int(secs)
    return seconds


def one_size(work: Path, size: int, label: str) -> dict:
    data = work / f"prefs-{label}.jsonl"
    if not data.exists():
        rows = write_prefs(data, size, seed=0)
        print(f"{label}: wrote {data.stat().st_size / 1e9:.3f} GB, {rows} rows", flush=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_model(model_dir, data)
    root = project(work / label, model_dir, data)
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "HF_DATASETS_CACHE": str(work / label / "datasets-cache")}  # fmt: skip
    dvc = [sys.executable, "-m", "dvc", "repro", "policy@dpo"]
    first = run_sampled(dvc, root, env, work / f"{label}-first.log")
    import yaml

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["policy"]["dpo"]["beta"] = 0.2
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = run_sampled(dvc, root, env, work / f"{label}-second.log")
    maps = [map_seconds(work / f"{label}-{run}.log", "policy@dpo") for run in ("first", "second")]
    return {"bytes": data.stat().st_size, "first": first, "second": second, "maps": maps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the large preference file")
    parser.add_argument("--small-mb", type=float, default=20.0)
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {
        "small": one_size(work, int(args.small_mb * 1e6), "small"),
        "large": one_size(work, int(args.gb * 1e9), "large"),
    }
    small, large = results["small"], results["large"]
    print(f"\n{'stage':<14} {'small peak':>11} {'large peak':>11} {'small anon':>11} {'large anon':>11}  (GiB)")
    stages = set(small["first"]["stages"]) | set(large["first"]["stages"])
    for stage in sorted(s for s in stages if s in ("dvc", "check_params", "prepare", "base", "sft", "policy@dpo")):
        a = small["first"]["stages"].get(stage, {"peak": 0, "anon": 0})
        b = large["first"]["stages"].get(stage, {"peak": 0, "anon": 0})
        print(f"{stage:<14} {a['peak']:>11.2f} {b['peak']:>11.2f} {a['anon']:>11.2f} {b['anon']:>11.2f}")
    for label in ("small", "large"):
        first, second = (sum(m.values()) for m in results[label]["maps"])
        print(f"{label}: policy@dpo's maps {first:.0f} s in the first run, {second:.0f} s after the beta change "
              f"(ratio {second / first if first else float('nan'):.3f}); {results[label]['maps']}")  # fmt: skip
        runs = results[label]
        print(f"{label}: dvc repro {runs['first']['seconds']:.0f} s, then {runs['second']['seconds']:.0f} s")
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
