"""The offline entry point: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from specverify.config import DRAFT_QUANTIZATIONS, ConfigError, EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine
from specverify.engine.sequence import RequestOutput
from specverify.models.base import ModelRunner
from specverify.sampling_params import SamplingParams


@dataclass
class LoadedModels:
    target: ModelRunner
    tokenizer: object
    draft: ModelRunner | None
    target_name: str
    draft_name: str | None


def resolve_model_path(path: str | None, default: str) -> Path:
    from specverify.models import assets

    if path is None:
        return assets.default_target() if default == "target" else assets.default_draft()
    return Path(path).expanduser()


def load_models(
    model: str | None = None,
    draft_model: str | None = None,
    speculative: bool = True,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    progress: bool = True,
    draft_vocab_size: int | None = None,
    draft_quantization: str | None = None,
    target_int4_rows: int | None = None,
) -> LoadedModels:
    """Load target (and draft, when speculating) runners plus the target's tokenizer; None = default pair.
    `draft_vocab_size` (None / 0: all): the draft's logits cover only that many most frequent token ids
    (see `draft_vocab.py`); `draft_quantization` ("int4", "int8"): the draft's small-batch matmuls run
    on quantized weights (see `models/quant.py`). `target_int4_rows` (None: the environment's
    SPECVERIFY_TARGET_INT4_ROWS, else 4; 0: never): target forwards over at most that many rows run the
    GGUF file's own Q4_K weights through the int4 kernel, and its Q6_K ones through `models/ggml.py`'s
    kernel where it builds (see `LlamaModel.use_checkpoint_codes`); where `models/q4k.py`'s kernel runs
    (AVX512-VNNI or AVX2), the Q4_K weights go through it instead at up to its own `Q4K_ROWS` rows."""
    from specverify.models.ggml import q6k_row_limit
    from specverify.models.int4_kernel import int4_kernels
    from specverify.models.loader import load_runner, model_name
    from specverify.models.q4k import Q4K_ACT_GROUP, Q4K_ROWS, q4k_instructions

    if target_int4_rows is None:
        raw = os.environ.get("SPECVERIFY_TARGET_INT4_ROWS", str(_QUANTIZED_ROWS))
        if not raw.isdigit():
            raise ConfigError(f"SPECVERIFY_TARGET_INT4_ROWS must be a row count >= 0 (0: never), got {raw!r}")
        target_int4_rows = int(raw)
    target_path = resolve_model_path(model, "target")
    target, tokenizer = load_runner(
        str(target_path),
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        progress=progress,
        int4_rows=target_int4_rows,
    )
    target_name = model_name(str(target_path))
    if target.model.int4_weights():
        target_name += f" (Q4_K int4 <= {target_int4_rows} rows)"  # keys cached cost profiles apart
    if target.model.q4k_weights():  # int8 activations per group: also keys cached cost profiles apart
        target_name += f" (Q4_K {q4k_instructions()} q8/{Q4K_ACT_GROUP} <= {Q4K_ROWS} rows)"
    if target.model.q6k_weights():
        target_name += f" (Q6_K {q4k_instructions()} q8/32 <= {q6k_row_limit()} rows)"
    draft = draft_name = None
    if speculative:
        draft_path = resolve_model_path(draft_model, "draft")
        draft, draft_tokenizer = load_runner(
            str(draft_path), dtype=dtype, device=device, max_model_len=max_model_len, progress=progress
        )
        check_same_vocabulary(tokenizer, draft_tokenizer, target, draft)
        draft_name = model_name(str(draft_path))
        bits = DRAFT_QUANTIZATIONS[draft_quantization]
        rows = quantize_draft(draft, bits) if bits else 0  # before the subset: its head then takes that form
        if rows:
            kernel = f" {q4k_instructions()}" if bits == 4 and int4_kernels() is not None else ""
            draft_name += f" (int{bits}{kernel} <= {rows} rows)"  # keys cached cost profiles apart
        if draft_vocab_size and draft_vocab_size < draft.vocab_size:
            restrict_draft_vocabulary(draft, draft_tokenizer, draft_vocab_size, progress)
            draft_name += f" (draft vocab {draft_vocab_size})"  # also keys cached cost profiles apart
    return LoadedModels(target, tokenizer, draft, target_name, draft_name)


# Forwards over at most this many rows use the int4 weights: on a 2-core AVX512 CPU int4 (group 32) ran
# a whole 0.5B draft forward 2.0-2.2x faster than packed bf16 at 1-2 rows, 1.45x at 3, 1.2x at 4, and
# lost from 5 rows on; the 1.5B target's (its Q4_K weights as stored, the rest bf16) on a 2-core
# AVX512-BF16 EPYC 1.70x / 1.61x / 1.27x / 1.24x at 1-4 rows, 0.75x at 5; in float32 on a 2-core AVX2
# EPYC 1.92x / 1.45x at 1-2 rows, 1.40x at 4, even at 8.
_QUANTIZED_ROWS = 4
# With `models/int4_kernel.py` (AVX512-VNNI, int8 activations per 32 values) the int4 draft beat packed
# bf16 at every row count measured: whole 0.5B draft forward 12.5 / 17.4 / 33.1 / 53.0 ms at 1 / 4 / 8 / 16
# rows against 35.6 / 34.4 / 44.5 / 62.9 (PyTorch's int4 kernel: 18.3 / 29.5 / 53.3 / 100.6).
_DRAFT_KERNEL_ROWS = 16


def quantize_draft(draft, bits: int) -> int:
    """Give the draft's matmuls quantized weights where this device has the kernels; up to how many rows
    they are used (0: not quantized)."""
    from specverify.models.int4_kernel import int4_kernels
    from specverify.models.quant import can_quantize_weights

    if not can_quantize_weights(draft.dtype, draft.device):
        return 0
    rows = _DRAFT_KERNEL_ROWS if bits == 4 and int4_kernels() is not None else _QUANTIZED_ROWS
    draft.model.quantize_weights(bits=bits, max_rows=rows, group_size=32)
    return rows


def restrict_draft_vocabulary(draft, tokenizer, size: int, progress: bool = True) -> None:
    """Narrow the draft runner's logits to the `size` most frequent token ids of `tokenizer`."""
    from specverify.draft_vocab import frequent_token_ids

    try:
        ids = frequent_token_ids(tokenizer, size, progress=progress)
    except ValueError as e:
        raise ConfigError(f"draft_vocab_size: {e}") from e
    draft.restrict_logits(ids)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target: ModelRunner, draft: ModelRunner) -> None:
    if target.vocab_size != draft.vocab_size or target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ConfigError(
            f"draft and target vocabularies differ ({draft.vocab_size} vs {target.vocab_size} logits, "
            f"{len(draft_tokenizer)} vs {len(target_tokenizer)} tokenizer entries): the draft model must share "
            "the target's tokenizer"
        )


