"""Chat templates: a conversation -> the text a model reads, and which of its tokens are trained.

A tokenizer folder from the Hugging Face Hub carries its model's template (`chat_template` in
tokenizer_config.json, or chat_template.jinja). It is rendered here as transformers'
`apply_chat_template` renders it: a sandboxed jinja2 environment with `trim_blocks` and
`lstrip_blocks`, the loop-control extension, the `{% generation %}` block, the `tojson` filter,
the `raise_exception`, `strftime_now`, `dict` and `namespace` globals, and the tokenizer's
special tokens (bos_token, eos_token, ...) as variables. The rendered text is tokenized whole,
as transformers tokenizes it, so the ids are the ones the model saw in its own fine-tuning.

A tokenizer without a template (the byte tokenizer, a BPE trained by `fourfold prepare`, a base
model's) gets DEFAULT_TEMPLATE:

    <|system|>
    You are terse.
    <|user|>
    What is 2 + 2?
    <|assistant|>
    4<|endoftext|>

each turn a role line, its content and a newline; an assistant turn ends with the end-of-text
token instead of the newline, which is where generation stops. The markers are plain text (a
byte tokenizer has no special tokens besides end-of-text).

Which tokens are trained: those of the spans a template marks with `{% generation %}` (the
default template marks each assistant turn's content and its end token), as transformers'
`return_assistant_tokens_mask` finds them. A template without such blocks has its assistant
spans found by rendering the conversation up to each assistant turn with the generation prompt
and up to its end: the span is what the model writes after the prompt, the end-of-turn mark
included. A token is trained when it overlaps a span.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fourfold.data.errors import DataError
from fourfold.data.tokenizers import (BPE_EOS, HF_FILE, META_FILE, ByteTokenizer, HFTokenizer,
                                      Tokenizer)
from fourfold.files import atomic_write_text

DEFAULT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] }}\n"
    "{% endif %}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "<|assistant|>\n"
    "{% endif %}"
)
# the file a prepared DATA_DIR keeps its template in (chat and instruct data)
TEMPLATE_FILE = "chat_template.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_TEMPLATE_FILE = "chat_template.jinja"
# transformers' named special tokens, which a template reads as variables
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class TemplateError(DataError):
    """A conversation the template cannot render, or renders inconsistently (one record's
    problem: prepare skips the record and names it)."""


Message = dict[str, Any]


@dataclass(frozen=True)
class Rendered:
    """A conversation's text and the character spans [start, end) that are trained."""

    text: str
    spans: tuple[tuple[int, int], ...]


