"""Load and validate prompt files (JSONL / JSON / Parquet).

Each row has an ``id`` and exactly one of ``prompt_token_ids`` (list of token
ids) or ``prompt`` (a string, or a list of ``{"role", "content"}`` chat
messages rendered with the model's chat template). Optional per-row fields:
``n``, ``max_tokens``, the sampling overrides in ``_OPTIONAL_FIELDS``, and ``target_lengths``.
Other columns are ignored, so veRL parquet files load as-is. A null value
counts as absent (Parquet fills columns that a row does not use with nulls).

Ids:
  * JSONL/JSON: every row needs ``id``.
  * Parquet with an ``id`` column: every row needs a non-null ``id``.
  * Parquet without one (veRL layout): ``extra_info.index`` if every row has
    one, else the 1-based row number.

``target_lengths`` (benchmarks): one length per response, exactly ``n`` integers in
1..max_tokens. Workers end each response at its target as if the model had emitted EOS there
(finish reason ``length_target``); the scheduler never sees it.

Text prompts are tokenized with ``add_special_tokens=True`` (as vLLM does for
a plain string); chat prompts are rendered with ``add_generation_prompt=True``
and tokenized with ``add_special_tokens=False`` because the template already
emits BOS and friends.

Prompt lengths are checked against the context length the engine will run with
(``ContextLength``: ``--max-model-len``, ``--engine-arg max_model_len`` or the
model's own, see ``load_model_limits``). The sampling overrides are checked here
for their types only; their ranges are vLLM's, applied by the ``check_sampling``
callback the caller passes (seerd/launch/engine_rules.py), so they cannot drift.

The whole file is validated before returning; every problem is reported at
once in a PromptFileError.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from seerd.config import MAX_RESPONSES_PER_PROMPT, N_WHY

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class ModelDirError(Exception):
    """The model directory (config or tokenizer) cannot be used."""


class PromptFileError(Exception):
    """A prompt file is invalid; ``errors`` holds one message per problem."""

    def __init__(self, path: Path, errors: list[str]) -> None:
        self.path = path
        self.errors = errors
        super().__init__("\n".join(errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    max_tokens: int
    sampling: dict  # only the overrides given in the row
    source_line: int  # 1-based line (jsonl) or row number (parquet, 1-based)
    # Where each response must end (benchmarks); read by workers only, never by the scheduler.
    target_lengths: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ContextLength:
    """The engine's context length (vLLM's max_model_len) and where that number comes from."""

    tokens: int
    source: str  # for messages: "--max-model-len", "max_position_embeddings in the model's config.json", ...


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context: ContextLength | None  # None: the config names no length (then --max-model-len must)


# vLLM derives a model's length as the smallest of these keys of its text config
# (ModelArchConfigConvertor.derive_max_model_len_and_key; RoPE scaling may raise it), and refuses
# to start an engine with an explicit max_model_len above that.
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def load_model_limits(model_dir: Path) -> ModelLimits:
    """Vocab size and context length of the model in ``model_dir``, read as vLLM reads them: from
    its text config (``text_config`` of a multimodal config, else the top level). Never above the
    length vLLM derives, so an engine given it explicitly accepts it."""
    cfg_path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelDirError(f"model dir {model_dir} does not exist or is not a directory")
    cfg = _read_json_object(cfg_path)
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    sections = [(text_cfg, "text_config."), (cfg, "")]
    vocab = next((src["vocab_size"] for src, _ in sections if _is_positive_int(src.get("vocab_size"))), None)
    if vocab is None:
        raise ModelDirError(f"{cfg_path}: no positive integer vocab_size")
    context = None
    # The text config's keys; the top level's if it names none (vLLM then derives no length and
    # takes the explicit one the worker passes as given).
    for src, prefix in sections:
        lengths = [(src[k], k) for k in _LENGTH_KEYS if _is_positive_int(src.get(k))]
        if lengths:
            tokens, key = min(lengths, key=lambda length_key: length_key[0])
            context = ContextLength(tokens, f"{prefix}{key} in the model's config.json")
            break
    return ModelLimits(vocab_size=vocab, context=context)


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirError(f"model dir {path.parent} has no {path.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: expected a JSON object")
    return data


def _is_positive_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: int | float) -> bool:
    """NaN and infinity compare false with every bound: refused whatever the ranges are. So is an
    int too large for a float, which the worker's float() would fail on."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


