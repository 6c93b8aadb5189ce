"""Speculative decoding: proposers, the rejection sampler, and the engine hook.

`config.py` (the validated `speculative_config`), `ngram.py` (prompt lookup, numpy only),
`draft_model.py` (a small model with its own paged KV, one jitted loop of k draft steps),
`eagle.py` (EAGLE / EAGLE-3 heads over the target's hidden states), `draft.py` / `build.py`
(start-up checks and assembly), `rejection.py` (exact verification on the device), `decoder.py` (the engine's one hook:
extra logits rows for draft positions, acceptance, proposals, metrics). The scheduler
side lives in `jaxllm/runtime` (`Request.spec_token_ids`, rollback in `Scheduler.update`).
"""
