"""Bad input: exit 2, a message naming the row (`file:line: reason`), the option or the path, and no
run state, from `seerd run`, `seerd slurm-run`, `seerd submit` and `seerd.submit()` alike. Sampling
settings are judged by vLLM's own SamplingParams (the real one: it imports without a GPU)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

from seerd.cli.main import EXIT_BAD_INPUT, cli


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


GOOD = {"id": "a", "prompt_token_ids": [5, 6, 7]}
FILE_CASES = {
    "wrong type": (jsonl(GOOD, {"id": "b", "prompt_token_ids": "5 6 7"}), ":2:", "prompt_token_ids"),
    "n is a string": (jsonl(GOOD, {"id": "b", "prompt_token_ids": [1], "n": "4"}), ":2:", "n"),
    "missing prompt": (jsonl({"id": "a"}), ":1:", "prompt"),
    "missing id": (jsonl(GOOD, {"prompt_token_ids": [1]}), ":2:", "id"),
    "empty prompt": (jsonl({"id": "a", "prompt": ""}), ":1:", "empty"),
    "empty token list": (jsonl({"id": "a", "prompt_token_ids": []}), ":1:", "empty"),
    "too long for the model": (jsonl({"id": "a", "prompt_token_ids": [5] * 5000}), ":1:",
                               "max_model_len 4096 (max_position_embeddings in the model's config.json)"),
    "temperature vLLM refuses": (jsonl(GOOD, {**GOOD, "id": "b", "temperature": 2.5}), ":2:",
                                 "vLLM refuses these sampling settings: temperature must be in [0, 2], got 2.5."),
    "top_k vLLM refuses": (jsonl(GOOD, {**GOOD, "id": "b", "top_k": -5}), ":2:", "top_k must be 0 (disable)"),
    "NaN top_p": (jsonl(GOOD, b'{"id": "b", "prompt_token_ids": [1], "top_p": NaN}'), ":2:",
                  "top_p must be a finite number, got nan"),
    "infinite temperature": (jsonl(b'{"id": "b", "prompt_token_ids": [1], "temperature": -Infinity}'), ":1:",
                             "temperature must be a finite number, got -inf"),
    "n beyond vLLM's limit": (jsonl({**GOOD, "n": 100000}), ":1:", "n must be in 1..16384"),
    "n <= 0": (jsonl({"id": "a", "prompt_token_ids": [5], "n": 0}), ":1:", "n"),
    "max_tokens <= 0": (jsonl({"id": "a", "prompt_token_ids": [5], "max_tokens": -3}), ":1:", "max_tokens"),
    "duplicate ids": (jsonl(GOOD, {"id": "x", "prompt_token_ids": [1]}, GOOD), ":3:", "duplicate"),
    "broken json": (jsonl(GOOD, b'{"id": "b", "prompt_token_ids": [1'), ":2:", "JSON"),
    "non-utf8 bytes": (jsonl(GOOD, b'{"id": "\xff\xfe", "prompt_token_ids": [1]}'), ":2:", "UTF-8"),
    # Valid JSON whose string is no text: SQLite could not store it, and the failed creation used to
    # leave a run directory every later command failed on.
    "id with a lone surrogate": (jsonl(GOOD, b'{"id": "b\\ud800", "prompt_token_ids": [1]}'), ":2:",
                                 "lone surrogate"),
    "empty file": (b"", "prompts.jsonl", "no prompts"),
}


def invoke(tmp_path, *extra, input_path=None, model=None):
    run_dir = tmp_path / "run"
    args = ["run", "--input", str(input_path or tmp_path / "prompts.jsonl"), "--model", str(model),
            "--run-dir", str(run_dir), "--no-progress", *extra]
    result = CliRunner().invoke(cli, args)
    return result, run_dir


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_bad_prompt_file(case, tmp_path, tiny_model_dir):
    content, where, reason = FILE_CASES[case]
    (tmp_path / "prompts.jsonl").write_bytes(content)
    result, run_dir = invoke(tmp_path, model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert where in result.output and reason.lower() in result.output.lower(), result.output
    assert not run_dir.exists()


def test_every_bad_row_is_reported_together(tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl({"id": "a"}, GOOD, {"id": "c", "prompt_token_ids": [1], "n": -1}))
    result, run_dir = invoke(tmp_path, model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT
    assert ":1:" in result.output and ":3:" in result.output
    assert not run_dir.exists()


def test_missing_input_file(tmp_path, tiny_model_dir):
    result, run_dir = invoke(tmp_path, input_path=tmp_path / "nope.jsonl", model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT and "nope.jsonl" in result.output
    assert not run_dir.exists()


@pytest.mark.parametrize("model", ["missing", "empty", "unreadable"])
def test_unusable_model_directory(model, tmp_path):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl(GOOD))
    model_dir = tmp_path / "model"
    if model != "missing":
        model_dir.mkdir()
    if model == "unreadable":
        (model_dir / "config.json").write_text("{not json")
    result, run_dir = invoke(tmp_path, model=model_dir)
    assert result.exit_code == EXIT_BAD_INPUT and str(model_dir) in result.output, result.output
    assert not run_dir.exists()


@pytest.mark.parametrize("flags,word", [
    (["--workers", "0"], "--workers"), (["--n", "0"], "--n"), (["--max-tokens", "0"], "--max-tokens"),
    (["--chunk-tokens", "0"], "--chunk-tokens"), (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"), (["--kv-cache-gib", "0"], "--kv-cache-gib"),
    # vLLM's own rules, for the options alone (before any row is read).
    (["--temperature", "3"], "--temperature 3.0 --top-p 1.0 --top-k -1: vLLM refuses these sampling settings: "
                             "temperature must be in [0, 2], got 3.0."),
    (["--top-k", "-5"], "top_k must be 0 (disable), or at least 1, got -5."),
    (["--top-k", str(2**64)], "vLLM cannot send these sampling settings to its engine core (MessagePack)"),
    # NaN and infinity, which compare false with every bound.
    (["--lease-ttl", "nan"], "--lease-ttl must be a finite number (got nan)"),
    (["--lease-ttl", "inf"], "--lease-ttl must be a finite number (got inf)"),
    (["--temperature", "nan"], "--temperature must be a finite number (got nan)"),
    (["--top-p", "-inf"], "--top-p must be a finite number (got -inf)"),
    (["--kv-cache-gib", "nan"], "--kv-cache-gib must be a finite number (got nan)"),
    (["--spec", "grouped", "--spec-probe-weight", "inf"], "--spec-probe-weight must be a finite number"),
    # Bounds, each with its reason.
    (["--lease-ttl", "0.1"], "--lease-ttl must be in [1, 3600] (got 0.1): workers renew their leases"),
    (["--lease-ttl", "86400"], "--lease-ttl must be in [1, 3600] (got 86400)"),
    (["--n", "20000"], "--n must be in 1..16384 (got 20000): vLLM's own limit on responses per prompt"),
    (["--workers", "10000"], "--workers must be in 1..4096 (got 10000): each worker is a vLLM engine"),
    (["--max-num-seqs", "100000"], "--max-num-seqs must be in 1..4096 (got 100000): vLLM sets aside"),
    (["--kv-cache-gib", "1e6"], "--kv-cache-gib must be in (0, 4096] (got 1e+06)"),
    (["--chunk-tokens", str(2**31)], "--chunk-tokens must be in 1..2147483647"),
    (["--max-tokens", str(2**40)], "--max-tokens must be in 1..2147483647"),
    (["--max-model-len", "1"], "--max-model-len must be in 2..2147483647 (got 1): room for one prompt"),
    (["--seed", str(2**63)], "--seed must be in -9223372036854775808..9223372036854775807"),
    (["--spec", "grouped", "--spec-depth", "0"], "--spec-depth"),
    (["--spec", "grouped", "--spec-probe-weight", "0"], "--spec-probe-weight"),
    (["--spec", "grouped", "--spec-profile", "/no/such/profile.json"], "--spec-profile"),
    (["--spec", "off", "--spec-history", "."], "--spec-history"),
    (["--spec", "grouped", "--spec-history", "/no/such/run"], "no run there"),
    (["--kv-pool-size", "lots"], "--kv-pool-size"), (["--kv-pool-size", "1MiB"], "--kv-pool-size"),
    pytest.param(["--spec", "suffix"], "arctic-inference", marks=pytest.mark.skipif(
        importlib.util.find_spec("arctic_inference") is not None, reason="arctic-inference is installed here")),
])
def test_impossible_settings(flags, word, tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl(GOOD))
    result, run_dir = invoke(tmp_path, *flags, model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT and word in result.output, result.output
    assert not run_dir.exists()


def test_resume_and_export_of_an_unknown_run(tmp_path):
    for command in ("resume", "export"):
        result = CliRunner().invoke(cli, [command, str(tmp_path / "nowhere")])
        assert result.exit_code == EXIT_BAD_INPUT and "no run at" in result.output
    result = CliRunner().invoke(cli, ["db", "upgrade", str(tmp_path / "nowhere")])
    assert result.exit_code == EXIT_BAD_INPUT


def test_prior_that_is_not_a_run(tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl(GOOD))
    result, run_dir = invoke(tmp_path, "--prior", str(tmp_path / "nowhere"), model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT and "--prior" in result.output and "no run there" in result.output
    assert not run_dir.exists()


def test_prior_that_is_unfinished(tmp_path, tiny_model_dir):
    from tests.unit.helpers import make_book

    (tmp_path / "earlier").mkdir()
    make_book(tmp_path / "earlier")  # a run that was created and never finished
    (tmp_path / "prompts.jsonl").write_bytes(jsonl(GOOD))
    result, run_dir = invoke(tmp_path, "--prior", str(tmp_path / "earlier"), model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT and "not finished" in result.output, result.output
    assert not run_dir.exists()


# ---------------------------------------------------------------- the engine's context length

def test_prompt_length_against_max_model_len(tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl({"id": "a", "prompt_token_ids": [5] * 10}))
    result, run_dir = invoke(tmp_path, "--max-model-len", "12", "--max-tokens", "4", model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT
    assert ":1: prompt length 10 + max_tokens 4 = 14 exceeds max_model_len 12 (--max-model-len)" in result.output
    assert not run_dir.exists()


def test_a_directory_that_existed_gets_nothing_new(tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl({**GOOD, "temperature": 2.5}))
    (tmp_path / "run").mkdir()
    result, run_dir = invoke(tmp_path, model=tiny_model_dir)
    assert result.exit_code == EXIT_BAD_INPUT and ":1: vLLM refuses" in result.output
    assert list(run_dir.iterdir()) == []


# ---------------------------------------------------------------- slurm-run, submit, seerd.submit()

def slurm_run(tmp_path, monkeypatch, *extra):
    """`seerd slurm-run` as inside a one-node CPU allocation (no job is needed to refuse input)."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node01")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "2")
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_MEM_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    return CliRunner().invoke(cli, ["slurm-run", "--input", str(tmp_path / "prompts.jsonl"), *extra,
                                    "--run-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("row,flags,words", [
    ({**GOOD, "temperature": 2.5}, [], ":1: vLLM refuses these sampling settings: temperature must be in [0, 2]"),
    (GOOD, ["--top-k", "-5"], "--top-k -5: vLLM refuses"),
    (GOOD, ["--drain-grace", "nan"], "--drain-grace must be a finite number (got nan)"),
    (GOOD, ["--lease-ttl", "nan"], "--lease-ttl must be a finite number"),
    # The worker applies --engine-arg last: that is the length its engine runs with.
    ({"id": "a", "prompt_token_ids": [5] * 10}, ["--engine-arg", "max_model_len=12", "--max-tokens", "4"],
     ":1: prompt length 10 + max_tokens 4 = 14 exceeds max_model_len 12 (--engine-arg max_model_len)"),
    (GOOD, ["--engine-arg", "max_model_len=-1"], "vLLM's -1 fits the length to memory"),
    (GOOD, ["--engine-arg", "max_model_len=big"], "--engine-arg max_model_len must be an integer (got 'big')"),
    (GOOD, ["--max-model-len", "64", "--engine-arg", "max_model_len=32"], "disagree"),
])
def test_slurm_run_refuses_before_creating_anything(row, flags, words, tmp_path, tiny_model_dir, monkeypatch):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl(row))
    result = slurm_run(tmp_path, monkeypatch, "--model", str(tiny_model_dir), *flags)
    assert result.exit_code == EXIT_BAD_INPUT and words in result.output, result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("row,flags,words", [
    ({**GOOD, "top_p": 0}, [], ":1: vLLM refuses these sampling settings: top_p must be in (0, 1]"),
    (GOOD, ["--temperature", "inf"], "--temperature must be a finite number"),
    (GOOD, ["--drain-grace", "nan"], "drain_grace_s must be a finite number"),
])
def test_submit_refuses_before_creating_anything(row, flags, words, tmp_path, tiny_model_dir):
    (tmp_path / "prompts.jsonl").write_bytes(jsonl(row))
    result = CliRunner().invoke(cli, ["submit", "--input", str(tmp_path / "prompts.jsonl"), "--model",
                                      str(tiny_model_dir), "--run-dir", str(tmp_path / "run"), "--cluster", "local",
                                      "--gpus-per-worker", "0", *flags])
    assert result.exit_code == EXIT_BAD_INPUT and words in result.output, result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("row,options,words", [
    ({**GOOD, "temperature": 2.5}, {}, ":1: vLLM refuses"),
    (GOOD, {"top_k": -5}, "top_k must be 0 (disable)"),
    (GOOD, {"lease_ttl": float("nan")}, "--lease-ttl must be a finite number"),
    (GOOD, {"kv_cache_gib": float("inf")}, "--kv-cache-gib must be a finite number"),
    (GOOD, {"n": "4"}, "--n must be an integer (got '4')"),
    (GOOD, {"n": True}, "--n must be an integer (got True)"),
    (GOOD, {"temperature": "hot"}, "--temperature must be a number (got 'hot')"),
    (GOOD, {"time_min": float("nan")}, "time_min must be an integer (got nan)"),
    (GOOD, {"engine_args": {"max_model_len": 2}}, ":1: prompt too long: 3 tokens, and max_model_len 2"),
])
def test_python_submit_refuses_before_creating_anything(row, options, words, tmp_path, tiny_model_dir):
    import seerd
    from seerd.launch.prepare import BadRun

    (tmp_path / "prompts.jsonl").write_bytes(jsonl(row))
    with pytest.raises(BadRun) as refused:
        seerd.submit(tmp_path / "prompts.jsonl", tiny_model_dir, tmp_path / "run", gpus_per_worker=0,
                     cluster="local", **options)
    assert words in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_resume_refuses_a_worker_count_out_of_bounds(tmp_path):
    result = CliRunner().invoke(cli, ["resume", str(tmp_path / "run"), "--workers", "-3"])
    assert result.exit_code == EXIT_BAD_INPUT and "--workers must be in 1..4096 (got -3)" in result.output