class LLM:
    """Load a target (and a draft model for speculation) and generate text in batches.

    `speculative_config` follows vLLM: {"method": "draft_model", "model": PATH, "num_speculative_tokens": 5,
    "enable_adaptive_verification": true}. `model=None` / `"model": None` use the default pair.
    {"method": "suffix", "num_speculative_tokens": 16} drafts from the request's own text (no draft model).
    """

    def __init__(
        self,
        model: str | None = None,
        speculative_config: dict | str | SpeculativeConfig | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        max_prefill_tokens: int | None = 512,
        seed: int = 0,
        record_trace: str | None = None,
        logprobs_mode: str = "raw_logprobs",
        kv_cache_memory: float | None = None,
        models: LoadedModels | None = None,
        cost_model=None,
    ) -> None:
        spec = SpeculativeConfig.from_any(speculative_config)
        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_prefill_tokens=max_prefill_tokens,
            seed=seed,
            speculative=spec,
            record_trace=record_trace,
            logprobs_mode=logprobs_mode,
            kv_cache_memory=kv_cache_memory,
        )
        self.models = models or load_models(
            model,
            spec.model if spec else None,
            spec is not None and spec.method == "draft_model",  # the suffix drafter needs no model
            dtype,
            device,
            max_model_len,
            draft_vocab_size=spec.draft_vocab_size if spec else None,
            draft_quantization=spec.draft_quantization if spec else None,
        )
        self.tokenizer = self.models.tokenizer
        self.engine = LLMEngine(
            self.models.target,
            self.tokenizer,
            config,
            draft=self.models.draft,
            cost_model=cost_model,
            model_name=self.models.target_name,
        )

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return self._run([self.encode(p) for p in prompts], params, use_tqdm)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.apply_chat_template(c) for c in conversations]
        return self._run(ids, [sampling_params or SamplingParams()] * len(ids), use_tqdm)

    def _run(
        self, prompt_ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        order = [self.engine.add_request(ids, p) for ids, p in zip(prompt_ids, params, strict=True)]
        done: dict[str, list[RequestOutput]] = {rid: [] for rid in order}
        total = sum(p.n for p in params)
        with tqdm(total=total, desc="generating", disable=not use_tqdm, unit="seq") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.group_id].append(out)
                        bar.update(1)
        return [_merge_samples(done[rid]) for rid in order]


def _merge_samples(samples: list[RequestOutput]) -> RequestOutput:
    """One output per prompt, as vLLM gives it: `outputs` holds every sample in index order, and the
    fields of sample 0 stand for the request (so `n = 1` reads as before)."""
    samples = sorted(samples, key=lambda out: out.index)
    return replace(samples[0], request_id=samples[0].group_id, outputs=samples)
