"""What the engine settles before it builds anything: the checkpoint it serves (files, a
pre-quantized checkpoint, or random weights of a named shape) and the shapes of its steps
(`max_model_len`, the padded request and token buckets)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jaxllm.config import (EngineConfig, default_buckets, default_max_num_batched_tokens,
                           default_token_buckets)

log = logging.getLogger("jaxllm")


@dataclass(frozen=True)
class Checkpoint:
    hf_config: dict
    weights: object  # name -> array as loaded, or None (random weights)
    tokenizer: object  # or None
    owned: bool  # weights loaded here, consumed while stacking


def load_checkpoint(cfg: EngineConfig, hf_config: dict | None, weights, tokenizer) -> Checkpoint:
    """The caller's config and weights when given; else random weights of `cfg.model`'s config
    (`load_format="dummy"` or `random_shape`), a pre-quantized checkpoint as stored (HF FP8, GGUF
    with quantization="gguf"), or the checkpoint's files."""
    owned = hf_config is None
    if hf_config is None and (cfg.load_format == "dummy" or cfg.random_shape):
        from jaxllm.models.dummy import dummy_model
        hf_config, loaded_tok = dummy_model(cfg.model, cfg.random_shape)
        tokenizer = tokenizer or loaded_tok
    elif hf_config is None:
        from jaxllm.models.loader import load_model_files
        from jaxllm.quantization.checkpoints import load_prequantized
        loaded = load_prequantized(cfg.model, cfg.quantization)
        hf_config, weights, loaded_tok = loaded or load_model_files(cfg.model, cfg.cache_dir)
        tokenizer = tokenizer or loaded_tok
    return Checkpoint(hf_config, weights, tokenizer, owned)


@dataclass(frozen=True)
class StepShapes:
    max_model_len: int
    seq_buckets: tuple[int, ...]  # padded request (logits row) counts
    token_buckets: tuple[int, ...]  # padded token counts; the last is max_num_batched_tokens


def step_shapes(cfg: EngineConfig, model_cfg, platform: str) -> StepShapes:
    """`max_model_len` (the model's, at most 2,048 unless given; capped to a sliding window,
    where full attention is exact) and the buckets from `max_num_batched_tokens` (by platform
    and entry point unless given) and `max_num_seqs`."""
    max_model_len = cfg.max_model_len or min(model_cfg.max_position_embeddings, 2048)
    window = model_cfg.sliding_window
    if window and max_model_len > window:
        log.warning("sliding-window attention is not implemented: capping max_model_len %d to "
                    "the window %d, where full attention is exact", max_model_len, window)
        max_model_len = window
    max_tokens = cfg.max_num_batched_tokens or default_max_num_batched_tokens(
        platform, cfg.usage_context, cfg.max_num_seqs)
    seq_buckets = cfg.seq_buckets or default_buckets(cfg.max_num_seqs, 8)
    if cfg.seq_buckets is None and platform == "gpu" and model_cfg.moe is not None and seq_buckets[0] != 2:
        # A batch of one in a small bucket of its own, as vLLM captures a graph for it: its top_k
        # routed rows take the unsorted-row grouped matmul, without the sort, scatters and gathers
        # a padded bucket's rows need (Qwen3-30B-A3B on an H100: 4.82 ms a step in a bucket of
        # one against 5.19 ms in the bucket of 8; session 35). Two tokens rather than one: XLA
        # compiles a one-row step into more kernels (each RMSNorm a reduce and a scale, each
        # small one-row product padded to two rows, the K/V write a slice and an update), and
        # the padding row costs no expert reads (the direct kernel skips its id E): 4.77 ms and
        # 977 kernels against 5.46 ms and 1,451 on one H100 (docs/benchmarks.md, session 36).
        seq_buckets = (2, *[b for b in seq_buckets if b > 2])
    spec_cfg = cfg.speculative_config
    if spec_cfg is not None:  # a logits row per draft position (jaxllm/spec/decoder.py)
        from jaxllm.spec.decoder import row_buckets
        seq_buckets = row_buckets(seq_buckets, cfg.max_num_seqs, spec_cfg,
                                  explicit=cfg.seq_buckets is not None)
    token_buckets = cfg.token_buckets or default_token_buckets(max_tokens, seq_buckets)
    if seq_buckets[-1] < cfg.max_num_seqs:
        raise ValueError(f"largest seq bucket {seq_buckets[-1]} < max_num_seqs {cfg.max_num_seqs}")
    return StepShapes(max_model_len, tuple(seq_buckets), tuple(token_buckets))
