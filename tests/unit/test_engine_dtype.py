"""What `--dtype auto` means for an engine (`seerd.worker.vllm_args.engine_dtype`)."""

from __future__ import annotations

import json

from seerd.worker.vllm_args import checkpoint_dtype, engine_dtype


def test_auto_runs_a_float32_checkpoint_in_float32_on_cpu_and_leaves_the_rest_to_vllm(tmp_path):
    def checkpoint(name: str, config: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    fp32 = checkpoint("fp32", {"dtype": "float32"})
    old_fp32 = checkpoint("old", {"torch_dtype": "float32"})  # transformers before 4.56
    vl_fp32 = checkpoint("vl", {"text_config": {"dtype": "float32"}})
    bf16 = checkpoint("bf16", {"torch_dtype": "bfloat16"})
    unnamed = checkpoint("unnamed", {})
    assert [checkpoint_dtype(p) for p in (fp32, old_fp32, vl_fp32, bf16, unnamed)] == \
        ["float32", "float32", "float32", "bfloat16", None]
    assert [engine_dtype("auto", p, cuda=False) for p in (fp32, old_fp32, vl_fp32)] == ["float32"] * 3
    assert engine_dtype("auto", bf16, cuda=False) == "auto" and engine_dtype("auto", unnamed, cuda=False) == "auto"
    assert engine_dtype("auto", fp32, cuda=True) == "auto"  # a GPU's own choice (half precision)
    assert engine_dtype("bfloat16", fp32, cuda=False) == "bfloat16"  # what is asked for, as asked
