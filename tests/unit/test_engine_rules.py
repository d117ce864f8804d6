"""The input is checked by the rules the workers' engines will apply (seerd/launch/engine_rules.py):
vLLM's own SamplingParams (the real one), called as the worker calls it, and the context length the
worker will really pass to vLLM, which the run stores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import select

from seerd.config import ROLLOUT_DEFAULTS, build_config
from seerd.db import Group, make_engine, make_sessionmaker
from seerd.io.prompts import ContextLength, load_model_limits
from seerd.launch import engine_rules
from seerd.launch.engine_rules import SamplingCheck, context_length
from seerd.launch.prepare import prepare_run
from seerd.rundir import RunDir
from seerd.worker.vllm_args import engine_args

REPO = Path(__file__).resolve().parents[2]


def config_for(model_dir: Path, input_path: Path, **options):
    return build_config(workers=1, input_path=input_path, model_path=model_dir, **{**ROLLOUT_DEFAULTS, **options})


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"id": str(k), "prompt_token_ids": [5, 6], **row}) + "\n"
                            for k, row in enumerate(rows)))
    return path


def stored_sampling(run_dir: Path) -> list[dict]:
    engine = make_engine(RunDir(run_dir).db_path)
    with make_sessionmaker(engine)() as session:
        found = [json.loads(text) for text in session.scalars(select(Group.sampling_json).order_by(Group.group_index))]
    engine.dispose()
    return found


def test_unusual_but_valid_settings_create_the_run(tmp_path, tiny_model_dir):
    rows = [{"temperature": 0, "top_k": 0}, {"top_k": 10**12, "top_p": 1e-9}, {"temperature": 1e-5, "seed": 10**30},
            {"stop_token_ids": [2, 9], "ignore_eos": True}, {}]
    prompts = write_rows(tmp_path / "p.jsonl", rows)
    config = config_for(tiny_model_dir, prompts, temperature=2.0, top_k=0, chunk_tokens=4)
    prepared = prepare_run(RunDir(tmp_path / "run"), config, prompts)
    assert prepared.created and prepared.groups == len(rows) and prepared.notes == []
    sampling = stored_sampling(tmp_path / "run")
    assert [s["temperature"] for s in sampling] == [0.0, 2.0, 1e-5, 2.0, 2.0]
    assert sampling[2]["seed"] == 10**30 and sampling[1]["top_k"] == 10**12


def test_the_check_is_the_workers_call_once_per_distinct_setting(tmp_path, tiny_model_dir, monkeypatch):
    calls = []
    real = engine_rules.sampling_params

    def spy(max_tokens, sampling):  # noqa: ANN001, ANN202
        calls.append((max_tokens, msgspec.structs.asdict(sampling)))
        return real(max_tokens, sampling)

    monkeypatch.setattr(engine_rules, "sampling_params", spy)
    prompts = write_rows(tmp_path / "p.jsonl", [{"top_p": 0.5}] * 50 + [{"max_tokens": 3}] * 50 + [{}] * 50)
    prepare_run(RunDir(tmp_path / "run"), config_for(tiny_model_dir, prompts, chunk_tokens=8, max_tokens=32), prompts)
    # The options alone (= the rows that override nothing), then each distinct row setting, with the
    # first chunk's budget and a per-chunk seed, as LeaseBook._grant hands them to the worker.
    budgets = [budget for budget, _ in calls]
    assert budgets == [8, 8, 3]
    assert [sampling["top_p"] for _, sampling in calls] == [1.0, 0.5, 1.0]
    for _, sampling in calls:
        assert set(sampling) == {"temperature", "top_p", "top_k", "stop_token_ids", "seed", "ignore_eos"}
        assert 0 <= sampling["seed"] < 2**31


def test_the_run_stores_the_context_length_the_prompts_were_checked_against(tmp_path):
    # A multimodal config: the worker's own fallback would read no top-level length and pass 4096.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(
        {"vocab_size": 8, "text_config": {"vocab_size": 1024, "max_position_embeddings": 64}}))
    prompts = write_rows(tmp_path / "p.jsonl", [{}])
    prepared = prepare_run(RunDir(tmp_path / "run"), config_for(model_dir, prompts, max_tokens=16), prompts)
    assert prepared.config.engine.max_model_len == 64
    assert engine_args(str(model_dir), prepared.config.engine, 0)["max_model_len"] == 64


def test_an_engine_arg_length_is_left_for_the_worker_to_apply(tmp_path, tiny_model_dir):
    prompts = write_rows(tmp_path / "p.jsonl", [{}])
    config = config_for(tiny_model_dir, prompts, max_tokens=16, engine_args={"max_model_len": 32})
    prepared = prepare_run(RunDir(tmp_path / "run"), config, prompts)
    assert prepared.config.engine.max_model_len is None
    assert engine_args(str(tiny_model_dir), prepared.config.engine, 0)["max_model_len"] == 32


@pytest.mark.parametrize("max_model_len,engine_arg,expected", [
    (None, None, ContextLength(4096, "max_position_embeddings in the model's config.json")),
    (128, None, ContextLength(128, "--max-model-len")),
    (None, 256, ContextLength(256, "--engine-arg max_model_len")),
    (256, 256, ContextLength(256, "--engine-arg max_model_len")),
])
def test_context_length_sources(max_model_len, engine_arg, expected, tmp_path, tiny_model_dir):
    config = config_for(tiny_model_dir, tmp_path / "p.jsonl", max_model_len=max_model_len,
                        engine_args=None if engine_arg is None else {"max_model_len": engine_arg})
    assert context_length(config.engine, load_model_limits(tiny_model_dir)) == expected


def test_without_vllm_the_sampling_is_not_checked_and_the_user_is_told(tmp_path, tiny_model_dir, monkeypatch):
    """A host that only submits may lack vLLM (it is an optional dependency): warn, do not refuse."""
    monkeypatch.setitem(sys.modules, "vllm.exceptions", None)  # `import` of a None entry raises ImportError
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", None)
    prompts = write_rows(tmp_path / "p.jsonl", [{"temperature": 2.5}])
    prepared = prepare_run(RunDir(tmp_path / "run"), config_for(tiny_model_dir, prompts), prompts)
    assert prepared.created
    (note,) = prepared.notes
    assert note.startswith("vLLM cannot be imported here (ModuleNotFoundError") and "not checked" in note


def test_the_options_check_names_the_options(tmp_path, tiny_model_dir):
    check = SamplingCheck(config_for(tiny_model_dir, tmp_path / "p.jsonl", temperature=2.5, top_p=0.5))
    assert check.options_problem() == ("--temperature 2.5 --top-p 0.5 --top-k -1: vLLM refuses these sampling "
                                       "settings: temperature must be in [0, 2], got 2.5.")


def test_the_cli_and_the_rules_import_no_vllm():
    """`seerd --help` stays fast: vLLM (seconds to import) loads only when a run's input is checked."""
    code = ("import sys, seerd.cli.main, seerd.launch.engine_rules; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_engine_counters_sum_steps_running_preemptions_and_step_clocks():
    from seerd.worker.counters import EngineCounters

    class Scheduler:  # the two members of vLLM's v1 scheduler the counters read
        def __init__(self):
            self.running = ["a", "b", "c"]

        def _preempt_request(self, request, timestamp):
            return (request, timestamp)

    scheduler = Scheduler()
    counters = EngineCounters(scheduler)
    counters.after_step(5.0, 4.0)  # the warm-up step, forgotten by reset
    counters.reset()
    assert scheduler._preempt_request("r", 1.0) == ("r", 1.0)  # still vLLM's own behaviour
    counters.after_step(0.02, 0.015, 0.004)
    scheduler.running.pop()
    counters.after_step(0.04, 0.025)
    figures = counters.figures()
    assert figures["steps"] == 2 and figures["preemptions"] == 1
    assert figures["mean_running"] == 2.5
    assert abs(figures["step_s"] - 0.06) < 1e-12 and abs(figures["step_cpu_s"] - 0.04) < 1e-12
    assert figures["longest_step_s"] == 0.04 and figures["step_runq_s"] == 0.004


def test_engine_counters_keep_the_engines_speed_per_batch_size_from_the_core_outputs():
    from types import SimpleNamespace

    from seerd.worker.counters import EngineCounters

    class Scheduler:
        running: list = []

        def _preempt_request(self, request, timestamp):
            return None

    class CoreClient:  # vLLM's in-process engine core client: one get_output per step
        def __init__(self):
            self.steps = iter([[3, 1, 0], [1] * 5, [2] * 5, [4]])  # new tokens per request output

        def get_output(self):
            return SimpleNamespace(outputs=[SimpleNamespace(new_token_ids=[7] * n) for n in next(self.steps)])

    counters = EngineCounters(Scheduler())
    core = CoreClient()
    counters.count_outputs(core)
    for seconds in (0.01, 0.02, 0.03, 0.004):
        core.get_output()
        counters.after_step(seconds)
    counters.after_step(0.5)  # a step with no outputs (a prefill in progress): no batch size
    by_batch = counters.figures()["by_batch"]
    # Two decoding sequences (one output had no token) -> bucket 2; five -> bucket 4 (4-7); one -> 1.
    assert by_batch == {"1": [1, 0.004, 4], "2": [1, 0.01, 4], "4": [2, 0.05, 15]}


def test_the_thread_clock_reads_this_threads_cpu_and_run_queue_wait_from_the_kernel():
    import threading
    import time

    from seerd.cpu import ThreadClock

    def spin(seconds: float) -> None:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass

    clock = ThreadClock()
    cpu, waited = clock.read()
    spin(0.05)
    other = threading.Thread(target=spin, args=(0.2,))  # another thread's CPU is not this one's
    other.start()
    other.join()
    cpu_after, waited_after = clock.read()
    clock.close()
    assert 0.05 <= cpu_after - cpu < 0.2 and waited_after >= waited >= 0.0
    assert clock.read()[1] == 0.0  # closed: the CPU clock alone
