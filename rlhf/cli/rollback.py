"""Command `rollback`: move the champion back to an earlier registry version (not a DVC stage).

    rlhf rollback --list           # the versions, their candidates, the alias
    rlhf rollback --version 2      # models/champion and the alias back to version 2
    rlhf rollback --unpin          # let the gate move the champion again
    rlhf rollback --sync           # models/champion to the registry's champion

Promotion backwards: version 2's weights, tokenizer and champion record (the one its gate
logged) replace models/champion and the registry alias `champion` moves to version 2
together (rlhf.tracking.champion.moving_champion: a failure leaves both where they were,
and a kill midway is finished or undone by the next gate or rollback command),
and an MLflow run tagged `rlhf.stage=rollback` records who moved it from which version to
which.

The restored champion is pinned, in its record and in the registry (tag `rlhf.pinned` of
the registered model): every clone's gate holds back any candidate while it is (the next
scheduled run would otherwise promote again the candidate just rolled back from, which beat
version 2 before). `--unpin` clears both pins; the next gate then compares against the
restored record, so a candidate must beat version 2 to move it forward.

Clones that share a tracking store share the registry but not models/champion: after a
rollback (or a promotion) in one, the others' gates hold back until `--sync` brings their
models/champion to the registry's champion (its pin included); the alias does not move.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rlhf.atomic import atomic_dir
from rlhf.layout import CHAMPION_DIR


def registry_params():
    """params `gate`'s registry keys (rlhf.tracking.champion.RegistryParams)."""
    from rlhf.params import input_errors_exit, load_section
    from rlhf.tracking.champion import RegistryParams

    with input_errors_exit("rollback: "):
        return load_section("gate", RegistryParams, keys_of_config=True)


def finish_interrupted_move(registered_model: str):
    """Finish or undo a move of the champion that a killed gate or rollback left
    (rlhf.tracking.champion.recover_move); None when there was none."""
    from mlflow.tracking import MlflowClient

    from rlhf.tracking.champion import recover_move
    from rlhf.tracking.runs import setup_experiment, tracking_uri

    setup_experiment()
    return recover_move(MlflowClient(tracking_uri()), registered_model, CHAMPION_DIR)


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


def not_promoted(registered_model: str, version: str) -> str:
    return (
        f"rollback: version {version} of {registered_model!r} was not promoted by the gate (it has no `candidate` "
        "tag, and its run no champion.json record to compare the next candidate against): only a version the "
        "gate promoted can be the champion (`--list` shows each version's candidate)"
    )


