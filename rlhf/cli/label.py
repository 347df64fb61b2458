"""Command `label`: the human-feedback labelling page (a command, not a DVC stage).

    rlhf label                         # http://127.0.0.1:8765
    rlhf label --model models/sft --port 8766

Shows a prompt and two completions the model samples for it (A and B); "A is better" or
"B is better" appends ``{"prompt", "chosen", "rejected"}``, validated by the preference
contract, to data/raw/feedback_prefs.jsonl, and the next `dvc repro` trains on it: stage
prepare adds the file's pairs to prefs (stages/prepare.py), and every stage downstream of
prefs reruns. The page itself is `rlhf.feedback.app`.

* --model: models/champion when the gate has promoted one, else models/sft.
* --prompts: data/prepared/prompts.parquet (the training prompts), or any prompts file
  (JSONL, JSON, Parquet, CSV with a prompt column). An eval suite (data/prepared/eval) is
  refused unless --allow-eval-prompts: pairs on its problems would train on what the gate
  and the reported numbers judge.
* --out: must lie inside the project directory (the current one) and end in .jsonl;
  prepare reads only data/raw/feedback_prefs.jsonl.
* --host: 127.0.0.1 unless given: the page has no login, so another address must be named.
  On 127.0.0.1 requests naming another host are turned away (DNS rebinding).

params.yaml is validated as by every stage, and its `compute` section places the model.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from rlhf.layout import CHAMPION_DIR, EVAL_DIR, FEEDBACK_FILE, PROMPTS_FILE, SFT_DIR

LOOPBACK = "127.0.0.1"


def load_placement() -> bool:
    """Params `compute` and `model` set where and how the page's model loads (as a stage's
    would); returns policy.trust_remote_code. Only these keys are read and checked."""
    import rlhf.models.settings as model_settings
    from rlhf.models.compute import ComputeConfig, configure
    from rlhf.params import input_errors_exit, load_section
    from rlhf.training.params import PolicyCode

    with input_errors_exit("label: "):
        compute = load_section("compute", ComputeConfig)
        model = load_section("model", model_settings.ModelSettings)
        policy = load_section("policy", PolicyCode, keys_of_config=True)
        configure(compute)
        model_settings.configure(model, None)
    return policy.trust_remote_code


def default_model() -> Path:
    return CHAMPION_DIR if CHAMPION_DIR.is_dir() else SFT_DIR


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: models/champion, else sft)")
    parser.add_argument("--prompts", type=Path, default=PROMPTS_FILE, help=f"prompts file (default: {PROMPTS_FILE})")
    parser.add_argument("--out", type=Path, default=FEEDBACK_FILE, help=f"preference file (default: {FEEDBACK_FILE})")
    parser.add_argument("--host", default=LOOPBACK, help=f"address to bind (default: {LOOPBACK})")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--samples", type=int, default=2, help="completions sampled per prompt, of which two are shown")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-eval-prompts", action="store_true", help="label prompts of an eval suite anyway")
    return parser.parse_args(argv)


def fail(message: str) -> SystemExit:
    return SystemExit(f"label: {message}")


def check_port(host: str, port: int) -> None:
    """Fail before the model loads when the address is taken (uvicorn would fail after the
    page's address was printed)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise fail(
                f"--port {port}: cannot listen on {host}:{port} ({error.strerror}); another page or server "
                "may hold it: pass another --port"
            ) from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_port(args.host, args.port)
    root = Path.cwd().resolve()
    from rlhf.feedback.app import OutsideProjectError, check_out_path

    try:
        out = check_out_path(args.out, root)
    except OutsideProjectError as error:
        raise fail(f"--out {error}; give a path inside it, e.g. {FEEDBACK_FILE}") from None
    except ValueError as error:
        raise fail(f"--out {error}") from None
    prompts_path = (root / args.prompts).resolve()
    if prompts_path.is_relative_to((root / EVAL_DIR).resolve()) and not args.allow_eval_prompts:
        raise fail(
            f"--prompts {args.prompts} is an eval suite: its pairs would train on the problems the gate and the "
            f"reports judge; use {PROMPTS_FILE} (or pass --allow-eval-prompts)"
        )
    if not prompts_path.exists():
        raise fail(f"--prompts {args.prompts} does not exist; run `dvc repro prepare` first, or give a prompts file")

    trust_remote_code = load_placement()
    from rlhf.data.contracts import DataValidationError, load_contract
    from rlhf.feedback.app import create_app

    try:
        table = load_contract(prompts_path, "prompts")
    except DataValidationError as error:
        raise fail(str(error)) from None
    model = args.model or default_model()
    answers = list(table["answer"]) if "answer" in table.columns else None
    loopback = args.host in (LOOPBACK, "localhost")
    allowed = [LOOPBACK, "localhost"] if loopback else None
    # Beyond loopback anyone who reaches the address could label: a secret in the address.
    access_token = None if loopback else secrets.token_urlsafe(24)
    try:
        app = create_app(
            model,
            list(table["prompt"]),
            out,
            answers=answers,
            n=args.samples,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            trust_remote_code=trust_remote_code,
            allowed_hosts=allowed,
            access_token=access_token,
        )
    except DataValidationError as error:  # the preference file exists and breaks the contract
        raise fail(str(error)) from None
    except FileNotFoundError as error:
        raise fail(f"{str(error).split('. ')[0]}; run `dvc repro` to build it, or give --model") from None
    except (OSError, ValueError) as error:  # not a usable model folder
        raise fail(str(error)) from None

    import uvicorn

    shown = out.relative_to(root).as_posix()
    if out != (root / FEEDBACK_FILE).resolve():
        print(f"label: note: prepare reads {FEEDBACK_FILE}; name {shown} in prepare.files to train on it")
    address = f"http://{args.host}:{args.port}/" + (f"?token={access_token}" if access_token else "")
    if access_token:
        print(f"label: bound to {args.host}: the page asks for the access token in this address; share it only "
              "with the people who label")  # fmt: skip
    print(f"label: {address} shows {model}'s completions; choices go to {shown}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
