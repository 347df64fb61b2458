"""The labelling page: two completions of one model for a prompt, side by side; the person's
choice is appended to a preference file as ``{"prompt", "chosen", "rejected"}``.

Our own code, where no maintained tool fits: labelling tools (Label Studio, Argilla, ...)
are servers with their own database, accounts and export step, and none samples from a
local model folder; this is one small FastAPI app, meant to be bound to 127.0.0.1, that
samples from the project's loader and generator (`rlhf.models`) and writes the project's
preference contract (`rlhf.data.contracts`) straight into the JSONL file the caller names
(the pipeline's is data/raw/feedback_prefs.jsonl, which stage prepare adds to prefs).

* Each pair is sampled once (`n` samples of the prompt, of which the first two that are
  non-empty and differ are shown as A and B; a prompt without such two after `max_tries`
  rounds is passed over, never shown). Prompts already in the file are not asked again.
* A choice is validated by the preference contract before anything is written: a row the
  contract refuses (chosen identical to rejected, an empty completion) is not saved and the
  page says why. A row is appended as one line, flushed and fsynced, so a crash leaves every
  earlier row whole; an existing file is validated when the app starts.
* The page is plain server-rendered HTML with one form per pair (no build step; a few lines
  of script add the keys a, b and s). The form names the pair by a random id, never by its
  texts: what is saved is what the server showed, a stale or repeated submit (the back
  button, a double click) saves nothing, and a page of another site cannot post a label it
  has not seen. `allowed_hosts` turns away requests for other host names (DNS rebinding).
* Hardened as a page on 127.0.0.1 must be, since any site the person visits can post to
  it: every reply is escaped; a Content-Security-Policy allows only the page's own inline
  style and key script, no framing (`frame-ancestors 'none'`) and forms posted to itself;
  a POST whose Origin is another site's is refused (403), as is one without the token of a
  page this app rendered (each render issues one, used once), or a body over 4 KB (413);
  a second answer to one pair gets 409. `access_token` (required by `rlhf label` when the
  page is bound beyond loopback) makes every request carry a secret first given in the
  address (`?token=...`, then kept in a same-site cookie).
* An append lands whole or not at all: a failed write (a full disk) is cut back to the
  file's size before it, under the lock; a prompt another page labelled meanwhile is not
  written twice (409).
* ``GET /api/count``: how many labels the file holds, and how many prompts are left.
* A file holds one format: prompts and rows of the other kind (messages for text, or a
  file of chosen/rejected conversations without a prompt column) are refused when the app
  starts. Two pages on one file (two people labelling) append under an exclusive lock and
  skip the prompts the other has labelled.

    app = create_app("models/champion", prompts, "data/raw/feedback_prefs.jsonl")
    uvicorn.run(app, host="127.0.0.1", port=8765)
"""

from __future__ import annotations

import html
import json
import os
import random
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

CHOICES = ("a", "b", "skip")
NOTES = {
    "saved": "Saved. Here is the next pair.",
    "skipped": "Skipped: nothing saved.",
    "stale": "That pair was already answered (or the page was old): nothing saved. Here is the current pair.",
}


class AlreadyLabelledError(RuntimeError):
    """The prompt of a row was labelled (by another page) since this page showed it."""


class OutsideProjectError(ValueError):
    """A preference file path outside the project's directory."""


def check_out_path(out: str | Path, root: str | Path) -> Path:
    """`out` resolved (symbolic links too); an OutsideProjectError unless it lies under
    `root`, and a ValueError unless it is a .jsonl file."""
    root = Path(root).resolve()
    path = (root / out).resolve()  # an absolute `out` stays as it is
    if not path.is_relative_to(root):
        raise OutsideProjectError(f"{out} is outside the project directory {root}")
    if path.suffix != ".jsonl":
        raise ValueError(f"{out}: the preference file must be a .jsonl file")
    return path


def plain_prompt(prompt):
    """A prompt as plain Python: text, or a list of {"role", "content"} messages (a Parquet
    list column reads as arrays)."""
    if isinstance(prompt, str):
        return prompt
    items = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in items]


def prompt_key(prompt) -> str:
    from rlhf.data.contracts import prompt_key as key

    return key(plain_prompt(prompt))


