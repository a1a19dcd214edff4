"""Write a random-weight stand-in for the default pair: HF safetensors directories with the shapes of
Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft), each with a tokenizer directory's files.

For timing the engine where the real weights cannot travel (a lent GPU machine without PyPI): the
forwards, the step and the benchmark run exactly as on the real pair, but the outputs are noise, so
acceptance rates and everything that follows from them (speculation's gain) mean nothing. Left as
initialised, the LM head gives near-uniform logits (top-p 0.95 keeps ~130k of 151,936 tokens per row, a
sampling cost no real model has); `--head-scale` (default 10) sharpens them to what real models keep
(1 to ~150 tokens, q_max 0.3-0.97 on a few probes of the draft).

    python scripts/random_pair.py --tokenizer TOKENIZER_DIR --out DIR   # DIR/target, DIR/draft
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# The GGUF files' own shapes (specverify.models.loader.load_config on the default pair).
SHAPES = {
    "target": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960),
    "draft": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_model(name: str, out: Path, tokenizer: Path, seed: int, head_scale: float) -> Path:
    config = Qwen2Config(
        vocab_size=151936,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        **SHAPES[name],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model = model.to(torch.bfloat16)
    directory = out / name
    model.save_pretrained(directory)
    for file in TOKENIZER_FILES:
        if (tokenizer / file).is_file():
            shutil.copy(tokenizer / file, directory / file)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--head-scale", type=float, default=10.0, help="LM head weights times this")
    args = parser.parse_args()
    if not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"{args.tokenizer} has no tokenizer.json")
    for seed, name in enumerate(SHAPES):
        print(write_model(name, args.out, args.tokenizer, seed, args.head_scale))


if __name__ == "__main__":
    main()
