"""Supervised fine-tuning data: chat and prompt/completion JSONL -> token rows with a loss mask.
(Arrow / Parquet rows too, field for field: data/tables.py; data.columns renames the fields.)

`data.format = 'chat'`: one JSON object per line, `{"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]}`. With model.hf_path, a directory that has its own chat template
(chat_template.jinja, or tokenizer_config.json's `chat_template`: a string or a list of named
templates) renders each conversation with it, through transformers' apply_chat_template
(ChatTemplate, below); otherwise the default template (DEFAULT_TEMPLATE):

    <|role|>\\n{content}<end>          per message, in order

where `<end>` is the end-of-turn token: the document separator (`<|endoftext|>` of our BPE, or
model.hf_path's `eos_token_id`). The loss is on the assistant messages' content tokens and their
`<end>` only; headers and system/user messages carry none.

`data.format = 'prompt_completion'`: `{"prompt": "...", "completion": "..."}` per line, rendered
as prompt tokens, completion tokens, `<end>` (nothing inserted between them); the loss is on the
completion tokens and `<end>`.

Each segment is tokenized on its own (no BOS, add_special_tokens=False, as the text format).
Examples are packed greedily, in file order, into rows of seq_len + 1 tokens (x = row[:-1],
y = row[1:]); an example that does not fit the rest of a row starts a new one (the rest padded
with `<end>`, no loss); an example longer than a row is cut to it (counted). A token's mask bit
says whether it is a target that carries loss; an example's first token never does (it would be
predicted from the previous example's last token), and an example left without any loss token is
dropped (counted). So every row, and every micro-batch, has at least one loss token.

mask.bin holds two bits per token: LOSS (a target that carries loss) and START (an example's
first token, and the padding's: the padding is a document of its own). The chat template ends
every turn with `<end>`, so example boundaries cannot be read off the token ids: START is what
data.document_mask's positions restart at (data/loader.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shardlm.config.schema import DataConfig
from shardlm.config.fields import DATA_FORMATS, parse_columns
from shardlm.data.corpus import corpus_files, jsonl_records
from shardlm.data.tables import TABLE_SUFFIXES, iter_rows
from shardlm.errors import ConfigError
from shardlm.launch.cache_files import read_named_file, read_named_json

log = logging.getLogger("shardlm")
FORMATS = DATA_FORMATS
ROLES = ("system", "user", "assistant")
DEFAULT_TEMPLATE = "<|{role}|>\n{content}<end>"
"""The chat rendering, per message (documentation: the code builds it segment by segment)."""
IGNORE = -100
"""The target of a token that carries no loss (torch's cross_entropy ignore_index)."""
LOSS, START = 1, 2
"""mask.bin's bits: the token is a target with loss; the token starts an example (or the padding)."""


def _fail(path: Path, lineno: int, message: str) -> ConfigError:
    return ConfigError(f"{path}:{lineno}: {message}")


def _check(record: object, fmt: str, path: Path, lineno: int) -> dict:
    if not isinstance(record, dict):
        raise _fail(path, lineno, f"expected a JSON object, found {type(record).__name__}")
    if fmt == "chat":
        if "messages" not in record:
            raise _fail(path, lineno, f"no field 'messages' (found {sorted(record)}); data.format = "
                                      f"'chat' needs {{\"messages\": [{{\"role\", \"content\"}}, ...]}}")
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise _fail(path, lineno, "'messages' must be a non-empty list of {\"role\", \"content\"}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise _fail(path, lineno, f"messages[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise _fail(path, lineno, f"messages[{i}] has unknown role {m['role']!r}; "
                                          f"roles are {', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise _fail(path, lineno, f"messages[{i}].content must be a string, found "
                                          f"{type(m['content']).__name__}")
    else:
        for key in ("prompt", "completion"):
            if key not in record:
                raise _fail(path, lineno, f"no field {key!r} (found {sorted(record)}); data.format = "
                                          f"'prompt_completion' needs {{\"prompt\", \"completion\"}}")
            if not isinstance(record[key], str):
                raise _fail(path, lineno, f"{key!r} must be a string, found {type(record[key]).__name__}")
    return record


FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
          "seq2seq": ("source", "target")}
"""Each format's fields, by their default names (data.columns renames them; data/seq2seq.py
reads its pairs through _records too)."""


def _records(path: Path, fmt: str, columns: str) -> Iterator[tuple[int, int, object]]:
    """(line or row number, size in bytes, record under our field names) of a JSONL file or an
    Arrow / Parquet table (streamed: data/tables.py); data.columns says where each field is."""
    names = {key: key for key in FIELDS[fmt]}
    names.update((k, v) for k, v in parse_columns(columns).items() if k in names)
    if path.name.endswith(TABLE_SUFFIXES):
        hint = "set data.columns to the columns holding " + ", ".join(names) + \
               f" (e.g. '{next(iter(names))}=<column>')"
        for row_number, row in enumerate(iter_rows(path, list(names.values()), hint), start=1):
            # Sized as the JSONL line it would be, so data.max_bytes means the same for both.
            yield row_number, len(json.dumps(row, default=str).encode()), {k: row[v] for k, v in names.items()}
        return
    if not path.name.endswith(".jsonl"):
        raise ConfigError(f"data.format = {fmt!r} reads JSONL, Arrow or Parquet files; "
                          f"{str(path)!r} is none of them")
    renamed = any(k != v for k, v in names.items())
    for lineno, raw, record in jsonl_records(path):
        if renamed and isinstance(record, dict):
            missing = [v for v in names.values() if v not in record]
            if missing:
                raise _fail(path, lineno, f"no field {missing[0]!r} (found {sorted(record)}); "
                                          f"data.columns = {columns!r} names it")
            record = {k: record[v] for k, v in names.items()}
        yield lineno, len(raw), record


def iter_examples(cfg: DataConfig, files: list[Path]) -> Iterator[dict]:
    """The validated records of every file (JSONL, Arrow, Parquet) in order; at most
    data.max_bytes bytes of lines (whole lines) when it is set. A file with no example is an
    error naming it."""
    budget = cfg.max_bytes if cfg.max_bytes > 0 else None
    for path in files:
        found = 0
        for lineno, size, record in _records(path, cfg.format, cfg.columns):
            found += 1
            yield _check(record, cfg.format, path, lineno)
            if budget is not None:
                budget -= size
                if budget <= 0:
                    return
        if not found:
            raise ConfigError(f"{path}: no examples (the file is empty); data.format = "
                              f"{cfg.format!r} needs one example per line or row")


def segments(record: dict, fmt: str) -> list[tuple[str | None, bool]]:
    """(text, carries_loss) in order; text None stands for the end-of-turn token."""
    if fmt == "chat":
        out: list[tuple[str | None, bool]] = []
        for m in record["messages"]:
            loss = m["role"] == "assistant"
            out += [(f"<|{m['role']}|>\n", False), (m["content"], loss), (None, loss)]
        return out
    return [(record["prompt"], False), (record["completion"], True), (None, True)]


def render(record: dict, fmt: str, end: str) -> str:
    """The example as text (for training our BPE on it), `end` for the end-of-turn token."""
    return "".join(end if text is None else text for text, _ in segments(record, fmt))


def encode_example(tok: Tokenizer, record: dict, fmt: str, end_id: int) -> tuple[list[int], list[int]]:
    """Token ids and their loss bits (1 = a target that carries loss)."""
    parts = segments(record, fmt)
    texts = [text for text, _ in parts if text]
    encoded = iter(tok.encode_batch(texts, add_special_tokens=False) if texts else [])
    ids: list[int] = []
    mask: list[int] = []
    for text, loss in parts:
        if text is None:
            piece = [end_id]
        elif text:
            piece = next(encoded).ids
        else:
            continue
        ids += piece
        mask += [int(loss)] * len(piece)
    if mask:
        mask[0] = 0  # predicted from the previous example's last token: never a target
    return ids, mask


# -- the checkpoint's own chat template -------------------------------------------------------

DEFAULT_RECORD = {"source": "shardlm DEFAULT_TEMPLATE", "name": "default",
                  "sha256": hashlib.sha256(DEFAULT_TEMPLATE.encode()).hexdigest(), "assistant": "segments"}
"""What a run records (meta.json, the first JSONL record) when chats are rendered with ours."""
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    """A model directory's own Jinja chat template (transformers' format) and the special tokens
    its text refers to (`bos_token`, `eos_token`, ... from tokenizer_config.json)."""

    text: str
    source: str
    """The file it came from (and the key inside it)."""
    name: str = "default"
    """Of several named templates, the one used: transformers' 'default' (no tools are passed)."""
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def generation_markers(self) -> bool:
        """The template marks the assistant's tokens itself ({% generation %} ... {% endgeneration %})."""
        return bool(_GENERATION.search(self.text))

    def record(self) -> dict:
        return {"source": self.source, "name": self.name, "sha256": self.sha256,
                "assistant": "generation markers" if self.generation_markers else "prefixes"}


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


_DOWNLOAD_AGAIN = ("download the checkpoint's tokenizer files again (e.g. huggingface-cli download "
                   "REPO --local-dir DIR), or delete that name to train without it (shardlm's "
                   "default template where the checkpoint then has none)")


def find_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template a transformers tokenizer directory carries, found as transformers finds
    it: chat_template.jinja (and additional_chat_templates/*.jinja) first, else
    tokenizer_config.json's `chat_template`, a string or a list of {"name", "template"}. Of named
    templates, 'default'. None when the directory has none. Reads files only (no transformers)."""
    root = Path(directory)
    config_path = root / "tokenizer_config.json"
    where = f"model.hf_path {str(directory)!r}:"
    config = read_named_json(config_path, f"{where} its tokenizer config", _DOWNLOAD_AGAIN)
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ConfigError(f"{where} {config_path} is a JSON {type(config).__name__}, not an object")
    named: dict[str, tuple[str, str]] = {}  # name -> (template text, where it came from)
    # A name that exists but cannot be read (a dangling link: a hub snapshot missing its blob) is
    # an error, never skipped: skipping it would train on another template without a word.
    jinja = root / "chat_template.jinja"
    text = read_named_file(jinja, f"{where} its chat template", _DOWNLOAD_AGAIN)
    if text is not None:
        named["default"] = (text, str(jinja))
    for path in sorted((root / "additional_chat_templates").glob("*.jinja")):
        named[path.name.removesuffix(".jinja")] = (
            read_named_file(path, f"{where} its chat template", _DOWNLOAD_AGAIN) or "", str(path))
    value = config.get("chat_template") if not named else None
    if isinstance(value, str):
        named["default"] = (value, f"{config_path} chat_template")
    elif isinstance(value, list):
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ConfigError(f"model.hf_path {str(directory)!r}: {config_path} chat_template[{i}] "
                                  f"must be {{\"name\": ..., \"template\": ...}} (strings)")
            named[entry["name"]] = (entry["template"], f"{config_path} chat_template[{i}]")
    elif value is not None:
        raise ConfigError(f"model.hf_path {str(directory)!r}: {config_path} chat_template must be a "
                          f"string or a list of named templates, found {type(value).__name__}")
    if not named:
        return None
    if "default" not in named:
        raise ConfigError(f"model.hf_path {str(directory)!r} has named chat templates "
                          f"{', '.join(sorted(named))} but none named 'default', the one a "
                          f"conversation without tools renders with; name one of them 'default'")
    text, source = named["default"]
    specials = {key: _token_text(config.get(key)) for key in _SPECIAL_KEYS}
    return ChatTemplate(text, source, "default", {k: v for k, v in specials.items() if v is not None})


def template_for(fmt: str, hf_path: str) -> ChatTemplate | None:
    """The template chat data is rendered with: model.hf_path's own, if it has one (None: ours)."""
    return find_chat_template(hf_path) if fmt == "chat" and hf_path else None


class _Renderer:
    """A ChatTemplate applied through transformers' apply_chat_template, to the tokenizer the
    run uses (a copy of it: the ids are exactly the ones our `tokenizers` object gives)."""

    def __init__(self, template: ChatTemplate, tok: Tokenizer):
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise ConfigError(f"the chat template {template.source} is rendered by transformers' "
                              f"apply_chat_template, and transformers is not installed: pip install "
                              f"'shardlm[hf]' (or remove the template to use shardlm's default)") from None
        self.template, self.tok = template, tok
        # No special tokens passed to the constructor: one missing from the vocabulary would be
        # added to it. The template sees them as variables instead (bos_token, ...).
        self.hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()))

    def _apply(self, messages: list[dict], **kwargs):
        try:
            return self.hf.apply_chat_template(messages, chat_template=self.template.text,
                                               **self.template.special_tokens, **kwargs)
        except Exception as e:  # jinja2's TemplateError, raise_exception(...) in the template
            raise ConfigError(f"the chat template {self.template.source} fails on this conversation "
                              f"({type(e).__name__}: {e})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._apply(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and each assistant turn's (start, end) in it, by
        rendering prefixes: the turn is what rendering messages[:i+1] adds to messages[:i] with
        the generation prompt (the assistant's header), less the whitespace before the next turn.
        A template whose prefixes are not stable (a turn renders differently once later ones
        follow) cannot be split so: a ConfigError says so."""
        whole = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if i == 0:
                raise ConfigError(f"the chat template {self.template.source} has no {{% generation %}} "
                                  f"markers, so each assistant turn is found by rendering the messages "
                                  f"before it; this conversation starts with one: put its prompt (a "
                                  f"system or user message) first, or mark the template's assistant "
                                  f"output with {{% generation %}} ... {{% endgeneration %}}")
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = whole if i == len(messages) - 1 else self.render(messages[:i + 1])
            if not upto.startswith(prompt) or not whole.startswith(upto):
                what = ("messages[:{i}] with the generation prompt is not the start of "
                        "messages[:{j}]" if not upto.startswith(prompt) else
                        "messages[:{j}] renders differently once the later messages follow")
                raise ConfigError(f"the chat template {self.template.source} cannot be split into "
                                  f"turns: rendered, " + what.format(i=i, j=i + 1) + " (its prefixes are "
                                  f"not stable, e.g. it rewrites earlier assistant turns), so which tokens "
                                  f"are the assistant's is unknown; mark the assistant's output in the "
                                  f"template with {{% generation %}} ... {{% endgeneration %}}, or drop "
                                  f"the template from model.hf_path to use shardlm's default")
            end = len(upto.rstrip())
            if end > len(prompt):
                spans.append((len(prompt), end))
        return whole, spans

    def __call__(self, record: dict) -> tuple[list[int], list[int]]:
        messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        if self.template.generation_markers:  # the template says which tokens are the assistant's
            out = self._apply(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), [int(b) for b in out["assistant_masks"]]
        else:
            text, spans = self.assistant_spans(messages)
            encoding = self.tok.encode(text, add_special_tokens=False)
            ids = encoding.ids
            # A token carries loss when its characters overlap a span (transformers' rule for
            # {% generation %} spans too).
            mask = [int(any(s < b and e > a for a, b in spans)) for s, e in encoding.offsets]
        if mask:
            mask[0] = 0  # predicted from the previous example's last token: never a target
        return ids, mask


def example_encoder(tok: Tokenizer, fmt: str, end_id: int,
                    template: ChatTemplate | None = None) -> Callable[[dict], tuple[list[int], list[int]]]:
    """record -> (token ids, loss bits): the model's chat template where it has one, else ours."""
    if template is not None and fmt == "chat":
        return _Renderer(template, tok)
    return lambda record: encode_example(tok, record, fmt, end_id)


def check_chat_template(cfg: DataConfig, hf_path: str, tok: Tokenizer) -> ChatTemplate | None:
    """model.hf_path's chat template (None: ours), tried on data.source's first conversation:
    rendered and split into turns, so a template that cannot be used (no transformers, a Jinja
    error, prefixes that are not stable) is a ConfigError before anything starts."""
    template = template_for(cfg.format, hf_path)
    if template is None and cfg.format == "chat" and hf_path:
        log.warning("data: model.hf_path %r has no chat template (no chat_template.jinja, no "
                    "chat_template in tokenizer_config.json): chats are rendered with shardlm's "
                    "default, %r per message (recorded in metrics.jsonl's first record)",
                    str(hf_path), DEFAULT_TEMPLATE)
    if template is not None:
        first = next(iter_examples(cfg, corpus_files(cfg, "train")), None)
        if first is not None:
            try:
                _Renderer(template, tok)(first)
            except ConfigError as e:
                raise ConfigError(f"data.source's first conversation: {e}") from None
    return template


def pack_to_files(tok: Tokenizer, examples: Iterator[dict], fmt: str, end_id: int, row_len: int,
                  tokens_path: Path, mask_path: Path, dtype: np.dtype,
                  template: ChatTemplate | None = None) -> dict:
    """Greedy packing (next fit, file order) into rows of `row_len` tokens, written as they fill;
    chats rendered with `template` where given (example_encoder). Returns the counts for meta.json."""
    encode = example_encoder(tok, fmt, end_id, template)
    counts = {"n_examples": 0, "n_truncated": 0, "n_dropped": 0, "n_rows": 0,
              "n_loss_tokens": 0, "n_example_tokens": 0}
    row_ids: list[int] = []
    row_mask: list[int] = []

    with open(tokens_path, "wb") as ft, open(mask_path, "wb") as fm:
        def flush() -> None:
            pad = row_len - len(row_ids)
            np.asarray(row_ids + [end_id] * pad, dtype=dtype).tofile(ft)
            np.asarray(row_mask + [START] * min(pad, 1) + [0] * (pad - 1), dtype=np.uint8).tofile(fm)
            row_ids.clear()
            row_mask.clear()
            counts["n_rows"] += 1

        for number, record in enumerate(examples, start=1):
            try:
                ids, mask = encode(record)
            except ConfigError as e:
                raise ConfigError(f"data.source example {number} (in file order): {e}") from None
            if len(ids) > row_len:
                ids, mask = ids[:row_len], mask[:row_len]
                counts["n_truncated"] += 1
            if not any(mask):
                counts["n_dropped"] += 1
                continue
            if len(row_ids) + len(ids) > row_len:
                flush()
            row_ids += ids
            row_mask += [mask[0] | START] + mask[1:]
            counts["n_examples"] += 1
            counts["n_loss_tokens"] += sum(mask)
            counts["n_example_tokens"] += len(ids)
        if row_ids:
            flush()
    if fmt == "chat":  # which template rendered the chats (meta.json; the run's first JSONL record)
        counts["chat_template"] = template.record() if template is not None else DEFAULT_RECORD
    # Targets per row: row_len - 1 (the first token is only an input).
    counts["loss_token_fraction"] = counts["n_loss_tokens"] / max(counts["n_rows"] * (row_len - 1), 1)
    return counts