def rollback(version: str, registered_model: str) -> dict:
    """Make registry `version` the champion again; returns the restored record."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from rlhf.tracking.champion import CHAMPION_RECORD, moving_champion, read_champion, restore_version
    from rlhf.tracking.runs import setup_experiment, tracking_uri

    setup_experiment()
    client = MlflowClient(tracking_uri())
    known = {v["version"]: v for v in list_versions(client, registered_model)}
    if version not in known:
        raise SystemExit(
            f"rollback: {registered_model!r} has no version {version} (versions: {sorted(known, key=int) or 'none'}); "
            f"is MLFLOW_TRACKING_URI the store the gate promoted into ({tracking_uri()})?"
        )
    if not known[version]["candidate"]:
        raise SystemExit(not_promoted(registered_model, version))
    if known[version]["champion"]:
        raise SystemExit(
            f"rollback: version {version} is the champion already (`rlhf rollback --sync` brings {CHAMPION_DIR} to it)"
        )
    # Where the alias points now: the registry is the record, whichever clone this runs in
    # (a fresh clone has no models/champion of its own).
    previous = read_champion(CHAMPION_DIR)
    moved_from = next((v for v, info in known.items() if info["champion"]), None)
    if moved_from is None and previous:
        moved_from = previous.get("model_version")
    tags = {"rlhf.stage": "rollback", "rollback.from_version": str(moved_from), "rollback.to_version": version}
    at = time.strftime("%Y-%m-%dT%H:%M:%S")
    pin = f"rolled back from version {moved_from} to version {version} at {at}"
    with mlflow.start_run(run_name=f"rollback-to-v{version}", tags=tags):
        # The registry's pin moves before the alias (no clone's gate promotes over it).
        with moving_champion(client, registered_model, version, CHAMPION_DIR, pin=pin) as staging:
            record = restore_version(client, registered_model, version, staging)
            record["restored"] = {"from_version": moved_from, "at": at}
            record["pinned"] = pin
            (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        mlflow.log_dict(record, CHAMPION_RECORD)
    return record


def sync(registered_model: str) -> dict:
    """Bring models/champion to the registry's champion (another clone sharing the tracking
    store moved it), its pin included; the alias stays. Returns the record."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from rlhf.tracking.champion import CHAMPION_RECORD, read_champion, registry_champion, restore_version
    from rlhf.tracking.runs import setup_experiment, tracking_uri

    setup_experiment()
    client = MlflowClient(tracking_uri())
    version, pin, _ = registry_champion(client, registered_model)
    current = read_champion(CHAMPION_DIR) or {}
    if version is None:
        raise SystemExit(
            f"rollback: {registered_model!r} has no champion in the registry at {tracking_uri()} (nothing promoted "
            "there yet; is MLFLOW_TRACKING_URI the store the gate promoted into?)"
        )
    if not client.get_model_version(registered_model, version).tags.get("candidate"):
        raise SystemExit(not_promoted(registered_model, version) + " (the alias was moved by hand)")
    with mlflow.start_run(run_name=f"sync-to-v{version}", tags={"rlhf.stage": "rollback", "rollback.sync": version}):
        with atomic_dir(CHAMPION_DIR) as staging:
            record = restore_version(client, registered_model, version, staging)
            record = {k: v for k, v in record.items() if k != "pinned"} | ({"pinned": pin} if pin else {})
            if current.get("model_version") == version and "restored" in current:
                # This clone rolled back to it: keep that provenance (the registry has none),
                # so that syncing to the same version writes the same folder (nothing reruns).
                record["restored"] = current["restored"]
            (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        mlflow.log_dict(record, CHAMPION_RECORD)
    return record


def unpin(registered_model: str) -> dict:
    """Clear the pin of models/champion's record (atomically) and the registry's, so that
    the next gate may move the champion; an MLflow run records it. Returns the record."""
    import shutil

    import mlflow
    from mlflow.tracking import MlflowClient

    from rlhf.tracking.champion import CHAMPION_RECORD, read_champion, registry_champion, set_pin
    from rlhf.tracking.runs import setup_experiment, tracking_uri

    setup_experiment()
    client = MlflowClient(tracking_uri())
    record = read_champion(CHAMPION_DIR) or {}
    registry_pin = registry_champion(client, registered_model).pin
    pinned = record.get("pinned") or registry_pin
    if not pinned:
        raise SystemExit(f"rollback: the champion is not pinned ({CHAMPION_DIR} nor the registry's)")
    with mlflow.start_run(run_name="unpin", tags={"rlhf.stage": "rollback", "rollback.unpinned": pinned}):
        if registry_pin:
            set_pin(client, registered_model, None)
        if record.get("pinned"):
            with atomic_dir(CHAMPION_DIR) as staging:
                shutil.copytree(CHAMPION_DIR, staging, dirs_exist_ok=True)
                record = {k: v for k, v in record.items() if k != "pinned"}
                (staging / CHAMPION_RECORD).unlink()  # a copy keeps a read-only file read-only: replaced, not written
                (staging / CHAMPION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        mlflow.log_dict(record, CHAMPION_RECORD)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--list", action="store_true", help="list the registry versions")
    action.add_argument("--version", help="the registry version to make the champion again (pinned)")
    action.add_argument("--unpin", action="store_true", help="let the gate move the champion again")
    action.add_argument("--sync", action="store_true", help="models/champion to the registry's champion")
    args = parser.parse_args(argv)
    registered_model = registry_params().registered_model
    recovered = finish_interrupted_move(registered_model)
    if recovered is not None:
        print(f"rollback: {recovered.message}")
    if args.unpin:
        record = unpin(registered_model)
        print(f"rollback: the champion ({record.get('candidate')}) is no longer pinned; the next gate may move it")
        return
    if args.sync:
        record = sync(registered_model)
        pinned = f", pinned: {record['pinned']}" if record.get("pinned") else ""
        print(f"rollback: {CHAMPION_DIR} holds the registry's champion, version {record['model_version']}{pinned}")
        return
    if args.list:
        from mlflow.tracking import MlflowClient

        from rlhf.tracking.runs import tracking_uri

        rows = list_versions(MlflowClient(tracking_uri()), registered_model)
        if not rows:
            print(f"rollback: no versions of {registered_model!r} in {tracking_uri()} (nothing promoted there yet)")
        for row in rows:
            mark = "  <- champion" if row["champion"] else ""
            print(f"v{row['version']}  {row['candidate']}  {row['created']}  run {row['run_id']}{mark}")
        return
    record = rollback(str(args.version), registered_model)
    print(
        f"rollback: the champion is version {args.version} ({record['candidate']}) again, pinned until "
        "`rlhf rollback --unpin`"
    )


if __name__ == "__main__":
    sys.exit(main())
