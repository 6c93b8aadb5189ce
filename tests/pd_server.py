"""A tiny-model OpenAI server with a JaxTransferConnector, for the P/D tests.

`python tests/pd_server.py ROLE` serves until killed (the producer, so the test can SIGKILL it)
on a port the OS picks, printed as `PORT n` once bound; `Served(app)` runs one in a thread of
the test process, likewise on a socket bound before the server starts (no free-port race).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time

TINY = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)


def build(role: str, **extra):
    from jaxllm.engine.async_engine import AsyncLLM
    from jaxllm.models.loader import embedded_model_path
    from jaxllm.models.tokenizer import Tokenizer
    from jaxllm.server.app import build_app

    tok = Tokenizer.from_gguf(embedded_model_path())
    kv = {"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_connector_extra_config": extra}
    engine = AsyncLLM.from_config(hf_config=TINY, tokenizer=tok, max_model_len=256, max_num_seqs=4,
                                  token_buckets=(64,), seq_buckets=(4,), dtype="float32", seed=3,
                                  kv_transfer_config=kv, skip_warmup=True)
    return engine, build_app(engine, ["tiny"])


def bound() -> socket.socket:
    """A socket on 127.0.0.1 bound now, to a free port the OS picks."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class Served:
    def __init__(self, app):
        import uvicorn
        sock = bound()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.server.serve(sockets=[sock]),), daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


if __name__ == "__main__":
    import uvicorn
    _, app = build(sys.argv[1], lease_s=30)
    sock = bound()
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
