"""The labelling page as a page on 127.0.0.1 that any site the person visits can post to:
escaped replies, a Content-Security-Policy without framing, POSTs only from its own origin,
with a token of a page it rendered, and small; one answer per pair; an access token beyond
loopback; appends that land whole or not at all; prepare reading the file under a lock.

An HTTP client (httpx) against the app served by uvicorn on 127.0.0.1, and a headless
browser for the cross-site form post."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlhf.feedback.app import LabellingSession, PreferenceFile, create_app
from tests.conftest import serve_app

PROMPTS = ["12+7\n", "3+4+5\n", "20-6\n", "9+9\n"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def page(micro_dir, tmp_path):
    out = tmp_path / "data/raw/feedback_prefs.jsonl"
    app = create_app(micro_dir, PROMPTS, out, max_new_tokens=12, allowed_hosts=["127.0.0.1", "localhost"])
    server, thread, url = serve_app(app)
    with httpx.Client(base_url=url) as client:
        yield client, out, app
    server.should_exit = True
    thread.join(10)


def form(client) -> dict:
    text = client.get("/").text
    return {name: re.search(rf'name="{name}" value="([\w-]+)"', text).group(1) for name in ("pair", "token")}


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_replies_are_escaped_and_carry_a_policy_that_forbids_framing(page):
    client, out, _ = page
    reply = client.get("/")
    policy = reply.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "default-src 'none'" in policy and "form-action 'self'" in policy
    assert reply.headers["x-frame-options"] == "DENY" and reply.headers["x-content-type-options"] == "nosniff"
    hostile = "<script>alert(document.domain)</script>"
    refused = client.post("/choose", data={**form(client), "choice": hostile})
    assert refused.status_code == 400
    assert "<script>" not in refused.text and "&lt;script&gt;" in refused.text
    assert refused.headers["content-security-policy"] == policy and not lines(out)


def test_a_post_from_another_origin_or_without_a_rendered_token_is_refused(page):
    client, out, _ = page
    fields = {**form(client), "choice": "a"}
    other = client.post("/choose", data=fields, headers={"Origin": "http://evil.example"})
    assert other.status_code == 403 and not lines(out)
    forged = client.post("/choose", data={**fields, "token": "guessed"})
    assert forged.status_code == 403 and not lines(out)
    own = client.post("/choose", data=fields, headers={"Origin": str(client.base_url).rstrip("/")})
    assert own.status_code == 303 and len(lines(out)) == 1
    again = client.post("/choose", data=fields)
    assert again.status_code == 403 and len(lines(out)) == 1, "a token is taken once"


def test_a_large_request_is_refused_before_it_is_read(page):
    client, out, _ = page
    big = client.post("/choose", data={**form(client), "choice": "a", "pad": "x" * 10_000})
    assert big.status_code == 413 and not lines(out)


def test_a_chunked_body_is_refused_at_the_limit_not_read_whole(page):
    """A body sent in chunks declares no Content-Length: the page read it whole before its
    413 (a 200 MB post grew the server by 401 MiB). Here the body never ends: the 413 must
    come once the limit is passed, while the client is still sending."""
    import socket

    client, out, _ = page
    host, port = client.base_url.host, client.base_url.port
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(f"POST /choose HTTP/1.1\r\nHost: {host}:{port}\r\nTransfer-Encoding: chunked\r\n"
                     "Content-Type: application/x-www-form-urlencoded\r\n\r\n".encode())  # fmt: skip
        chunk = b"x" * 1024
        for _ in range(64):  # 64 KB, and no final chunk
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        reply = conn.recv(4096).decode("latin-1")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert not lines(out)


def test_a_second_answer_to_one_pair_gets_409(page):
    client, out, _ = page
    fields = form(client)
    assert client.post("/choose", data={**fields, "choice": "a"}).status_code == 303
    second = client.post("/choose", data={"pair": fields["pair"], "choice": "b", "token": form(client)["token"]})
    assert second.status_code == 409 and len(lines(out)) == 1


def test_two_pages_showing_one_prompt_save_it_once(tmp_path):
    """Both pages drew the same prompt before either answered: the second answer finds the
    prompt in the file, under the lock, and is not written (409)."""
    path = tmp_path / "prefs.jsonl"
    first = LabellingSession(lambda prompt, seed: ["x", "y"], PROMPTS[:1], PreferenceFile(path))
    second = LabellingSession(lambda prompt, seed: ["x", "y"], PROMPTS[:1], PreferenceFile(path))
    a, b = first.pair(), second.pair()
    assert a.prompt == b.prompt
    assert first.choose(a.id, "a") == (200, "saved")
    status, note = second.choose(b.id, "b")
    assert status == 409 and "another page" in note and len(lines(path)) == 1


def test_beyond_loopback_every_request_needs_the_access_token(micro_dir, tmp_path):
    out = tmp_path / "prefs.jsonl"
    app = create_app(micro_dir, PROMPTS, out, max_new_tokens=12, access_token="s3cret-token")
    server, thread, url = serve_app(app)
    try:
        with httpx.Client(base_url=url) as client:
            assert client.get("/").status_code == 401 and client.get("/api/count").status_code == 401
            assert client.get("/?token=wrong").status_code == 401
            opened = client.get("/?token=s3cret-token")
            assert opened.status_code == 200 and "rlhf_label_token" in opened.headers["set-cookie"]
            assert "samesite=strict" in opened.headers["set-cookie"].lower()
            assert client.get("/api/count").status_code == 200, "the cookie carries it from then on"
            fields = {name: re.search(rf'name="{name}" value="([\w-]+)"', opened.text).group(1)
                      for name in ("pair", "token")}  # fmt: skip
            assert client.post("/choose", data={**fields, "choice": "a"}).status_code == 303
        with httpx.Client(base_url=url) as stranger:
            assert stranger.post("/choose", data={**fields, "choice": "b"}).status_code == 401
    finally:
        server.should_exit = True
        thread.join(10)


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from rlhf.feedback.app import PreferenceFile
path = Path(sys.argv[1])
out = PreferenceFile(path)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, resource.RLIM_INFINITY))
try:
    out.append({"prompt": "9+9\\n", "chosen": "answer 18 " + "x" * 100, "rejected": "answer 17"})
except OSError as error:
    print("failed:", error.errno)
"""


