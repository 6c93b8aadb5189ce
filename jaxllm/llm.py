"""Offline inference API mirroring `vllm.LLM`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from jaxllm.config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jaxllm.beam_search import BeamSearchOutput, BeamSearchParams

PromptType = str | list[int] | dict


def _as_prompt(p: PromptType) -> str | list[int]:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        return p["prompt"]
    return p


class LLM:
    """Generate text for a batch of prompts with continuous batching.

    Keyword arguments are `EngineConfig` fields (vLLM's names), e.g.
    `LLM(dtype="float32", max_model_len=1024, max_num_seqs=32)`. With no model
    the embedded SmolLM2-135M-Instruct is used.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - names - {"hf_config", "weights", "tokenizer_obj"})
        if unknown:
            raise TypeError(f"unknown LLM arguments: {unknown}")
        extra = {k: kwargs.pop(k) for k in ("hf_config", "weights", "tokenizer_obj") if k in kwargs}
        self.config = EngineConfig(model=model, **{"usage_context": "llm", **kwargs})
        self.engine = LLMEngine(self.config, hf_config=extra.get("hf_config"),
                                weights=extra.get("weights"), tokenizer=extra.get("tokenizer_obj"))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_as_prompt(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        # Validate everything before queueing anything: a bad prompt fails the call cleanly.
        for p, sp, pr in zip(prompts, params, priority):
            self.engine.validate(self.engine.tokenize(p)[1], sp, pr)
            if sp.structured_outputs is not None:  # offline: wait for the compile, raise its reason
                self.engine.structured.compiler.compile_now(sp.structured_outputs)
        # Only the final outputs are read (vLLM's LLM asks for FINAL_ONLY too): the engine then
        # builds no per-step output. The caller's objects are left as they are.
        final = {id(sp): dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params}
        params = [final[id(sp)] for sp in params]
        ids = []
        for p, sp, pr in zip(prompts, params, priority):
            rid = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(rid, p, sp, priority=pr)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: "BeamSearchParams", use_tqdm: bool = False) -> list["BeamSearchOutput"]:
        """Beam search as `vllm.LLM.beam_search`: one `BeamSearchOutput` per prompt.

        Beams share KV blocks by reference count (see `jaxllm.beam_search`).
        """
        from jaxllm.beam_search import BeamSearch

        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.tokenize(_as_prompt(p))[1] for p in prompts]
        for p in ids:
            self.engine.validate(p, SamplingParams(max_tokens=1))
            if len(p) >= self.engine.max_model_len:
                raise ValueError(f"prompt length {len(p)} leaves no room to generate within "
                                 f"max_model_len {self.engine.max_model_len}")
        return BeamSearch(self.engine, params).run(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer / chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False)
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