@dataclass
class ChatTemplate:
    """A jinja chat template with the special tokens it is rendered with.

    `source`: "tokenizer" (the tokenizer folder's own) or "default" (DEFAULT_TEMPLATE)."""

    template: str
    special_tokens: dict[str, str]
    source: str
    _compiled: Any = field(default=None, repr=False, compare=False)
    _tracker: Any = field(default=None, repr=False, compare=False)

    # ---- rendering ------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation as text (what transformers' apply_chat_template(tokenize=False)
        returns)."""
        return self._render(messages, add_generation_prompt)[0]

    def render_spans(self, messages: Sequence[Message]) -> Rendered:
        """The conversation's text and its assistant spans (see the module docstring)."""
        text, generation = self._render(messages, False)
        if generation:
            return Rendered(text, tuple(generation))
        return Rendered(text, self._assistant_spans(messages, text))

    def _render(self, messages: Sequence[Message],
                add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        compiled, tracker = self._template()
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with tracker.tracking(blocks, spans):
                for block in compiled.generate(messages=[dict(m) for m in messages], tools=None,
                                               documents=None,
                                               add_generation_prompt=add_generation_prompt,
                                               **self.special_tokens):
                    blocks.append(block)
        except TemplateError:
            raise
        except Exception as exc:  # jinja2's TemplateError, and what a template's code raises
            raise TemplateError(f"the chat template cannot render it ({_one_line(exc)})") \
                from None
        return "".join(blocks), spans

    def _assistant_spans(self, messages: Sequence[Message],
                         text: str) -> tuple[tuple[int, int], ...]:
        """The assistant spans of a template without generation blocks: for assistant turn k,
        from the end of render(messages[:k], generation prompt) to the end of
        render(messages[:k + 1]), where those are prefixes of the whole text; else the
        message's content where it appears."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            try:
                prompt = self.render(messages[:k], add_generation_prompt=True) if k else ""
                through = self.render(messages[:k + 1])
            except TemplateError:
                prompt, through = "", ""
            if (prompt and text.startswith(through) and through.startswith(prompt)
                    and len(prompt) >= cursor):
                spans.append((len(prompt), len(through)))
                cursor = len(through)
                continue
            content = message.get("content")
            start = text.find(content, cursor) if isinstance(content, str) and content else -1
            if start < 0:
                raise TemplateError(f"messages[{k}]: the chat template's text does not contain "
                                    "this assistant turn where rendering the conversation up "
                                    "to it puts it; give the template {% generation %} blocks")
            spans.append((start, start + len(content)))
            cursor = start + len(content)
        return tuple(spans)

    def _template(self) -> tuple[Any, "_GenerationTracker"]:
        if self._compiled is None:
            self._compiled, self._tracker = _compile(self.template)
        return self._compiled, self._tracker

    # ---- tokens ---------------------------------------------------------------------------

    def encode(self, tokenizer: Tokenizer, rendered: Rendered,
               train_on: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) of a rendered conversation (render_spans) and its trained mask
        (uint8, 1 where the token is trained): the assistant spans for train_on = "assistant",
        every token for "all". TemplateError when nothing would be trained."""
        ids, starts, ends = encode_with_offsets(tokenizer, rendered.text)
        if train_on == "all":
            trained = np.ones(len(ids), dtype=np.uint8)
        else:
            trained = spans_mask(starts, ends, rendered.spans)
        if not trained.any():
            raise TemplateError("no assistant turn to train (the chat template rendered no "
                                "assistant text); give it one, or prepare with --train-on all")
        return ids, trained

    def prompt_ids(self, tokenizer: Tokenizer, messages: Sequence[Message]) -> np.ndarray:
        """The ids of the conversation with the generation prompt after it: what a model
        continues with the assistant's answer (`fourfold generate --chat`)."""
        return encode_with_offsets(tokenizer, self.render(messages, True))[0]

    def end_of_turn(self) -> str:
        """The text the template puts after an assistant's answer (its end-of-turn mark, e.g.
        the end-of-text token): what generation stops at."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "\x00"}]
        try:
            text = self.render(probe)
        except TemplateError:
            return self.special_tokens.get("eos_token", "")
        tail = text[text.rfind("\x00") + 1:]
        return tail.strip() or self.special_tokens.get("eos_token", "")

    # ---- files ----------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Keep the template in a DATA_DIR (TEMPLATE_FILE)."""
        data = {"source": self.source, "template": self.template,
                "special_tokens": self.special_tokens}
        atomic_write_text(Path(directory) / TEMPLATE_FILE, json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Which template a tokenizer has


def template_for(tokenizer_spec: str, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template of the tokenizer `tokenizer_spec` names: a DATA_DIR's kept one, a
    Hugging Face folder's own (or that of the folder holding a tokenizer.json), else
    DEFAULT_TEMPLATE with this tokenizer's end-of-text token."""
    path = Path(tokenizer_spec).expanduser()
    folder = path if path.is_dir() else path.parent
    if tokenizer_spec not in ("byte",) and not tokenizer_spec.startswith("bpe:"):
        if (folder / TEMPLATE_FILE).is_file():
            return load_template(folder)
        own = _hf_template(folder, tokenizer)
        if own is not None:
            return own
    return default_template(tokenizer)


def default_template(tokenizer: Tokenizer) -> ChatTemplate:
    """DEFAULT_TEMPLATE with `tokenizer`'s end-of-text token as eos_token (and bos_token)."""
    eos = _token_text(tokenizer, tokenizer.eos_id)
    return ChatTemplate(DEFAULT_TEMPLATE, {"bos_token": eos, "eos_token": eos}, "default")


def load_template(data_dir: str | Path) -> ChatTemplate:
    """The template a prepared DATA_DIR keeps (TEMPLATE_FILE)."""
    path = Path(data_dir) / TEMPLATE_FILE
    try:
        data = json.loads(path.read_text())
        template, source = str(data["template"]), str(data["source"])
        special = {str(k): str(v) for k, v in dict(data["special_tokens"]).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: unreadable chat template ({_one_line(exc)})") from None
    return ChatTemplate(template, special, source)


def data_template(data_dir: str | Path, tokenizer: Tokenizer) -> ChatTemplate:
    """The template of a DATA_DIR's conversations: the one it keeps, DEFAULT_TEMPLATE for
    raw text."""
    if (Path(data_dir) / TEMPLATE_FILE).is_file():
        return load_template(data_dir)
    return default_template(tokenizer)


def _hf_template(folder: Path, tokenizer: Tokenizer) -> ChatTemplate | None:
    """A Hugging Face folder's template (chat_template.jinja before tokenizer_config.json's
    `chat_template`, as transformers reads them), None when it has none."""
    config: dict[str, Any] = {}
    config_path = folder / HF_TOKENIZER_CONFIG
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{config_path}: unreadable ({_one_line(exc)})") from None
        config = loaded if isinstance(loaded, dict) else {}
    template: Any = None
    if (folder / HF_TEMPLATE_FILE).is_file():
        template = (folder / HF_TEMPLATE_FILE).read_text()
    elif "chat_template" in config:
        template = config["chat_template"]
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    special: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # an AddedToken as JSON
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    special.setdefault("eos_token", _token_text(tokenizer, tokenizer.eos_id))
    _compile(template)  # a template that does not parse is the folder's problem: say so now
    return ChatTemplate(template, special, "tokenizer")


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    if isinstance(tokenizer, HFTokenizer):
        return str(tokenizer.hf.id_to_token(token_id))
    return BPE_EOS  # the byte tokenizer: its end-of-text id as transformers' export names it


# --------------------------------------------------------------------------------------------
# Tokens and masks


def encode_with_offsets(tokenizer: Tokenizer,
                        text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids of `text` (int64) and each token's character span [start, end), as the
    tokenizer (and so transformers) encodes it, special tokens in the text included. For the
    byte tokenizer BPE_EOS in the text is its end-of-text id (as in its transformers export,
    write_hf_tokenizer) and every other byte its own id."""
    if isinstance(tokenizer, HFTokenizer):
        encoding = tokenizer.hf.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int64), offsets[:, 0], offsets[:, 1]
    if not isinstance(tokenizer, ByteTokenizer):
        raise TypeError(f"cannot encode a chat with {type(tokenizer).__name__}")
    ids: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    position = 0
    for i, piece in enumerate(text.split(BPE_EOS)):
        if i:
            ids.append(np.array([tokenizer.eos_id], dtype=np.int64))
            starts.append(np.array([position]))
            ends.append(np.array([position + len(BPE_EOS)]))
            position += len(BPE_EOS)
        raw = tokenizer.encode(piece)
        widths = np.fromiter((len(c.encode("utf-8", errors="replace")) for c in piece),
                             dtype=np.int64, count=len(piece))
        char_of_byte = np.repeat(np.arange(len(piece), dtype=np.int64), widths)
        ids.append(raw)
        starts.append(position + char_of_byte)
        ends.append(position + char_of_byte + 1)
        position += len(piece)
    return (np.concatenate(ids), np.concatenate(starts).astype(np.int64),
            np.concatenate(ends).astype(np.int64))


def spans_mask(starts: np.ndarray, ends: np.ndarray,
               spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token [starts[i], ends[i]) that overlaps one of `spans` (transformers'
    rule for assistant masks), as uint8."""
    trained = np.zeros(len(starts), dtype=bool)
    for begin, end in spans:
        trained |= (ends > begin) & (starts < end)
    return trained.astype(np.uint8)


# --------------------------------------------------------------------------------------------
# The jinja environment, as transformers builds it


class _GenerationTracker:
    """Where `{% generation %}` blocks land in the rendered text, while `tracking`."""

    def __init__(self) -> None:
        self.state: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
            "fourfold_generation", default=None)

    @contextmanager
    def tracking(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
        token = self.state.set((blocks, spans))
        try:
            yield
        finally:
            self.state.reset(token)


def _compile(template: str) -> tuple[Any, _GenerationTracker]:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tracker = _GenerationTracker()

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [],
                                          body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            text = caller()
            state = tracker.state.get()
            if state is not None:
                blocks, spans = state
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot store {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(template), tracker
    except jinja2.exceptions.TemplateError as exc:
        raise DataError(f"chat template does not parse ({_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


__all__ = ["DEFAULT_TEMPLATE", "ChatTemplate", "Rendered", "TEMPLATE_FILE", "TemplateError",
           "data_template", "default_template", "encode_with_offsets", "load_template",
           "spans_mask", "template_for"]
