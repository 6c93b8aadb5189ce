"""jaxllm: a vLLM-class LLM inference and serving engine in JAX."""

from jaxllm.sampling_params import SamplingParams
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name):  # import the engine (and jax) only when it is used
    if name == "LLM":
        from jaxllm.llm import LLM
        return LLM
    raise AttributeError(name)
