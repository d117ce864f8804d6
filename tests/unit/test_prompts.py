from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from seerd.config import RunConfig
from seerd.io import prompts
from seerd.io.prompts import (
    ContextLength,
    ModelDirError,
    ModelLimits,
    PromptFileError,
    PromptRow,
    load_model_limits,
    load_prompts,
)
from seerd.launch.engine_rules import SamplingCheck

VOCAB, MAX_LEN = 1024, 4096  # make_tiny_model defaults
MODEL_CONTEXT = ContextLength(MAX_LEN, "max_position_embeddings in the model's config.json")
GOOD = {"id": "good", "prompt_token_ids": [1, 5, 6]}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"}]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows are dicts (JSON-encoded), str (written verbatim) or bytes (raw)."""
    out = b""
    for r in rows:
        if isinstance(r, bytes):
            out += r
        elif isinstance(r, str):
            out += r.encode()
        else:
            out += json.dumps(r).encode()
        out += b"\n"
    path.write_bytes(out)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    """Missing keys become nulls (from_pylist alone takes keys from row 1 only)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    return path


def load(path: Path, model_dir: Path, **kw: Any) -> list[PromptRow]:
    """With the options' defaults, as `seerd run` checks a file: vLLM's sampling rules (real
    SamplingParams) and the model's own context length."""
    kw.setdefault("default_n", 1)
    kw.setdefault("default_max_tokens", 16)
    kw.setdefault("context", load_model_limits(model_dir).context)
    kw.setdefault("check_sampling", SamplingCheck(RunConfig(input_path="p", model_path=str(model_dir))).check)
    return load_prompts(path, model_dir, **kw)


def load_error(path: Path, model_dir: Path, **kw: Any) -> PromptFileError:
    with pytest.raises(PromptFileError) as ei:
        load(path, model_dir, **kw)
    assert ei.value.path == path
    assert str(ei.value) == "\n".join(ei.value.errors)
    return ei.value


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ---------------------------------------------------------------- model dir


def test_load_model_limits(tiny_model_dir: Path) -> None:
    assert load_model_limits(tiny_model_dir) == ModelLimits(vocab_size=VOCAB, context=MODEL_CONTEXT)


def model_with_config(tmp_path: Path, config: dict) -> Path:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("config, vocab, context", [
    # A multimodal config: the language model's numbers are under text_config, and win.
    ({"vocab_size": 9, "max_position_embeddings": 4096,
      "text_config": {"vocab_size": 1024, "max_position_embeddings": 64}},
     1024, ContextLength(64, "text_config.max_position_embeddings in the model's config.json")),
    # vLLM takes the smallest of its length keys.
    ({"vocab_size": 1024, "max_position_embeddings": 4096, "seq_length": 2048},
     1024, ContextLength(2048, "seq_length in the model's config.json")),
    # A text_config without a length: the top level's.
    ({"vocab_size": 1024, "n_positions": 512, "text_config": {"vocab_size": 1000}},
     1000, ContextLength(512, "n_positions in the model's config.json")),
    ({"vocab_size": 1024}, 1024, None),  # no length: --max-model-len must give one
])
def test_load_model_limits_as_vllm_reads_them(tmp_path: Path, config: dict, vocab: int,
                                              context: ContextLength | None) -> None:
    assert load_model_limits(model_with_config(tmp_path, config)) == ModelLimits(vocab, context)


def test_prompt_length_against_a_text_config(tmp_path: Path) -> None:
    model_dir = model_with_config(tmp_path, {"vocab_size": 8, "max_position_embeddings": 4096,
                                             "text_config": {"vocab_size": 1024, "max_position_embeddings": 64}})
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt_token_ids": [1000] * 60}])
    assert load(f, model_dir, default_max_tokens=4)[0].prompt_token_ids[0] == 1000
    assert str(load_error(f, model_dir, default_max_tokens=5)) == (
        f"{f}:1: prompt length 60 + max_tokens 5 = 65 exceeds max_model_len 64 "
        "(text_config.max_position_embeddings in the model's config.json)")


