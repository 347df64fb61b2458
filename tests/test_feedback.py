"""The human-feedback labelling page (rlhf.feedback.app, `rlhf label`) and the
way its pairs reach training (stage prepare).

The quick tests drive the app through FastAPI's TestClient on the untrained micro model:
a choice appends one row the preference contract accepts, with the texts the page showed;
a row the contract refuses is not written and the page says why; identical completions are
never shown; the command refuses a preference file outside the project; prepare adds the
file's pairs to prefs. One slow test drives a real headless Chromium (selenium) against the
app served by uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from rlhf.data.contracts import DataValidationError, load_contract
from rlhf.feedback.app import (
    LabellingSession,
    OutsideProjectError,
    Pair,
    PreferenceFile,
    check_out_path,
    create_app,
)
from tests.conftest import serve_app

PROMPTS = ["3+4\n", "12-5+1\n", "7+7-3\n", "20-9\n"]
ANSWERS = ["7", "8", "11", "11"]


def shown(page: str, element: str) -> str:
    """The text of a <pre> of the page, as a browser reads it (its first newline dropped)."""
    match = re.search(rf'<pre id="{element}">\n(.*?)</pre>', page, re.S)
    assert match, f"no {element} on the page"
    return html.unescape(match.group(1))


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def client(micro_dir, tmp_path):
    from fastapi.testclient import TestClient

    out = tmp_path / "data/raw/feedback_prefs.jsonl"
    app = create_app(micro_dir, PROMPTS, out, answers=ANSWERS, max_new_tokens=12, seed=0)
    with TestClient(app) as test_client:
        yield test_client, app.state.session, out


def token(http) -> str:
    """The token of a freshly rendered page (each form carries one, taken once)."""
    return re.search(r'name="token" value="([\w-]+)"', http.get("/").text).group(1)


def choose(http, pair: str, choice: str, **kwargs):
    return http.post("/choose", data={"pair": pair, "choice": choice, "token": token(http)}, **kwargs)


def test_a_choice_appends_a_valid_row_with_the_texts_shown(client):
    http, session, out = client
    page = http.get("/").text
    prompt, a, b = shown(page, "prompt"), shown(page, "completion-a"), shown(page, "completion-b")
    assert prompt in PROMPTS and a != b and a.strip() and b.strip()
    pair = re.search(r'name="pair" value="(\w+)"', page).group(1)
    page_token = re.search(r'name="token" value="([\w-]+)"', page).group(1)

    response = http.post("/choose", data={"pair": pair, "choice": "a", "token": page_token}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/?note=saved"
    assert rows(out) == [{"prompt": prompt, "chosen": a, "rejected": b}]
    assert len(load_contract(out, "preference")) == 1

    page = http.get("/?note=saved").text
    assert "Saved." in page and shown(page, "prompt") != prompt, "the next prompt, not the same one again"
    second = session.pair()
    choose(http, second.id, "b")
    assert rows(out)[1] == {"prompt": second.prompt, "chosen": second.b, "rejected": second.a}
    assert http.get("/api/count").json() == {
        "labels": 2,
        "path": str(out),
        "skipped": 0,
        "passed_over": 0,
        "remaining": 2,
    }

    # A repeated submit of an answered pair (a double click, the back button) saves nothing:
    # its token was taken (403), and with a fresh one the pair is answered already (409).
    again = http.post("/choose", data={"pair": pair, "choice": "b", "token": page_token}, follow_redirects=False)
    assert again.status_code == 403 and len(rows(out)) == 2
    response = choose(http, pair, "b", follow_redirects=False)
    assert response.status_code == 409 and "already answered" in response.text and len(rows(out)) == 2
    third = session.pair()
    choose(http, third.id, "skip")
    assert len(rows(out)) == 2 and session.counts()["skipped"] == 1


def test_a_pair_the_contract_refuses_is_not_written_and_the_page_says_why(client):
    http, session, out = client
    session.current = Pair("f" * 32, PROMPTS[0], "3+4=7; answer 7", "3+4=7; answer 7")
    response = choose(http, "f" * 32, "a")
    assert response.status_code == 422
    assert "Not saved: row 1: chosen and rejected are identical." in html.unescape(response.text)
    assert not out.exists(), "nothing written"
    assert 'id="completion-a"' in response.text, "the page goes on with the next pair"
    bad = choose(http, session.pair().id, "c")
    assert bad.status_code == 400 and not out.exists()


def test_identical_or_empty_completions_are_resampled_and_never_shown(tmp_path):
    draws = iter([["same", "same"], ["", "  "], ["same", "other"]])
    session = LabellingSession(lambda prompt, seed: next(draws), ["1+1\n"], PreferenceFile(tmp_path / "p.jsonl"))
    pair = session.pair()
    assert (pair.a, pair.b) == ("same", "other")

    stuck = LabellingSession(lambda prompt, seed: ["x", "x"], ["1+1\n"], PreferenceFile(tmp_path / "q.jsonl"))
    assert stuck.pair() is None and stuck.counts()["passed_over"] == 1, "passed over after max_tries rounds"


def test_the_file_is_validated_at_start_and_labelled_prompts_are_not_asked_again(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "1+1\n", "chosen": "answer 2", "rejected": "answer 3"}))  # no final newline
    out = PreferenceFile(path)
    session = LabellingSession(lambda prompt, seed: ["a", "b"], ["1+1\n", "2+2\n"], out)
    assert out.rows == 1 and session.pair().prompt == "2+2\n"
    session.choose(session.pair().id, "b")
    assert rows(path)[1] == {"prompt": "2+2\n", "chosen": "b", "rejected": "a"}, "appended on a line of its own"

    path.write_text('{"prompt": "1+1\\n", "chosen": "x"}\n')
    with pytest.raises(DataValidationError, match="missing column"):
        PreferenceFile(path)


def test_a_file_of_another_format_is_refused_before_a_row_of_the_other_kind_lands(tmp_path, micro_dir):
    """The page appends prompt/chosen/rejected rows of its prompts' kind. Into a file of
    text prompts, chat prompts are refused when the app starts and a chat row is refused
    before it is written (the file would no longer load: one format per file); a file of
    chosen/rejected conversations without a prompt column is refused at start."""
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "1+1\n", "chosen": "answer 2", "rejected": "answer 3"}) + "\n")
    chat = [{"role": "user", "content": "1+2?"}]
    with pytest.raises(DataValidationError, match="its rows have text prompts, and the prompts to label: messages"):
        create_app(micro_dir, [chat], path)
    out = PreferenceFile(path)
    from rlhf.feedback.app import preference_row

    with pytest.raises(DataValidationError, match="a preference file holds one format"):
        out.append(preference_row(chat, "3", "4"))
    assert len(rows(path)) == 1 and len(load_contract(path, "preference")) == 1

    implicit = tmp_path / "hh.jsonl"
    turn = [{"role": "user", "content": "hi"}]
    implicit.write_text(
        json.dumps({"chosen": [*turn, {"role": "assistant", "content": "hello"}],
                    "rejected": [*turn, {"role": "assistant", "content": "go away"}]}) + "\n"
    )  # fmt: skip
    with pytest.raises(DataValidationError, match="no prompt field"):
        create_app(micro_dir, [chat], implicit)


def test_two_pages_on_one_file_do_not_ask_what_the_other_has_labelled(tmp_path):
    """Two people, two pages (two processes, here two sessions), one file: each page reads
    what the other appended before it draws its next pair."""
    path = tmp_path / "prefs.jsonl"
    prompts = ["1+1\n", "2+2\n", "3+3\n", "4+4\n"]
    first = LabellingSession(lambda prompt, seed: ["a", "b"], prompts, PreferenceFile(path))
    second = LabellingSession(lambda prompt, seed: ["a", "b"], prompts, PreferenceFile(path))
    labelled = []
    for _ in range(2):
        for session in (first, second):
            pair = session.pair()
            if pair is not None:
                labelled.append(pair.prompt)
                session.choose(pair.id, "a")
    assert sorted(labelled) == sorted(set(labelled)), "no prompt labelled twice"
    assert [row["prompt"] for row in rows(path)] == labelled
    assert first.pair() is None and second.pair() is None and first.out.rows == second.out.rows == 4


def test_the_preference_file_must_lie_inside_the_project(tmp_path, monkeypatch):
    import rlhf.cli.label

    project = tmp_path / "project"
    project.mkdir()
    assert check_out_path("data/raw/x.jsonl", project) == project.resolve() / "data/raw/x.jsonl"
    for outside in ("../x.jsonl", str(tmp_path / "x.jsonl"), "/etc/x.jsonl"):
        with pytest.raises(OutsideProjectError):
            check_out_path(outside, project)
    (project / "link").symlink_to(tmp_path)
    with pytest.raises(OutsideProjectError):
        check_out_path("link/x.jsonl", project)

    monkeypatch.chdir(project)
    with pytest.raises(SystemExit, match=r"^label: --out \.\./x\.jsonl is outside the project directory .*$"):
        rlhf.cli.label.main(["--out", "../x.jsonl"])
    with pytest.raises(SystemExit, match="must be a .jsonl file"):
        rlhf.cli.label.main(["--out", "data/raw/x.csv"])
    with pytest.raises(SystemExit, match="is an eval suite"):
        rlhf.cli.label.main(["--prompts", "data/prepared/eval/test.parquet"])
    args = rlhf.cli.label.parse_args([])
    assert args.host == "127.0.0.1" and args.out == Path("data/raw/feedback_prefs.jsonl")
    import socket

    with socket.socket() as taken:  # a port in use fails before the model loads, naming it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"^label: --port {port}: cannot listen on 127.0.0.1:{port} \("):
            rlhf.cli.label.main(["--port", str(port)])


# ----------------------------------------------------------------------------- prepare


SIZES = {"sft": 20, "prefs": 6, "prefs_eval": 2, "unpaired": 2, "prm": 2, "prm_eval": 2, "prompts": 4}


def test_prepare_adds_the_feedback_pairs_to_prefs(tmp_path, monkeypatch):
    import pandas as pd

    from rlhf.tasks import get_task
    from stages.prepare import FEEDBACK_FILE, Config, prepare, read_feedback, run

    monkeypatch.chdir(tmp_path)
    FEEDBACK_FILE.parent.mkdir(parents=True)
    FEEDBACK_FILE.write_text("")
    assert read_feedback() is None, "the committed empty file adds nothing"
    out = PreferenceFile(FEEDBACK_FILE)
    labelled = [
        {"prompt": "3+4\n", "chosen": "3+4=7; answer 7", "rejected": "3+4=8; answer 8"},
        {"prompt": "9-2\n", "chosen": "9-2=7; answer 7", "rejected": "answer 6"},
    ]
    for row in labelled:
        out.append(row)

    config = Config(builtin={"sizes": {**SIZES, "eval_dev": 2, "eval_test": 2}})
    feedback = read_feedback()
    tables, origins = run(config, get_task(), feedback=feedback)
    assert len(tables["prefs"]) == SIZES["prefs"] + 2 and len(tables["prefs_eval"]) == SIZES["prefs_eval"]
    assert origins["prefs"] == "builtin + data/raw/feedback_prefs.jsonl (2 human feedback pairs)"
    manifest = prepare(tmp_path / "data/prepared", config, get_task(), feedback)
    prefs = pd.read_parquet(tmp_path / "data/prepared/prefs.parquet")
    assert prefs.tail(2).to_dict("records") == labelled
    written = json.loads((tmp_path / "data/prepared/manifest.json").read_text())
    assert written == manifest and written["feedback"] == {"path": "data/raw/feedback_prefs.jsonl", "rows": 2}
    assert written["rows"]["prefs"] == SIZES["prefs"] + 2

    # source: files with no preference file: the feedback pairs are prefs (and hold out some).
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "1+1\n", "completion": "answer 2"}) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "2+2\n", "answer": "4"}) + "\n")
    files = {"sft": {"path": "sft.jsonl"}, "eval_heldout": {"path": "eval.jsonl"}}
    tables, origins = run(Config(source="files", files=files, heldout_share=0.5), get_task(), feedback=feedback)
    assert len(tables["prefs"]) == 1 and len(tables["prefs_eval"]) == 1 and len(tables["unpaired"]) == 2
    assert origins["prefs"] == "data/raw/feedback_prefs.jsonl (2 human feedback pairs)"
    # Named in prepare.files too (so that check_params knows of the pairs): added once.
    files["prefs"] = {"path": str(FEEDBACK_FILE)}
    tables, _ = run(Config(source="files", files=files, heldout_share=0.5), get_task(), feedback=feedback)
    assert len(tables["prefs"]) + len(tables["prefs_eval"]) == 2


def test_the_feedback_file_is_in_git_and_a_dep_of_prepare():
    import subprocess

    import yaml

    from tests.conftest import REPO

    assert (REPO / "data/raw/feedback_prefs.jsonl").is_file()
    ignored = subprocess.run(["git", "check-ignore", "-q", "data/raw/feedback_prefs.jsonl"], cwd=REPO, check=False)
    assert ignored.returncode == 1, "git must track the feedback file"
    prepare = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["prepare"]
    # The folder is the dep (DVC warns at every run about an empty file listed as a dep).
    assert "data/raw" in prepare["deps"]


# ----------------------------------------------------------------------------- a real browser


@pytest.mark.slow
def test_a_person_labels_two_pairs_in_a_headless_browser(micro_dir, tmp_path):
    from tests.browser import INSTALL_HINT, headless_chromium, missing_browser

    missing = missing_browser()
    if missing:
        pytest.skip(f"no headless browser ({', '.join(missing)} missing): {INSTALL_HINT}")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    out = tmp_path / "data/raw/feedback_prefs.jsonl"
    app = create_app(micro_dir, PROMPTS, out, max_new_tokens=16, allowed_hosts=["127.0.0.1", "localhost"])
    server, thread, url = serve_app(app)

    screenshot = tmp_path / "screenshots/labelling.png"
    screenshot.parent.mkdir()
    driver = headless_chromium(tmp_path / "chromium-profile")
    seen = []
    try:
        driver.get(f"{url}/")
        for _ in range(2):
            text = {
                name: driver.find_element(By.ID, name).get_property("textContent")
                for name in ("prompt", "completion-a", "completion-b")
            }
            seen.append({"prompt": text["prompt"], "chosen": text["completion-a"], "rejected": text["completion-b"]})
            pair = driver.find_element(By.NAME, "pair").get_attribute("value")
            driver.find_element(By.ID, "choose-a").click()
            WebDriverWait(driver, 60).until(
                lambda d: (
                    d.execute_script("const e = document.querySelector('input[name=pair]'); return e && e.value")
                    not in (None, pair)
                )
            )
        assert driver.find_element(By.ID, "message").text == "Saved. Here is the next pair."
        assert driver.find_element(By.ID, "count").text == "2"
        assert driver.save_screenshot(str(screenshot))
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(timeout=30)

    assert seen[0]["prompt"] != seen[1]["prompt"] and all(row["prompt"] in PROMPTS for row in seen)
    assert rows(out) == seen, "the rows hold exactly the texts the page showed"
    assert len(load_contract(out, "preference")) == 2
    assert screenshot.stat().st_size > 0
    print(f"screenshot: {screenshot}")
