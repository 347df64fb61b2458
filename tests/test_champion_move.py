"""A promotion or rollback killed between the two stores (the MLflow registry and
models/champion): the next gate, rollback or `--sync` finishes the move or undoes it, says
which, and leaves no staging behind.

Each kill is real: a child process moves the champion (rlhf.tracking.champion.
moving_champion) against a real sqlite MLflow registry and SIGKILLs itself at one step of
the move; the test then recovers in this process and reads both stores."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REGISTERED = "rlhf-policy"

# The child: move the champion from version 1 to version 2 (a rollback when PIN is given:
# its pin goes to the registry before the alias), killed at the step KILL_AT names.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    import rlhf.tracking.champion as champion

    uri, champion_dir, kill_at, pin = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] or None
    client = MlflowClient(uri)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def after(function):
        def call(*args, **kwargs):
            function(*args, **kwargs)
            die()
        return call

    if kill_at == "pin":
        champion.set_pin = after(champion.set_pin)
    elif kill_at == "alias":
        champion.set_champion_alias = after(champion.set_champion_alias)
    elif kill_at == "renames":
        class OneRename:  # os, killed after its first replace (the old folder parked)
            def __getattr__(self, name):
                return getattr(os, name)
            def replace(self, src, dst):
                os.replace(src, dst)
                die()
        champion.os = OneRename()
    expected = champion.registry_champion(client, "rlhf-policy")
    pin = pin or champion.KEEP_PIN
    with champion.moving_champion(client, "rlhf-policy", "2", champion_dir, expected, pin=pin) as staging:
        (staging / "champion.json").write_text(json.dumps({"model_version": "2"}))
        (staging / "weights.bin").write_bytes(b"two" * 1000)
        if kill_at == "filling":
            die()
    print("moved")
    """
)


@pytest.fixture
def registry(tmp_path):
    """A sqlite registry with three versions of rlhf-policy, the alias on version 1, and
    models/champion holding version 1."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_registered_model(REGISTERED)
    source = tmp_path / "source"
    source.mkdir()
    for _ in range(3):
        client.create_model_version(REGISTERED, source.as_uri())
    client.set_registered_model_alias(REGISTERED, "champion", "1")
    champion_dir = tmp_path / "models/champion"
    champion_dir.mkdir(parents=True)
    (champion_dir / "champion.json").write_text(json.dumps({"model_version": "1"}))
    (champion_dir / "weights.bin").write_bytes(b"one" * 1000)
    return uri, client, champion_dir


def killed_move(uri: str, champion_dir: Path, kill_at: str, pin: str = "") -> None:
    script = champion_dir.parent.parent / "child.py"
    script.write_text(CHILD)
    result = subprocess.run(
        [sys.executable, str(script), uri, str(champion_dir), kill_at, pin],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr


def state(client, champion_dir: Path) -> tuple:
    from rlhf.tracking.champion import registry_champion

    now = registry_champion(client, REGISTERED)
    folder = json.loads((champion_dir / "champion.json").read_text())["model_version"]
    weights = (champion_dir / "weights.bin").read_bytes()[:3].decode()
    return now.version, now.pin, folder, weights


def leftovers(champion_dir: Path) -> list[str]:
    return sorted(p.name for p in champion_dir.parent.iterdir() if p.name != champion_dir.name)


@pytest.mark.parametrize(
    "kill_at, pin",
    [("pin", "rolled back to version 2"), ("alias", ""), ("renames", ""), ("renames", "rolled back to version 2")],
)
def test_a_move_killed_between_the_stores_is_finished_by_the_next_command(registry, kill_at, pin):
    from rlhf.tracking.champion import move_dir, recover_move

    uri, client, champion_dir = registry
    killed_move(uri, champion_dir, kill_at, pin)
    # The kill left the stores apart (or the folder missing): the record of intent is there.
    assert (move_dir(champion_dir) / "intent.json").is_file()
    if kill_at == "renames":
        assert not champion_dir.exists()  # killed between the folder's two renames
    recovered = recover_move(client, REGISTERED, champion_dir)
    assert recovered.finished and recovered.version == "2"
    assert "finished an interrupted move of the champion from version 1 to version 2" in recovered.message
    assert state(client, champion_dir) == ("2", pin or None, "2", "two")
    assert leftovers(champion_dir) == []
    assert recover_move(client, REGISTERED, champion_dir) is None  # nothing left to do


def test_a_move_killed_while_staging_moves_nothing_and_leaves_nothing(registry):
    from rlhf.tracking.champion import recover_move

    uri, client, champion_dir = registry
    killed_move(uri, champion_dir, "filling")
    assert leftovers(champion_dir) == [".champion-move"]
    recovered = recover_move(client, REGISTERED, champion_dir)
    assert not recovered.finished and "a move that had not started" in recovered.message
    assert state(client, champion_dir) == ("1", None, "1", "one")
    assert leftovers(champion_dir) == []


def test_a_move_overtaken_by_another_clone_is_undone(registry):
    """Killed after its pin and alias moved; then another clone moved the alias to version
    3: the other clone's move stands, this one's pin and folder go back, and it says so."""
    from rlhf.tracking.champion import recover_move

    uri, client, champion_dir = registry
    killed_move(uri, champion_dir, "renames", "rolled back to version 2")
    client.set_registered_model_alias(REGISTERED, "champion", "3")
    recovered = recover_move(client, REGISTERED, champion_dir)
    assert not recovered.finished
    assert "undid an interrupted move" in recovered.message and "version 3 by now" in recovered.message
    assert state(client, champion_dir) == ("3", None, "1", "one")
    assert leftovers(champion_dir) == []


def test_the_next_rollback_command_recovers_first_and_says_so(registry, tmp_path, monkeypatch, capsys):
    """`rlhf rollback --list` after a promotion killed midway finishes it first."""
    import rlhf.cli.rollback

    uri, client, champion_dir = registry
    killed_move(uri, champion_dir, "alias")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"test-{tmp_path.name}")
    monkeypatch.setattr(rlhf.cli.rollback, "CHAMPION_DIR", champion_dir)
    rlhf.cli.rollback.main(["--list"])
    out = capsys.readouterr().out
    assert "rollback: finished an interrupted move of the champion from version 1 to version 2" in out
    assert "v2" in out and "<- champion" in out.splitlines()[-2]
    assert state(client, champion_dir) == ("2", None, "2", "two")
    assert leftovers(champion_dir) == []