@pytest.mark.parametrize(
    "setup, keyword",
    [
        ("missing", "does not exist"),
        ("empty", "no config.json"),
        ("broken", "cannot read"),
        ("no_vocab", "vocab_size"),
    ],
)
def test_load_model_limits_errors(tmp_path: Path, setup: str, keyword: str) -> None:
    d = tmp_path / "m"
    if setup != "missing":
        d.mkdir()
    if setup == "broken":
        (d / "config.json").write_text("{not json")
    if setup == "no_vocab":
        (d / "config.json").write_text(json.dumps({"max_position_embeddings": 8}))
    with pytest.raises(ModelDirError, match=keyword) as ei:
        load_model_limits(d)
    assert str(d) in str(ei.value)


# ---------------------------------------------------------------- happy paths


def test_token_ids_and_defaults(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"id": 7, "prompt_token_ids": [1, 2, 3], "data_source": "ignored"},
        "",
        "   ",
        {"id": "x", "prompt_token_ids": [0, VOCAB - 1], "n": None},
    ])
    assert load(f, tiny_model_dir, default_n=4, default_max_tokens=32) == [
        PromptRow("7", (1, 2, 3), 4, 32, {}, 1),
        PromptRow("x", (0, VOCAB - 1), 4, 32, {}, 4),
    ]


def test_target_lengths_one_per_response(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "prompt_token_ids": [1, 2], "n": 3, "max_tokens": 20, "target_lengths": [1, 20, 7]},
        {"id": "b", "prompt_token_ids": [3], "target_lengths": None},
        {"id": "c", "prompt_token_ids": [3], "target_lengths": [16, 2]},  # default n=2, max_tokens=16
    ])
    got = load(f, tiny_model_dir, default_n=2, default_max_tokens=16)
    assert [r.target_lengths for r in got] == [(1, 20, 7), None, (16, 2)]
    assert got[0].sampling == {}  # not a sampling override


def test_crlf_and_bom(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"id": 1, "prompt_token_ids": [1]}\r\n{"id": 2, "prompt_token_ids": [2]}\r\n')
    assert [r.prompt_id for r in load(f, tiny_model_dir)] == ["1", "2"]


def test_text_prompt_gets_one_bos(tmp_path: Path, tiny_model_dir: Path, tokenizer: Any) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": "t", "prompt": "hello world"}])
    (row,) = load(f, tiny_model_dir)
    assert list(row.prompt_token_ids) == tokenizer("hello world").input_ids
    assert row.prompt_token_ids[0] == tokenizer.bos_token_id
    assert row.prompt_token_ids[1] != tokenizer.bos_token_id


def test_chat_prompt_rendered_with_template(
    tmp_path: Path, tiny_model_dir: Path, tokenizer: Any
) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": "c", "prompt": CHAT}])
    (row,) = load(f, tiny_model_dir)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|system|> Be brief.\n<|user|> Two plus two?\n<|assistant|> "
    assert list(row.prompt_token_ids) == tokenizer(rendered, add_special_tokens=False).input_ids
    # The template emits BOS; it must not be added a second time.
    assert row.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(row.prompt_token_ids).endswith("<|assistant|> ")


def test_per_row_overrides(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "prompt_token_ids": [1], "n": 3, "max_tokens": 5, "temperature": 1,
         "top_p": 0.9, "top_k": -1, "seed": -7, "stop_token_ids": [2, 9], "ignore_eos": True},
        {"id": "b", "prompt_token_ids": [1], "temperature": 0.0, "top_k": 40},
    ])
    a, b = load(f, tiny_model_dir, default_n=1, default_max_tokens=16)
    assert (a.n, a.max_tokens) == (3, 5)
    assert a.sampling == {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "seed": -7,
                          "stop_token_ids": [2, 9], "ignore_eos": True}
    assert isinstance(a.sampling["temperature"], float)
    assert (b.n, b.max_tokens, b.sampling) == (1, 16, {"temperature": 0.0, "top_k": 40})


def test_json_array_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps([GOOD, {"id": "b", "prompt": "hi"}]))
    assert [r.prompt_id for r in load(f, tiny_model_dir)] == ["good", "b"]
    f.write_text(json.dumps([GOOD, {"id": "b"}]))
    assert f"{f}: row 2: missing prompt" in str(load_error(f, tiny_model_dir))