def test_an_append_that_fails_halfway_leaves_the_file_as_it_was(tmp_path):
    """A write that fails after part of its line (here the file-size limit, as a full disk
    would) is cut back: the file holds its earlier rows whole, and reads."""
    from rlhf.data.contracts import load_contract

    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "1+1\n", "chosen": "answer 2", "rejected": "answer 3"}) + "\n")
    before = path.read_bytes()
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], cwd=REPO, capture_output=True, text=True)
    assert "failed: 27" in done.stdout, done.stderr[-2000:]  # EFBIG
    assert path.read_bytes() == before
    assert len(load_contract(path, "preference")) == 1


def test_prepare_reads_the_feedback_file_under_a_shared_lock(tmp_path, monkeypatch):
    """The page appends under an exclusive lock: prepare waits for it, and a file changed
    while prepare read it (by a writer that takes no lock) fails, naming it."""
    import fcntl

    import rlhf.data.preparation as prepare
    from rlhf.data.contracts import DataValidationError

    path = tmp_path / "feedback_prefs.jsonl"
    row = {"prompt": "1+1\n", "chosen": "answer 2", "rejected": "answer 3"}
    path.write_text(json.dumps(row) + "\n")
    holder = open(path, "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(0.5, holder.close).start()  # the page's append ends: the lock is released
    start = time.monotonic()
    assert len(prepare.read_feedback(path)) == 1
    assert time.monotonic() - start >= 0.45, "prepare waited for the append"

    original = prepare.load_contract_of_feedback

    def read_while_written(source):
        frame = original(source)
        with open(source, "a") as file:  # a hand edit during the read, without the lock
            file.write(json.dumps({**row, "prompt": "2+2\n"}) + "\n")
        return frame

    monkeypatch.setattr(prepare, "load_contract_of_feedback", read_while_written)
    with pytest.raises(DataValidationError, match="changed while prepare read it"):
        prepare.read_feedback(path)


@pytest.mark.slow
def test_a_form_on_another_site_cannot_post_a_label_in_a_browser(page, tmp_path):
    """A page of another origin (another port of 127.0.0.1) posts a choice to the labelling
    page when it loads, as a hostile site would: the browser sends its Origin, and nothing
    is saved."""
    from tests.browser import INSTALL_HINT, headless_chromium, missing_browser

    missing = missing_browser()
    if missing:
        pytest.skip(f"no headless browser ({', '.join(missing)} missing): {INSTALL_HINT}")
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    client, out, _ = page
    fields = form(client)  # even with a real pair id and token
    target = str(client.base_url).rstrip("/")
    hostile = FastAPI()

    @hostile.get("/")
    def attack() -> HTMLResponse:
        inputs = "".join(f'<input name="{k}" value="{v}">' for k, v in {**fields, "choice": "a"}.items())
        return HTMLResponse(f'<form id="f" method="post" action="{target}/choose">{inputs}</form>'
                            "<script>document.getElementById('f').submit()</script>")  # fmt: skip

    server, thread, url = serve_app(hostile)
    driver = headless_chromium(tmp_path / "profile")
    try:
        driver.get(url + "/")
        deadline = time.monotonic() + 20
        while target not in driver.current_url and time.monotonic() < deadline:
            time.sleep(0.1)
        assert target in driver.current_url, "the form was posted"
        assert "not by http://127.0.0.1" in driver.page_source
        assert not lines(out)
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(10)
