"""OpenAI-compatible HTTP server (`jaxllm serve`): FastAPI app over `AsyncLLM`."""