def verl_rows() -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i, "answer": "..."},
        }
        for i in range(3)
    ]


def test_verl_parquet_ids_from_extra_info(
    tmp_path: Path, tiny_model_dir: Path, tokenizer: Any
) -> None:
    data = verl_rows()
    # An extra message key turns into a null field in every other row's structs.
    data[1]["prompt"].insert(0, {"role": "system", "content": "Be brief.", "name": "sys"})
    f = write_parquet(tmp_path / "train.parquet", data)
    rows = load(f, tiny_model_dir)
    assert [(r.prompt_id, r.source_line) for r in rows] == [("0", 1), ("1", 2), ("2", 3)]
    msgs = [{"role": m["role"], "content": m["content"]} for m in data[1]["prompt"]]
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert list(rows[1].prompt_token_ids) == tokenizer(rendered, add_special_tokens=False).input_ids


def test_verl_parquet_ids_fall_back_to_row_number(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = verl_rows()
    for r in data:
        del r["extra_info"]
    f = write_parquet(tmp_path / "train.parquet", data)
    assert [r.prompt_id for r in load(f, tiny_model_dir)] == ["1", "2", "3"]


def test_parquet_nulls_are_absent(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_parquet(tmp_path / "p.parquet", [
        {"id": 1, "prompt_token_ids": [1, 2], "n": 2},
        {"id": 2, "prompt": "hello", "temperature": 0.5},
    ])
    a, b = load(f, tiny_model_dir)
    assert (a.prompt_id, a.prompt_token_ids, a.n, a.sampling) == ("1", (1, 2), 2, {})
    assert (b.prompt_id, b.n, b.sampling) == ("2", 1, {"temperature": 0.5})


def test_max_model_len_override(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt_token_ids": [1] * 10}])
    given = ContextLength(16, "--max-model-len")
    assert load(f, tiny_model_dir, default_max_tokens=6, context=given)
    err = load_error(f, tiny_model_dir, default_max_tokens=7, context=given)
    assert "10 + max_tokens 7 = 17 exceeds max_model_len 16 (--max-model-len)" in str(err)
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt_token_ids": [1] * 16}])
    assert str(load_error(f, tiny_model_dir, context=given)) == (
        f"{f}:1: prompt too long: 16 tokens, and max_model_len 16 (--max-model-len) leaves no room to generate")


def test_unusual_but_valid_sampling_passes(tmp_path: Path, tiny_model_dir: Path) -> None:
    # vLLM's bounds themselves, top_k 0 (vLLM: off) and far above the vocabulary, a temperature vLLM
    # raises to 0.01, a seed beyond 64 bits (the worker hashes it into a per-chunk seed).
    rows = [{"temperature": 2.0, "top_p": 1e-9}, {"temperature": 0, "top_k": 0}, {"top_k": 10**12},
            {"temperature": 1e-5, "seed": 10**30}, {"top_k": 1, "stop_token_ids": [], "ignore_eos": True}]
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": k, "prompt_token_ids": [5], **row} for k, row in enumerate(rows)])
    assert [r.sampling for r in load(f, tiny_model_dir)] == [
        {k: float(v) if k in ("temperature", "top_p") else v for k, v in row.items()} for row in rows]


def test_sampling_is_checked_merged_with_the_options(tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM sees a row's overrides on top of the options: a row alone is not the whole story."""
    check = SamplingCheck(RunConfig(input_path="p", model_path=str(tiny_model_dir), chunk_tokens=8)).check
    seen = []

    def recording(row: PromptRow) -> str | None:
        seen.append((row.max_tokens, row.sampling))
        return check(row)

    f = write_jsonl(tmp_path / "p.jsonl", [GOOD, {"id": "b", "prompt_token_ids": [1], "top_p": 0.5, "max_tokens": 3}])
    load(f, tiny_model_dir, check_sampling=recording)
    assert seen == [(16, {}), (3, {"top_p": 0.5})]


def test_tokenizer_only_loaded_when_needed(tmp_path: Path, tiny_model_dir: Path) -> None:
    # A model dir with a config but no tokenizer files.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "config.json", bare / "config.json")
    ids_file = write_jsonl(tmp_path / "ids.jsonl", [GOOD])
    assert load(ids_file, bare)[0].prompt_token_ids == (1, 5, 6)

    text_file = write_jsonl(tmp_path / "text.jsonl", [GOOD, {"id": "t", "prompt": "hi"}])
    with pytest.raises(ModelDirError, match="tokenizer") as ei:
        load(text_file, bare)
    assert str(bare) in str(ei.value)


# ---------------------------------------------------------------- row errors

# (row written on line 2 after a good row, expected keyword in the reason)
ROW_ERRORS: list[tuple[str, Any, str]] = [
    ("broken_json", '{"id": 1, "prompt": ', "invalid JSON"),
    ("non_utf8", b'{"id": "x", "prompt": "caf\xe9"}', "UTF-8"),
    ("not_object_list", "[1, 2]", "expected a JSON object, got list"),
    ("not_object_str", '"hello"', "expected a JSON object, got str"),
    ("missing_id", {"prompt": "hi"}, "missing id"),
    ("null_id", {"id": None, "prompt": "hi"}, "missing id"),
    ("float_id", {"id": 1.5, "prompt": "hi"}, "id must be"),
    ("bool_id", {"id": True, "prompt": "hi"}, "id must be"),
    ("empty_id", {"id": "", "prompt": "hi"}, "id must be"),
    ("missing_prompt", {"id": "x"}, "missing prompt"),
    ("both_prompts", {"id": "x", "prompt": "hi", "prompt_token_ids": [1]}, "both"),
    ("ids_not_list", {"id": "x", "prompt_token_ids": "1 2"}, "list of integers"),
    ("ids_float", {"id": "x", "prompt_token_ids": [1, 2.0]}, "list of integers"),
    ("ids_bool", {"id": "x", "prompt_token_ids": [1, True]}, "list of integers"),
    ("ids_str", {"id": "x", "prompt_token_ids": [1, "2"]}, "list of integers"),
    ("prompt_dict", {"id": "x", "prompt": {"role": "user"}}, "string or a list of chat messages"),
    ("prompt_int", {"id": "x", "prompt": 5}, "string or a list of chat messages"),
    ("bad_message", {"id": "x", "prompt": [{"role": "user"}]}, "chat message"),
    ("bad_message_type", {"id": "x", "prompt": ["hi"]}, "chat message"),
    ("empty_string", {"id": "x", "prompt": ""}, "empty prompt"),
    ("empty_messages", {"id": "x", "prompt": []}, "empty prompt"),
    ("empty_ids", {"id": "x", "prompt_token_ids": []}, "empty prompt"),
    ("n_str", {**GOOD, "id": "x", "n": "2"}, "n must be an integer"),
    ("n_bool", {**GOOD, "id": "x", "n": True}, "n must be an integer"),
    ("n_float", {**GOOD, "id": "x", "n": 2.0}, "n must be an integer"),
    ("n_zero", {**GOOD, "id": "x", "n": 0}, "n must be in 1..16384"),
    ("n_negative", {**GOOD, "id": "x", "n": -1}, "n must be in 1..16384"),
    ("max_tokens_zero", {**GOOD, "id": "x", "max_tokens": 0}, "max_tokens must be > 0"),
    ("max_tokens_bool", {**GOOD, "id": "x", "max_tokens": False}, "max_tokens must be an integer"),
    ("n_too_many", {**GOOD, "id": "x", "n": 16385}, "n must be in 1..16384 (vLLM's own limit"),
    ("temperature_str", {**GOOD, "id": "x", "temperature": "0.7"}, "temperature must be a finite number, got str"),
    ("temperature_nan", '{"id": "x", "prompt_token_ids": [1], "temperature": NaN}',
     "temperature must be a finite number, got nan"),
    ("top_p_infinite", '{"id": "x", "prompt_token_ids": [1], "top_p": Infinity}',
     "top_p must be a finite number, got inf"),
    ("temperature_beyond_floats", {**GOOD, "id": "x", "temperature": 10**400},
     "temperature must be a finite number, got 1000000000"),
    ("top_k_beyond_64_bits", {**GOOD, "id": "x", "top_k": 2**64},
     "vLLM cannot send these sampling settings to its engine core (MessagePack): can't serialize ints"),
    # The ranges are vLLM's own, from its SamplingParams.
    ("temperature_neg", {**GOOD, "id": "x", "temperature": -0.1},
     "vLLM refuses these sampling settings: temperature must be non-negative, got -0.1."),
    ("temperature_high", {**GOOD, "id": "x", "temperature": 2.5},
     "vLLM refuses these sampling settings: temperature must be in [0, 2], got 2.5."),
    ("top_p_zero", {**GOOD, "id": "x", "top_p": 0}, "top_p must be in (0, 1]"),
    ("top_p_big", {**GOOD, "id": "x", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ("top_k_negative", {**GOOD, "id": "x", "top_k": -5}, "top_k must be 0 (disable), or at least 1, got -5."),
    ("top_k_float", {**GOOD, "id": "x", "top_k": 5.5}, "top_k must be an integer"),
    ("seed_str", {**GOOD, "id": "x", "seed": "1"}, "seed must be an integer"),
    ("stop_not_list", {**GOOD, "id": "x", "stop_token_ids": 2}, "stop_token_ids must be"),
    ("stop_out_of_vocab", {**GOOD, "id": "x", "stop_token_ids": [VOCAB]}, "out of range"),
    ("ids_out_of_vocab", {"id": "x", "prompt_token_ids": [1, VOCAB]}, "out of range"),
    ("ids_negative", {"id": "x", "prompt_token_ids": [-1]}, "out of range"),
    ("too_long_ids", {"id": "x", "prompt_token_ids": [1] * MAX_LEN}, "too long"),
    ("too_long_text", {"id": "x", "prompt": "hello " * MAX_LEN}, "too long"),
    ("len_plus_max_tokens", {"id": "x", "prompt_token_ids": [1] * 10, "max_tokens": MAX_LEN - 9},
     f"prompt length 10 + max_tokens {MAX_LEN - 9} = {MAX_LEN + 1} exceeds max_model_len {MAX_LEN} "
     "(max_position_embeddings in the model's config.json)"),
    ("duplicate_id", {**GOOD}, "duplicate id 'good' (also on line 1)"),
    ("ignore_eos_int", {**GOOD, "id": "x", "ignore_eos": 1}, "ignore_eos must be a boolean"),
    ("targets_not_list", {**GOOD, "id": "x", "target_lengths": 5}, "target_lengths must be a list of integers"),
    ("targets_float", {**GOOD, "id": "x", "n": 2, "target_lengths": [3, 4.0]}, "list of integers, found float"),
    ("targets_too_few", {**GOOD, "id": "x", "n": 3, "target_lengths": [3, 4]},
     "target_lengths has 2 entries but n is 3"),
    ("targets_too_many_default_n", {**GOOD, "id": "x", "target_lengths": [3, 4]},
     "target_lengths has 2 entries but n is 1"),
    ("targets_zero", {**GOOD, "id": "x", "n": 2, "target_lengths": [3, 0]},
     "target_lengths[1] = 0 must be in 1..max_tokens (16)"),
    ("targets_over_row_max", {**GOOD, "id": "x", "n": 2, "max_tokens": 8, "target_lengths": [9, 8]},
     "target_lengths[0] = 9 must be in 1..max_tokens (8)"),
]


@pytest.mark.parametrize("row, keyword", [c[1:] for c in ROW_ERRORS], ids=[c[0] for c in ROW_ERRORS])
def test_row_error(tmp_path: Path, tiny_model_dir: Path, row: Any, keyword: str) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [GOOD, row])
    err = load_error(f, tiny_model_dir)
    assert len(err.errors) == 1, err.errors
    assert err.errors[0].startswith(f"{f}:2: ")
    assert keyword in err.errors[0]


def test_int_and_str_ids_collide(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt_token_ids": [1]},
                                           {"id": "1", "prompt_token_ids": [1]}])
    assert str(load_error(f, tiny_model_dir)) == f"{f}:2: duplicate id '1' (also on line 1)"


def test_all_errors_reported_together(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [
        GOOD,
        "{broken",
        {"id": "a", "prompt": "hi", "n": 0, "top_p": 2},
        "",
        {"prompt_token_ids": [VOCAB]},
        {**GOOD},
        b"\xff",
    ])
    err = load_error(f, tiny_model_dir)
    expected = [
        (2, "invalid JSON"), (3, "n must be in 1..16384"), (3, "top_p"), (5, "missing id"),
        (5, "out of range"), (6, "duplicate id"), (7, "UTF-8"),
    ]
    assert len(err.errors) == len(expected), err.errors
    for msg, (line, keyword) in zip(err.errors, expected):
        assert msg.startswith(f"{f}:{line}: ") and keyword in msg, msg
    assert str(err).count("\n") == len(expected) - 1


# ---------------------------------------------------------------- file errors


@pytest.mark.parametrize(
    "name, content, keyword",
    [
        ("empty.jsonl", b"", "no prompts"),
        ("blank.jsonl", b"\n  \n\n", "no prompts"),
        ("missing.jsonl", None, "not found"),
        ("prompts.txt", b"{}", "unsupported file type '.txt'"),
        ("prompts.csv", b"id,prompt\n1,hi\n", "unsupported file type"),
        ("noext", b"{}", "unsupported file type"),
        ("corrupt.parquet", b"PAR1 definitely not parquet", "corrupt parquet"),
        ("empty.parquet", b"", "corrupt parquet"),
        ("bad.json", b"[{", "invalid JSON"),
        ("emptyarray.json", b"[]", "no prompts"),
    ],
)
def test_file_error(tmp_path: Path, tiny_model_dir: Path, name: str, content: bytes | None,
                    keyword: str) -> None:
    f = tmp_path / name
    if content is not None:
        f.write_bytes(content)
    err = load_error(f, tiny_model_dir)
    assert len(err.errors) == 1 and err.errors[0].startswith(str(f))
    assert keyword in err.errors[0]


def test_parquet_id_column_must_be_complete(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_parquet(tmp_path / "p.parquet", [
        {"id": "a", "prompt_token_ids": [1]},
        {"id": None, "prompt_token_ids": [1]},
        {"id": "c", "prompt_token_ids": [VOCAB]},
        {"id": "a", "prompt_token_ids": [1], "n": 0},
    ])
    assert load_error(f, tiny_model_dir).errors == [
        f"{f}: row 2: missing id",
        f"{f}: row 3: prompt_token_ids[0] = {VOCAB} is out of range for vocab size {VOCAB}",
        f"{f}: row 4: n must be in 1..16384 (vLLM's own limit on responses per prompt), got 0",
        f"{f}: row 4: duplicate id 'a' (also on row 1)",
    ]


def test_parquet_without_prompt_column(tmp_path: Path, tiny_model_dir: Path) -> None:
    f = write_parquet(tmp_path / "p.parquet", [{"id": 1, "question": "hi"}])
    assert "no 'prompt' or 'prompt_token_ids' column" in str(load_error(f, tiny_model_dir))


def test_verl_duplicate_index_names_source(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = verl_rows()
    data[2]["extra_info"]["index"] = 0
    f = write_parquet(tmp_path / "train.parquet", data)
    msg = str(load_error(f, tiny_model_dir))
    assert msg.startswith(f"{f}: row 3: duplicate id '0'") and "extra_info.index" in msg


def test_chat_template_failure_is_row_error(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = prompts._load_tokenizer

    def no_template(model_dir: Path) -> Any:
        tok = real(model_dir)
        tok.chat_template = None
        return tok

    monkeypatch.setattr(prompts, "_load_tokenizer", no_template)
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": "t", "prompt": "plain text is fine"},
                                           {"id": "c", "prompt": CHAT}])
    err = load_error(f, tiny_model_dir)
    assert len(err.errors) == 1 and err.errors[0].startswith(f"{f}:2: cannot render")
