"""Start-up of speculative decoding: the draft's checks, its share of the KV pool, the proposer.

`draft_config` runs before the target's runner is built: it checks the draft's config (missing
path, vocabulary, EAGLE hidden size: ValueErrors naming speculative_config.model), places a draft
model's weights on the device (so the pool is sized from the memory left beside both models), and
says how many bytes each KV block costs the draft, so the pool holds both models' pages.
`build_decoder` then makes the `SpecDecoder` with its proposer.
"""

from __future__ import annotations

from jaxllm.spec.config import SpeculativeConfig


def draft_config(spec: SpeculativeConfig, cfg, target_cfg, dtype) -> tuple[dict | None, int, tuple[int, ...]]:
    """(what build_decoder needs of the draft (a draft model: its config and weights placed on
    the device; EAGLE: its config), its KV bytes per block, the target hidden states an EAGLE
    head reads (`Llama.capture`)); None, 0, () for ngram."""
    if spec.model is None:
        return None, 0, ()
    import jax
    from jaxllm.spec.draft import check_draft
    hf = check_draft(spec, target_cfg.vocab_size, target_cfg.hidden_size)
    if cfg.num_processes > 1 or jax.process_count() > 1:
        raise ValueError(f"speculative_config.method {spec.method!r} with several processes "
                         f"(num_processes={max(cfg.num_processes, jax.process_count())}) is not implemented: "
                         "followers would need the draft's batches too; run one process "
                         "(tensor_parallel_size > 1 works there) or use method 'ngram'")
    tp = cfg.tensor_parallel_size
    if spec.method == "draft_model":  # weights placed now: the pool is sized beside them
        from jaxllm.spec.draft_model import load_draft, page_bytes, place_weights
        if tp > 1:  # heads the mesh cannot split: refused before any weight is read
            page_bytes(hf, cfg.block_size, dtype, tp)
        try:
            hf, weights = load_draft(spec.model, cfg.load_format, cfg.cache_dir)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"speculative_config.model: cannot load the draft: {e}") from e
        placed = place_weights(hf, weights, dtype, cfg.attention_backend, cfg.seed, tp,
                               queries_per_request=spec.num_speculative_tokens + 1)
        return {"hf": hf, "placed": placed}, page_bytes(hf, cfg.block_size, dtype, tp), ()
    import jax.numpy as jnp
    from jaxllm.models.config import ModelConfig
    from jaxllm.spec.eagle import aux_layers
    if target_cfg.moe is not None or target_cfg.architecture not in ("LlamaForCausalLM", "MistralForCausalLM",
                                                                     "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        raise ValueError(f"speculative_config.method {spec.method!r}: EAGLE heads over a "
                         f"{target_cfg.architecture} target are not implemented (dense Llama-family only)")
    if cfg.quantization is not None:
        raise ValueError(f"speculative_config.method {spec.method!r} with quantization is not implemented")
    from jaxllm.spec.draft import kv_heads_per_device
    from jaxllm.spec.eagle_tp import HEAD
    head = ModelConfig.from_hf(dict(hf, model_type="llama"))
    per_block = 2 * kv_heads_per_device(head, tp, HEAD) * cfg.block_size * head.head_dim * jnp.dtype(dtype).itemsize
    return hf, per_block, aux_layers(hf, spec.method, target_cfg.num_layers)


def build_decoder(engine, spec: SpeculativeConfig, draft_hf: dict | None, num_host_blocks: int):
    from jaxllm.spec.decoder import SpecDecoder
    proposer = None
    if spec.method == "draft_model":
        from jaxllm.spec.draft_model import DraftModelProposer, load_draft
        if draft_hf is None:  # (not prepared by draft_config: load it here)
            hf, weights = load_draft(spec.model, engine.cfg.load_format, engine.cfg.cache_dir)
            placed = None
        else:
            hf, weights, placed = draft_hf["hf"], None, draft_hf["placed"]
        r = engine.runner
        proposer = DraftModelProposer(
            hf, weights, placed=placed, k=spec.num_speculative_tokens, dtype=r.dtype, num_blocks=r.num_blocks,
            block_size=engine.cfg.block_size, max_blocks=r.max_blocks, max_copies=engine.cfg.max_num_seqs,
            num_host_blocks=num_host_blocks, kv=engine.kv, no_ids=r.no_ids,
            seq_buckets=engine.seq_buckets, attention_backend=engine.cfg.attention_backend,
            seed=engine.cfg.seed, tp=engine.cfg.tensor_parallel_size)
    elif spec.method in ("eagle", "eagle3"):
        from jaxllm.spec.eagle import EagleProposer
        proposer = EagleProposer(
            spec.model, spec.method, runner=engine.runner, k=spec.num_speculative_tokens,
            block_size=engine.cfg.block_size, max_copies=engine.cfg.max_num_seqs,
            num_host_blocks=num_host_blocks, kv=engine.kv, requests=engine.scheduler.requests,
            seq_buckets=engine.seq_buckets, max_num_seqs=engine.cfg.max_num_seqs,
            attention_backend=engine.cfg.attention_backend)
    decoder = SpecDecoder(spec, engine.model_cfg.vocab_size, engine.sampler.max_logprobs,
                          engine.runner.max_rows, proposer)
    decoder.overlap = engine.runner.spec_width > 0
    return decoder