_TYPE_TESTS: dict[str, Callable[[Any], bool]] = {
    "an integer": _is_int,
    "a finite number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v),
    "a list of integers": lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
    "a boolean": lambda v: isinstance(v, bool),
}
_NORMALISE: dict[str, Callable[[Any], Any]] = {
    "an integer": int, "a finite number": float, "a list of integers": list, "a boolean": bool}

# Optional per-row fields: name -> (type, range test, range description). n and max_tokens become
# PromptRow fields (max_tokens is bounded by the context length too); the rest are sampling
# overrides, whose ranges are vLLM's (the caller's check_sampling), not repeated here.
_OPTIONAL_FIELDS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "n": ("an integer", lambda v: 0 < v <= MAX_RESPONSES_PER_PROMPT,
          f"in 1..{MAX_RESPONSES_PER_PROMPT} ({N_WHY})"),
    "max_tokens": ("an integer", lambda v: v > 0, "> 0"),
    "temperature": ("a finite number", lambda v: True, ""),
    "top_p": ("a finite number", lambda v: True, ""),
    "top_k": ("an integer", lambda v: True, ""),
    "seed": ("an integer", lambda v: True, ""),
    "stop_token_ids": ("a list of integers", lambda v: True, ""),
    # Generate past the model's EOS (vLLM's ignore_eos): with target_lengths, every response then
    # ends exactly at its target, which benchmarks need; stop_token_ids still stop.
    "ignore_eos": ("a boolean", lambda v: True, ""),
}


@dataclass
class _Parsed:
    """A row under validation; ``errors`` collects its problems."""

    k: int  # 1-based line / row number
    prompt_id: str
    n: int
    max_tokens: int
    sampling: dict
    token_ids: list[int] | None = None
    target_lengths: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    errors: list[str] = field(default_factory=list)

    def row(self) -> PromptRow:
        return PromptRow(prompt_id=self.prompt_id, prompt_token_ids=tuple(self.token_ids or ()), n=self.n,
                         max_tokens=self.max_tokens, sampling=self.sampling, source_line=self.k,
                         target_lengths=None if self.target_lengths is None else tuple(self.target_lengths))


