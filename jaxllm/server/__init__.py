"""OpenAI-compatible HTTP server (`jaxllm serve`): FastAPI app over `AsyncLLM`.

Kept import-light on purpose: `jaxllm.engine.async_engine` imports
`request_stream` from here, and must not pull in FastAPI.
"""
