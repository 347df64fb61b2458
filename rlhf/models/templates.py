"""Chat templates for base models: params `base.chat_template`.

A base model (Llama-3.2-1B, Qwen2.5-0.5B, Mistral-7B-v0.1...) often has no chat template,
and conversational data (messages) then cannot be trained or sampled. `base.chat_template`
gives it one, as TRL's `clone_chat_template` and Axolotl's `chat_template` do:

* `chatml`: ChatML (`<|im_start|>role\\n...<|im_end|>`), the template of this package;
* the name of a template TRL ships (trl/chat_templates: llama3, qwen2_5, gemma, phi3, ...;
  the `_training` variant when there is one, whose `{% generation %}` markers let TRL
  train on the assistant's turns only);
* or the path of a Jinja file of your own.

Stage base puts it on the base model's tokenizer. Tokens the template writes that the
vocabulary lacks (ChatML's on a Llama base) are added as special tokens and the model's
embeddings resized (new rows at the mean of the old, transformers' default), which makes
models/base a copy of the model rather than a pointer to it. The end-of-turn token the
template writes becomes the tokenizer's EOS, so generation stops at the end of a turn.
Every model saved after that carries the template (`chat_template.jinja`).

Light on purpose: no import of TRL (its template folder is found from its install path).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

OWN = Path(__file__).with_name("chat_templates")
# The tokens that end a turn in the templates people use, in the order they are looked for.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>")
# Special-token literals a template writes: <|...|> and <word_word> (Gemma's <start_of_turn>).
_LITERAL = re.compile(r"""['"](<\|[^'"|<>]+\|>|<[a-z_]+>)""")


def trl_templates_dir() -> Path | None:
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "chat_templates"


def named_templates() -> dict[str, Path]:
    """Template name -> file: this package's, then TRL's (the training variant preferred)."""
    found = {path.stem: path for path in sorted(OWN.glob("*.jinja"))}
    folder = trl_templates_dir()
    if folder is not None and folder.is_dir():
        for path in sorted(folder.glob("*.jinja")):
            name = path.stem.removesuffix("_training")
            training = folder / f"{name}_training.jinja"
            found.setdefault(name, training if training.is_file() else path)
    return found


def template_problem(value: str) -> str | None:
    """Why `value` (base.chat_template) names no template, or None."""
    if value in named_templates() or Path(value).is_file():
        return None
    if value.endswith((".jinja", ".j2")) or "/" in value:
        return f"{value} does not exist (a Jinja file of a chat template)"
    names = ", ".join(sorted(named_templates()))
    return f"unknown chat template {value!r}: name one of {names}, or give a .jinja file"


def read_template(value: str) -> str:
    """The Jinja text of the template `value` names (a name, or a file)."""
    return (named_templates().get(value) or Path(value)).read_text()


def template_tokens(template: str) -> list[str]:
    """The special-token literals `template` writes, in order of first appearance."""
    return list(dict.fromkeys(_LITERAL.findall(template)))


def end_of_turn(template: str) -> str | None:
    """The token that ends a turn in `template` (END_OF_TURN's first it writes), or None."""
    written = template_tokens(template)
    return next((token for token in END_OF_TURN if token in written), None)


def apply_template(tokenizer, template: str) -> list[str]:
    """Put `template` on `tokenizer`: its chat template, the special tokens it writes that
    the vocabulary lacks (added), and its end-of-turn token as EOS. Returns the added
    tokens (the model's embeddings must grow to len(tokenizer) when there are any)."""
    vocab = tokenizer.get_vocab()
    added = [token for token in template_tokens(template) if token not in vocab]
    if added:
        tokenizer.add_tokens(added, special_tokens=True)
    tokenizer.chat_template = template
    if (end := end_of_turn(template)) is not None:
        tokenizer.eos_token = end
    return added
