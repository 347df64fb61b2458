"""Command `rollback`: move the champion back to an earlier registry version (not a DVC stage).

    python -m stages.rollback --list           # the versions, their candidates, the alias
    python -m stages.rollback --version 2      # models/champion and the alias back to version 2
    python -m stages.rollback --unpin          # let the gate move the champion again

Promotion backwards: version 2's weights, tokenizer and champion record (the one its gate
logged) replace models/champion atomically, then the registry alias `champion` moves to
version 2, and an MLflow run tagged `rlhf.stage=rollback` records who moved it from which
version to which. A failure before the alias moves leaves both where they were.

The restored champion is pinned: its record says who rolled it back, and the gate holds
back any candidate while it is (the next scheduled run would otherwise promote again the
candidate just rolled back from, which beat version 2 before). `--unpin` clears the pin;
the next gate then compares against the restored record, so a candidate must beat
version 2 to move it forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rlhf.artifacts import atomic_dir
from stages import CHAMPION_DIR, load_config


def list_versions(client, registered_model: str) -> list[dict]:
    from rlhf.tracking.champion import CHAMPION_ALIAS

    try:
        current = client.get_model_version_by_alias(registered_model, CHAMPION_ALIAS).version
    except Exception:  # no alias yet (nothing promoted), or no registered model
        current = None
    versions = client.search_model_versions(f"name = '{registered_model}'")
    return [
        {
            "version": str(v.version),
            "candidate": v.tags.get("candidate"),
            "run_id": v.run_id,
            "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.creation_timestamp / 1000)),
            "champion": str(v.version) == str(current),
        }
        for v in sorted(versions, key=lambda v: int(v.version))
    ]


def rollback(version: str, registered_model: str) -> dict:
    """Make registry `version` the champion again; returns the restored record."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from rlhf.tracking.champion import CHAMPION_RECORD, read_champion, restore_version, set_champion_alias
    from rlhf.tracking.runs import setup_experiment, tracking_uri

    setup_experiment()
    client = MlflowClient(tracking_uri())
    known = {v["version"]: v for v in list_versions(client, registered_model)}
    if version not in known:
        raise SystemExit(
            f"rollback: {registered_model!r} has no version {version} (versions: {sorted(known, key=int) or 'none'})"
        )
    # Where the alias points now: the registry is the record, whichever clone this runs in
    # (a fresh clone has no models/champion of its own).
    previous = read_champion(CHAMPION_DIR)
    moved_from = next((v for v, info in known.items() if info["champion"]), None)
    if moved_from is None and previous:
        moved_from = previous.get("model_version")
    tags = {"rlhf.stage": "rollback", "rollback.from_version": str(moved_from), "rollback.to_version": version}
    with mlflow.start_run(run_name=f"rollback-to-v{version}", tags=tags):
        with atomic_dir(CHAMPION_DIR) as staging:
            record = restore_version(client, registered_model, version, staging)
            at = time.strftime("%Y-%m-%dT%H:%M:%S")
            record["restored"] = {"from_version": moved_from, "at": at}
            record["pinned"] = f"rolled back from version {moved_from} to version {version} at {at}"
            (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        set_champion_alias(client, registered_model, version)
        mlflow.log_dict(record, CHAMPION_RECORD)
    return record


def unpin() -> dict:
    """Clear the pin of models/champion's record (atomically), so that the next gate may
    move the champion; an MLflow run records it. Returns the record."""
    import shutil

    import mlflow

    from rlhf.tracking.champion import CHAMPION_RECORD, read_champion
    from rlhf.tracking.runs import setup_experiment

    record = read_champion(CHAMPION_DIR)
    if not record or not record.get("pinned"):
        raise SystemExit(f"rollback: the champion in {CHAMPION_DIR} is not pinned")
    setup_experiment()
    with mlflow.start_run(run_name="unpin", tags={"rlhf.stage": "rollback", "rollback.unpinned": record["pinned"]}):
        with atomic_dir(CHAMPION_DIR) as staging:
            shutil.copytree(CHAMPION_DIR, staging, dirs_exist_ok=True)
            record = {k: v for k, v in record.items() if k != "pinned"}
            (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        mlflow.log_dict(record, CHAMPION_RECORD)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--list", action="store_true", help="list the registry versions")
    action.add_argument("--version", help="the registry version to make the champion again (pinned)")
    action.add_argument("--unpin", action="store_true", help="let the gate move the champion again")
    args = parser.parse_args(argv)
    if args.unpin:
        record = unpin()
        print(f"rollback: the champion ({record['candidate']}) is no longer pinned; the next gate may move it")
        return
    registered_model = load_config("gate").registered_model
    if args.list:
        from mlflow.tracking import MlflowClient

        from rlhf.tracking.runs import tracking_uri

        for row in list_versions(MlflowClient(tracking_uri()), registered_model):
            mark = "  <- champion" if row["champion"] else ""
            print(f"v{row['version']}  {row['candidate']}  {row['created']}  run {row['run_id']}{mark}")
        return
    record = rollback(str(args.version), registered_model)
    print(
        f"rollback: the champion is version {args.version} ({record['candidate']}) again, pinned until "
        "`python -m stages.rollback --unpin`"
    )


if __name__ == "__main__":
    sys.exit(main())