def preference_row(prompt, chosen: str, rejected: str) -> dict:
    """One row of the preference contract: text replies for a text prompt, assistant
    messages for a conversational one (TRL's two formats)."""
    prompt = plain_prompt(prompt)
    if isinstance(prompt, str):
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def prompt_kind(prompt) -> str:
    return "text" if isinstance(prompt, str) else "messages"


class PreferenceFile:
    """A JSONL preference file that only grows by validated, fsynced rows of one format
    (the file's first row's: text or messages prompts, an explicit prompt column). Another
    process may append to it too (a second labelling page): `refresh` reads what it added,
    and each append holds an exclusive lock on the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.rows = 0
        self.prompts: set[str] = set()
        self.kind: str | None = None  # "text" or "messages": the prompts of the rows so far
        self._read = 0  # bytes of the file read so far
        self._closed = True  # the file ends with a newline (or is empty): a row can follow
        self.refresh(validate=True)

    def refresh(self, validate: bool = False) -> None:
        """Read the rows appended since the last read (by this process or another); with
        `validate`, check the whole file by the preference contract first (a bad file fails
        here, naming row and field, and a file without a prompt column, or whose prompts
        are not all of one kind, cannot take the page's rows)."""
        from rlhf.data.contracts import DataValidationError, load_contract

        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        self._closed = not data or data.endswith(b"\n")
        if validate and data.strip():
            load_contract(self.path, "preference")
        # Whole lines only (another page may be writing one now), but all of a file checked
        # whole (one edited by hand may lack a final newline).
        end = len(data) if validate else data.rfind(b"\n") + 1
        new, self._read = data[self._read : max(end, self._read)], max(end, self._read)
        for line in new.decode("utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                if "prompt" not in row:
                    raise DataValidationError(
                        self.path,
                        ["its rows have no prompt field (chosen and rejected conversations); the page appends "
                         "prompt, chosen, rejected rows: label into another file"],
                    )  # fmt: skip
                prompt = row["prompt"]
                self.rows += 1
                self.prompts.add(prompt_key(prompt))
                self.kind = self.kind or prompt_kind(prompt)

    def check_kind(self, prompt, what: str) -> None:
        """A DataValidationError unless `prompt` is of the file's kind (text or messages)."""
        from rlhf.data.contracts import DataValidationError

        if self.kind is not None and prompt_kind(prompt) != self.kind:
            raise DataValidationError(
                self.path,
                [f"its rows have {self.kind} prompts, and {what}: {prompt_kind(prompt)}; a preference file "
                 "holds one format: label into another file"],
            )  # fmt: skip

    def append(self, row: dict) -> None:
        """Validate `row` by the preference contract and the file's format, then append it
        as one line under an exclusive lock (raises `DataValidationError`, writing nothing,
        when either refuses it)."""
        import fcntl

        import pandas as pd

        from rlhf.data.contracts import validate_contract

        frame = pd.DataFrame({key: pd.Series([value], dtype=object) for key, value in row.items()})
        validate_contract(frame, "preference", self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab", buffering=0) as file:  # unbuffered: nothing left to flush at close
            fcntl.flock(file, fcntl.LOCK_EX)  # one writer at a time; released on close
            self.refresh()  # what another page appended meanwhile
            self.check_kind(row["prompt"], "this row")
            if prompt_key(row["prompt"]) in self.prompts:
                raise AlreadyLabelledError(f"{self.path}: this prompt was labelled meanwhile (another page)")
            line = json.dumps(row, ensure_ascii=False) + "\n"
            if not self._closed:  # edited by hand, no final newline
                line = "\n" + line
            size = os.fstat(file.fileno()).st_size
            data = memoryview(line.encode("utf-8"))
            try:
                while data:  # a write may land in part
                    data = data[os.write(file.fileno(), data) :]
                os.fsync(file.fileno())
            except OSError:  # a full disk, a quota: the file as it was, not half a line
                os.ftruncate(file.fileno(), size)
                raise
        self.refresh()


@dataclass
class Pair:
    id: str
    prompt: object
    a: str
    b: str
    answer: str | None = None


class LabellingSession:
    """The queue of prompts, the pair on show, and what a choice does with it. Thread-safe:
    FastAPI runs the handlers on a thread pool."""

    def __init__(
        self,
        sampler: Callable[[object, int], list[str]],
        prompts: Sequence,
        out: PreferenceFile,
        answers: Sequence | None = None,
        seed: int = 0,
        max_tries: int = 3,
    ):
        self.sampler = sampler
        self.out = out
        self.seed = seed
        self.max_tries = max_tries
        answers = list(answers) if answers is not None else [None] * len(prompts)
        order = list(range(len(prompts)))
        random.Random(seed).shuffle(order)
        queued = dict.fromkeys(out.prompts)  # each prompt once, and none already in the file
        self.queue = []
        for i in order:
            key = prompt_key(prompts[i])
            if key not in queued:
                queued[key] = None
                self.queue.append((plain_prompt(prompts[i]), answers[i]))
        self.current: Pair | None = None
        self.skipped = 0  # by the person
        self.passed_over = 0  # no two distinct, non-empty completions
        self._draws = 0
        self.lock = threading.RLock()

    def pair(self) -> Pair | None:
        """The pair on show, sampling the next one when there is none; None when no prompt
        is left."""
        with self.lock:
            if self.current is None:
                self.out.refresh()  # another page on the same file may have labelled some
            while self.current is None and self.queue:
                prompt, answer = self.queue.pop(0)
                if prompt_key(prompt) in self.out.prompts:
                    continue
                for _ in range(self.max_tries):
                    self._draws += 1
                    shown = distinct_two(self.sampler(prompt, self.seed + self._draws))
                    if shown:
                        answer = None if answer is None else str(answer)
                        self.current = Pair(secrets.token_hex(16), prompt, *shown, answer=answer)
                        break
                else:
                    self.passed_over += 1
            return self.current

    def choose(self, pair_id: str, choice: str) -> tuple[int, str]:
        """Apply `choice` (a, b or skip) to the pair `pair_id`: (HTTP status, note or message)."""
        from rlhf.data.contracts import DataValidationError

        with self.lock:
            pair = self.current
            if pair is None or not secrets.compare_digest(pair_id.encode(), pair.id.encode()):
                return 409, "stale"
            self.current = None  # answered, saved or not: the next request shows the next pair
            if choice == "skip":
                self.skipped += 1
                return 200, "skipped"
            chosen, rejected = (pair.a, pair.b) if choice == "a" else (pair.b, pair.a)
            try:
                self.out.append(preference_row(pair.prompt, chosen, rejected))
            except DataValidationError as error:
                return 422, "Not saved: " + "; ".join(error.problems) + "."
            except AlreadyLabelledError:
                return 409, "Not saved: another page labelled this prompt meanwhile. Here is the next pair."
            except OSError as error:
                return (
                    507,
                    f"Not saved: the file could not be written ({error.strerror or error}); nothing was changed.",
                )
            return 200, "saved"

    def counts(self) -> dict:
        with self.lock:
            return {
                "labels": self.out.rows,
                "path": str(self.out.path),
                "skipped": self.skipped,
                "passed_over": self.passed_over,
                "remaining": len(self.queue) + (self.current is not None),
            }


def distinct_two(completions: Sequence[str]) -> tuple[str, str] | None:
    """The first two completions that are non-empty and differ, or None."""
    first = None
    for text in completions:
        if not text.strip():
            continue
        if first is None:
            first = text
        elif text != first:
            return first, text
    return None


def model_sampler(model, tokenizer, n: int, max_new_tokens: int, temperature: float):
    """`n` sampled completions of one prompt, seeded, from a loaded model."""
    from rlhf.models.generation import sample

    def draw(prompt, seed: int) -> list[str]:
        return sample(model, tokenizer, [prompt], n, max_new_tokens, temperature, batch_size=n, seed=seed)[0]

    return draw


# ----------------------------------------------------------------------------- the page

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; }
pre { white-space: pre-wrap; word-break: break-word; background: #f6f6f6; padding: .75rem;
      border-radius: .4rem; margin: .25rem 0 1rem; min-height: 1.5rem; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
.buttons { display: flex; gap: .75rem; margin-top: 1rem; }
button { font-size: 1rem; padding: .5rem 1.25rem; cursor: pointer; }
.note { padding: .5rem .75rem; border-radius: .4rem; background: #eef6ee; }
.note.error { background: #fbeaea; color: #8a1c1c; }
.muted { color: #666; font-size: .9rem; }
"""

KEYS = """
document.addEventListener("keydown", (event) => {
  const button = {a: "choose-a", b: "choose-b", s: "skip"}[event.key];
  if (button && !event.ctrlKey && !event.metaKey && !event.altKey) document.getElementById(button).click();
});
"""


def _show_prompt(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _source_hash(text: str) -> str:
    """A CSP source for an inline script or style: the sha256 of its exact text."""
    import base64
    import hashlib

    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# Only the page's own inline style and key script run; no framing; forms post to the page.
CSP = (
    f"default-src 'none'; style-src {_source_hash(STYLE)}; script-src {_source_hash(KEYS)}; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # no-referrer would make the browser post `Origin: null`
}
MAX_BODY = 4096  # bytes of a POST: a form of two short fields and a token
TOKEN_COOKIE = "rlhf_label_token"


class PageTokens:
    """One token per rendered page, each taken once by the POST of its form: a page of
    another site cannot post a choice without a page this app rendered for the person."""

    def __init__(self, keep: int = 256):
        from collections import OrderedDict

        self.issued: OrderedDict[str, None] = OrderedDict()
        self.keep = keep
        self.lock = threading.Lock()

    def issue(self) -> str:
        token = secrets.token_urlsafe(24)
        with self.lock:
            self.issued[token] = None
            while len(self.issued) > self.keep:
                self.issued.popitem(last=False)
        return token

    def take(self, token: str) -> bool:
        with self.lock:
            return self.issued.pop(token, False) is None


def render(
    session: LabellingSession,
    title: str,
    model: str,
    note: str | None = None,
    error: bool = False,
    token: str = "",
) -> str:
    pair = session.pair()
    counts = session.counts()
    esc = html.escape
    parts = [f'<div id="message" class="note{" error" if error else ""}">{esc(note)}</div>' if note else ""]
    if pair is None:
        parts.append(
            '<p id="done">No prompts left to label: close this page. '
            "The next <code>dvc repro</code> trains on the pairs.</p>"
        )
    else:
        answer = f' <span class="muted">(reference answer: {esc(pair.answer)})</span>' if pair.answer else ""
        # A newline after <pre> is dropped by the HTML parser: with one always there, a text
        # that starts with a newline keeps it.
        parts.append(
            f"""<h2>Prompt{answer}</h2>
<pre id="prompt">\n{esc(_show_prompt(pair.prompt))}</pre>
<div class="pair">
  <div><h2>A</h2><pre id="completion-a">\n{esc(pair.a)}</pre></div>
  <div><h2>B</h2><pre id="completion-b">\n{esc(pair.b)}</pre></div>
</div>
<form method="post" action="/choose">
  <input type="hidden" name="pair" value="{esc(pair.id)}">
  <input type="hidden" name="token" value="{esc(token)}">
  <div class="buttons">
    <button id="choose-a" type="submit" name="choice" value="a">A is better</button>
    <button id="choose-b" type="submit" name="choice" value="b">B is better</button>
    <button id="skip" type="submit" name="choice" value="skip">Skip</button>
  </div>
</form>
<p class="muted">Keys: a, b, s.</p>"""
        )
    parts.append(
        f'<p class="muted"><span id="count">{counts["labels"]}</span> labels in {esc(counts["path"])}; '
        f"{counts['remaining']} prompts left. Completions of {esc(model)}.</p>"
    )
    body = "\n".join(p for p in parts if p)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>{STYLE}</style></head>
<body><h1>{esc(title)}</h1>
{body}
<script>{KEYS}</script>
</body></html>"""


def create_app(
    model_dir: str | Path,
    prompts: Sequence,
    out_path: str | Path,
    *,
    answers: Sequence | None = None,
    n: int = 2,
    max_new_tokens: int = 64,
    temperature: float = 0.7,
    seed: int = 0,
    max_tries: int = 3,
    trust_remote_code: bool = False,
    allowed_hosts: Sequence[str] | None = None,
    access_token: str | None = None,
    title: str = "Which reply is better?",
):
    """The labelling app for the model in `model_dir` over `prompts` (text, or lists of
    messages; `answers`, when given, are shown as reference answers), appending to the JSONL
    file `out_path`. The model is loaded, and an existing file validated, here: a bad folder
    or file fails before the server starts. `app.state.session` is the LabellingSession."""
    from rlhf.models.folders import check_model_dir, resolve_model_dir
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    if n < 2:
        raise ValueError(f"n must be at least 2 (two completions are compared), got {n}")
    if not len(prompts):
        raise ValueError("no prompts to label")
    check_model_dir(resolve_model_dir(model_dir), "model to label")  # before transformers looks on the Hub
    out = PreferenceFile(out_path)
    out.check_kind(plain_prompt(prompts[0]), "the prompts to label")
    tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    model = load_causal_lm(model_dir, trust_remote_code=trust_remote_code, what="model to label")
    sampler = model_sampler(model, tokenizer, n, max_new_tokens, temperature)
    session = LabellingSession(sampler, prompts, out, answers=answers, seed=seed, max_tries=max_tries)
    model_name = Path(model_dir).as_posix()

    app = FastAPI(title="rlhf labelling page", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.session = session
    tokens = app.state.tokens = PageTokens()
    no_store = {"Cache-Control": "no-store"}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """The access token (when set), the Origin of a POST, its size; then the security
        headers on every reply."""
        refused = refusal(request, access_token)
        response = refused or await call_next(request)
        if access_token and not refused and request.query_params.get("token"):
            response.set_cookie(TOKEN_COOKIE, access_token, httponly=True, samesite="strict")
        response.headers.update(SECURITY_HEADERS)
        return response

    if allowed_hosts:  # outermost: a request for another host name is turned away first
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))

    def page_html(note: str | None, error: bool = False) -> str:
        return render(session, title, model_name, note, error, tokens.issue())

    @app.get("/", response_class=HTMLResponse)
    def page(note: str | None = None) -> HTMLResponse:
        return HTMLResponse(page_html(NOTES.get(note or "")), headers=no_store)

    @app.post("/choose")
    async def choose(request: Request):
        # The form is parsed here: FastAPI's Form() needs python-multipart, for three fields.
        body = await bounded_body(request, MAX_BODY)
        if body is None:
            return plain(413, f"a choice is a small form; this request has more than {MAX_BODY} bytes")
        fields = parse_qs(body.decode("utf-8", "replace"))
        pair_id, choice = fields.get("pair", [""])[0], fields.get("choice", [""])[0]
        if not tokens.take(fields.get("token", [""])[0]):
            return plain(403, "this form was not rendered by this page (or was posted already): reload the page")
        if choice not in CHOICES:
            return plain(400, f"unknown choice {choice[:40]!r}; expected one of {', '.join(CHOICES)}")
        status, note = await run_in_threadpool(session.choose, pair_id, choice)
        if status == 200:  # saved or skipped: Post/Redirect/Get, so a reload posts nothing
            return RedirectResponse(f"/?note={note}", status_code=303)
        shown = NOTES.get(note, note)
        return HTMLResponse(await run_in_threadpool(page_html, shown, True), status_code=status, headers=no_store)

    @app.get("/api/count")
    def count() -> JSONResponse:
        return JSONResponse(session.counts())

    return app


async def bounded_body(request: Request, limit: int) -> bytes | None:
    """The request's body, read a chunk at a time; None as soon as it passes `limit` bytes,
    the rest unread. The Content-Length check (`refusal`) turns a declared large body away
    first; a chunked body declares no length, and `request.body()` would read it whole."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def plain(status: int, text: str) -> HTMLResponse:
    """A short refusal, its text escaped (it may echo what the request sent)."""
    return HTMLResponse(f"<!doctype html><p>{html.escape(text)}</p>", status_code=status)


def refusal(request: Request, access_token: str | None):
    """Why a request is refused, as the reply; None when it may go on. With `access_token`,
    the token must come in the address (`?token=`) or the cookie set from it. A POST must
    come from this page's own origin (a browser sends the Origin of the page that posts)
    and be small."""
    if access_token:
        given = request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE) or ""
        if not secrets.compare_digest(given.encode(), access_token.encode()):
            return plain(401, "this labelling page needs its access token: open the address `rlhf label` printed")
    if request.method == "POST":
        origin = request.headers.get("origin")
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        if origin is not None and origin != own:
            return plain(403, f"a choice is posted by the labelling page itself, not by {origin}")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY:
            return plain(413, f"a choice is a small form; this request has {length} bytes")
    return None
