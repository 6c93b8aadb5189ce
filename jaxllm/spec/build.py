"""Start-up of speculative decoding: the draft's checks, its share of the KV pool, the proposer.

`draft_config` runs before the target's runner is built: it reads the draft's config only
(missing path, vocabulary, EAGLE hidden size: ValueErrors naming speculative_config.model)
and says how many bytes each KV block costs the draft, so the pool is sized for both.
`build_decoder` then makes the `SpecDecoder` with its proposer.
"""

from __future__ import annotations

from jaxllm.spec.config import SpeculativeConfig


def draft_config(spec: SpeculativeConfig, cfg, target_cfg, dtype) -> tuple[dict | None, int]:
    """(the draft's HF config or None for ngram, its KV bytes per block)."""
    if spec.model is None:
        return None, 0
    import jax
    from jaxllm.spec.draft import check_draft
    hf = check_draft(spec, target_cfg.vocab_size, target_cfg.hidden_size)
    if cfg.tensor_parallel_size > 1 or cfg.num_processes > 1 or jax.process_count() > 1:
        raise ValueError(f"speculative_config.method {spec.method!r} with tensor_parallel_size > 1 "
                         "or several processes is not implemented (use method 'ngram')")
    if spec.method == "draft_model":
        from jaxllm.spec.draft_model import page_bytes
        return hf, page_bytes(hf, cfg.block_size, dtype)
    raise ValueError(f"speculative_config.method {spec.method!r} is not implemented yet")


def build_decoder(engine, spec: SpeculativeConfig, draft_hf: dict | None, num_host_blocks: int):
    from jaxllm.spec.decoder import SpecDecoder
    proposer = None
    if spec.method == "draft_model":
        from jaxllm.spec.draft_model import DraftModelProposer, load_draft
        try:
            hf, weights = load_draft(spec.model, engine.cfg.load_format, engine.cfg.cache_dir)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"speculative_config.model: cannot load the draft: {e}") from e
        r = engine.runner
        proposer = DraftModelProposer(
            hf, weights, k=spec.num_speculative_tokens, dtype=r.dtype, num_blocks=r.num_blocks,
            block_size=engine.cfg.block_size, max_blocks=r.max_blocks, max_copies=engine.cfg.max_num_seqs,
            num_host_blocks=num_host_blocks, kv=engine.kv, no_ids=r.no_ids,
            seq_buckets=engine.seq_buckets, attention_backend=engine.cfg.attention_backend,
            seed=engine.cfg.seed)
    return SpecDecoder(spec, engine.model_cfg.vocab_size, engine.sampler.max_logprobs,
                       engine.runner.max_rows, proposer)