def _lone_surrogate(text: str) -> str | None:
    """Where `text` holds a lone surrogate (JSON's "\\ud800" escape decodes to one): not text, so no
    UTF-8 database or output file can store it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(text[e.start]):04X} at character {e.start}"
    return None


def _check_token_ids(ids: list[int], vocab_size: int, what: str) -> str | None:
    bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size]
    if not bad:
        return None
    i, t = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"{what}[{i}] = {t} is out of range for vocab size {vocab_size}{more}"


def _parse_prompt(rec: dict, p: _Parsed) -> None:
    ids, prompt = rec.get("prompt_token_ids"), rec.get("prompt")
    if ids is None and prompt is None:
        p.errors.append("missing prompt: need 'prompt' or 'prompt_token_ids'")
    elif ids is not None and prompt is not None:
        p.errors.append("both 'prompt' and 'prompt_token_ids' given; use exactly one")
    elif ids is not None:
        bad = [t for t in ids if not _is_int(t)] if isinstance(ids, list) else [ids]
        if bad:
            p.errors.append(f"prompt_token_ids must be a list of integers, "
                            f"found {_type_name(bad[0])} {bad[0]!r:.40}")
        elif not ids:
            p.errors.append("empty prompt: prompt_token_ids is an empty list")
        else:
            p.token_ids = ids
    elif isinstance(prompt, str):
        if not prompt:
            p.errors.append("empty prompt: prompt is an empty string")
        else:
            p.text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            p.errors.append("empty prompt: prompt is an empty message list")
            return
        for i, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and m["role"] and isinstance(m.get("content"), str)):
                p.errors.append(f"prompt[{i}] must be a chat message "
                                '{"role": str, "content": str}')
                return
        # Only role/content: Parquet structs add null keys from other rows.
        p.messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        p.errors.append(f"prompt must be a string or a list of chat messages, "
                        f"got {_type_name(prompt)}")


def _parse_row(rec: Any, k: int, prompt_id: Any, default_n: int,
               default_max_tokens: int) -> _Parsed:
    p = _Parsed(k=k, prompt_id="", n=default_n, max_tokens=default_max_tokens, sampling={})
    if not isinstance(rec, dict):
        p.errors.append(f"expected a JSON object, got {_type_name(rec)}")
        return p
    if prompt_id is None:
        p.errors.append("missing id")
    elif not (_is_int(prompt_id) or (isinstance(prompt_id, str) and prompt_id)):
        p.errors.append(f"id must be a non-empty string or an integer, got {_type_name(prompt_id)}")
    elif isinstance(prompt_id, str) and (surrogate := _lone_surrogate(prompt_id)):
        p.errors.append(f"id {prompt_id!r} holds a lone surrogate ({surrogate}), which is not text and cannot "
                        "be stored")
    else:
        p.prompt_id = str(prompt_id)
    _parse_prompt(rec, p)
    for name, (kind, in_range, range_desc) in _OPTIONAL_FIELDS.items():
        v = rec.get(name)
        if v is None:
            continue
        if not _TYPE_TESTS[kind](v):
            number = isinstance(v, (int, float)) and not isinstance(v, bool)  # of the wrong kind, or not finite
            p.errors.append(f"{name} must be {kind}, got {f'{v!r:.40}' if number else _type_name(v)}")
        elif not in_range(v):
            p.errors.append(f"{name} must be {range_desc}, got {v}")
        elif name in ("n", "max_tokens"):
            setattr(p, name, v)
        else:
            p.sampling[name] = _NORMALISE[kind](v)
    _parse_target_lengths(rec.get("target_lengths"), p)
    return p


def _parse_target_lengths(targets: Any, p: _Parsed) -> None:
    """Checked after n and max_tokens, which bound it: exactly n integers in 1..max_tokens."""
    if targets is None:
        return
    if not (isinstance(targets, list) and all(_is_int(t) for t in targets)):
        bad = next((t for t in targets if not _is_int(t)), None) if isinstance(targets, list) else targets
        p.errors.append(f"target_lengths must be a list of integers, found {_type_name(bad)} {bad!r:.40}")
        return
    if len(targets) != p.n:
        p.errors.append(f"target_lengths has {len(targets)} entries but n is {p.n} (one per response)")
        return
    out_of_range = [(i, t) for i, t in enumerate(targets) if not 1 <= t <= p.max_tokens]
    if out_of_range:
        i, t = out_of_range[0]
        more = f" (and {len(out_of_range) - 1} more)" if len(out_of_range) > 1 else ""
        p.errors.append(f"target_lengths[{i}] = {t} must be in 1..max_tokens ({p.max_tokens}){more}")
        return
    p.target_lengths = targets


def _read_json(path: Path) -> tuple[list[tuple[int, Any]], list[tuple[int, str]], str]:
    """Return (number, decoded value) per non-blank line, errors, and "line"/"row"."""
    data = path.read_bytes()
    if path.suffix.lower() == ".json" and data.lstrip()[:1] == b"[":
        # A .json file may also hold one array of row objects.
        try:
            rows = json.loads(data.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return [], [(0, f"invalid JSON: {e}")], "row"
        return list(enumerate(rows, 1)), [], "row"
    records: list[tuple[int, Any]] = []
    errors: list[tuple[int, str]] = []
    for k, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8-sig" if k == 1 else "utf-8")
        except UnicodeDecodeError as e:
            errors.append((k, f"invalid UTF-8 at byte {e.start}"))
            continue
        if not line.strip():
            continue
        try:
            records.append((k, json.loads(line)))
        except json.JSONDecodeError as e:
            errors.append((k, f"invalid JSON: {e}"))
    return records, errors, "line"


def _read_parquet(path: Path) -> tuple[list[dict], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise PromptFileError(path, [f"{path}: unreadable or corrupt parquet: {e}"]) from e
    if table.num_rows and not {"prompt", "prompt_token_ids"} & set(table.column_names):
        raise PromptFileError(path, [f"{path}: no 'prompt' or 'prompt_token_ids' column "
                                     f"(columns: {', '.join(table.column_names)})"])
    return table.to_pylist(), table.column_names


def _parquet_ids(rows: list[dict], columns: list[str]) -> tuple[list[Any], str]:
    """Return per-row ids and where they came from (see module docstring)."""
    if "id" in columns:
        return [r.get("id") for r in rows], "id"
    index = [r["extra_info"].get("index") if isinstance(r.get("extra_info"), dict)
             else None for r in rows]
    if all(_is_int(i) or (isinstance(i, str) and i) for i in index):
        return index, "extra_info.index"
    return list(range(1, len(rows) + 1)), "row number"


def _load_tokenizer(model_dir: Path) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many unrelated types here
        raise ModelDirError(f"cannot load tokenizer from model dir {model_dir}: {e}") from e


def _tokenize(p: _Parsed, tok: Any) -> None:
    if p.text is None and p.messages is None:
        return
    try:
        if p.text is not None:
            p.token_ids = list(tok(p.text, add_special_tokens=True)["input_ids"])
        elif p.messages is not None:
            rendered = tok.apply_chat_template(
                p.messages, tokenize=False, add_generation_prompt=True)
            p.token_ids = list(tok(rendered, add_special_tokens=False)["input_ids"])
    except Exception as e:  # template errors are user data errors, not ours
        p.errors.append(f"cannot render/tokenize prompt: {e}")
        return
    if not p.token_ids:
        p.errors.append("empty prompt: tokenizes to zero tokens")


def load_prompts(
    path: Path,
    model_dir: Path,
    *,
    default_n: int,
    default_max_tokens: int,
    context: ContextLength,
    check_sampling: Callable[[PromptRow], str | None] | None,
) -> list[PromptRow]:
    """Load, tokenize and validate every row of a prompt file.

    ``context``: the context length the engine will run with.
    ``check_sampling(row)``: the engine's objection to a row's sampling settings, or None;
    called for every row, with the overrides of the right types (None: no check).

    Raises PromptFileError listing every problem, or ModelDirError if the
    model's config/tokenizer cannot be loaded.
    """
    if min(default_n, default_max_tokens, context.tokens) <= 0:
        raise ValueError("default_n, default_max_tokens and the context length must be > 0")
    path = Path(path)
    limits = load_model_limits(model_dir)
    suffix = path.suffix.lower()
    if suffix not in JSON_SUFFIXES + PARQUET_SUFFIXES:
        raise PromptFileError(path, [f"{path}: unsupported file type {suffix or '(none)'!r}; "
                                     "expected .jsonl, .json or .parquet"])
    if not path.exists():
        raise PromptFileError(path, [f"{path}: file not found"])

    errors: list[tuple[int, str]] = []
    id_source = "id"
    try:
        if suffix in PARQUET_SUFFIXES:
            rows, columns = _read_parquet(path)
            records: list[tuple[int, Any]] = list(enumerate(rows, 1))
            ids, id_source = _parquet_ids(rows, columns)
            where = "row"
        else:
            records, errors, where = _read_json(path)
            ids = [r.get("id") if isinstance(r, dict) else None for _, r in records]
    except OSError as e:
        raise PromptFileError(path, [f"{path}: cannot read: {e}"]) from e
    if not records and not errors:
        raise PromptFileError(path, [f"{path}: no prompts in file"])

    parsed = [_parse_row(rec, k, pid, default_n, default_max_tokens)
              for (k, rec), pid in zip(records, ids)]
    if any(p.text is not None or p.messages is not None for p in parsed):
        tok = _load_tokenizer(model_dir)
        for p in parsed:
            _tokenize(p, tok)

    first_seen: dict[str, int] = {}
    for p in parsed:
        if p.prompt_id:
            if p.prompt_id in first_seen:
                hint = "" if id_source == "id" else f", ids taken from {id_source}"
                p.errors.append(f"duplicate id {p.prompt_id!r} "
                                f"(also on {where} {first_seen[p.prompt_id]}{hint})")
            else:
                first_seen[p.prompt_id] = p.k
        if p.token_ids is not None:
            _check_lengths(p, limits.vocab_size, context)
        if "stop_token_ids" in p.sampling:
            err = _check_token_ids(p.sampling["stop_token_ids"], limits.vocab_size,
                                   "stop_token_ids")
            if err:
                p.errors.append(err)
        objection = None if check_sampling is None else check_sampling(p.row())
        if objection:
            p.errors.append(objection)
        errors.extend((p.k, e) for e in p.errors)

    if errors:
        errors.sort(key=lambda e: e[0])  # stable: keeps per-row order
        fmt = (lambda k: f"{path}: row {k}") if where == "row" else (lambda k: f"{path}:{k}")
        raise PromptFileError(path, [f"{fmt(k) if k else str(path)}: {msg}"
                                     for k, msg in errors])
    return [p.row() for p in parsed]


def _check_lengths(p: _Parsed, vocab_size: int, context: ContextLength) -> None:
    assert p.token_ids is not None
    rendered = p.text is not None or p.messages is not None
    err = _check_token_ids(p.token_ids, vocab_size,
                           "tokenized prompt" if rendered else "prompt_token_ids")
    if err:
        p.errors.append(err)
    n_tok, limit = len(p.token_ids), f"max_model_len {context.tokens} ({context.source})"
    if n_tok >= context.tokens:
        p.errors.append(f"prompt too long: {n_tok} tokens, and {limit} leaves no room to generate")
    elif n_tok + p.max_tokens > context.tokens:
        p.errors.append(f"prompt length {n_tok} + max_tokens {p.max_tokens} = "
                        f"{n_tok + p.max_tokens} exceeds {limit}")
