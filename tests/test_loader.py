"""Model files -> config, weights, tokenizer: checked against transformers' own loaders.

The transformers references (GGUF model and tokenizer) are slow, so each is built once per module.
To keep the GGUF model reference affordable (~90 s -> ~15 s here) it runs with two speed-ups that
do not touch tensor values: gguf's tensor-name map is memoized, and gguf.GGUFReader is swapped for
our subclass that only parses *metadata arrays* in bulk (tensor layout, data and dequantization
stay gguf's stock code; the tokenizer reference uses transformers' separate metadata reader).
The torch-free claim is checked in a subprocess, because this process imports torch for references.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxllm.models.detokenizer import IncrementalDetokenizer, find_stop
from jaxllm.models.gguf_file import load_gguf
from jaxllm.models.loader import (MARKER, _write_converted, cache_path, convert, embedded_model_path,
                                  load_model_files, resolve_model)
from jaxllm.models.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "héllo wörld — ünïcödé ñ, 日本語のテキスト, 中文, Ελληνικά, русский",
    "emoji 😀👍🏽 🇺🇸 family 👨‍👩‍👧 end",
    "def f(x):\n    return x**2  # square\n\n\tif x: pass\r\n",
    "   many    spaces\n\n\n\ttabs\t\t  ",
    "numbers 1234567 3.14159 -42 1e-6",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
    " leading space",
    "It's we're they'll I'd DON'T",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 🤔"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "thanks"}],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return embedded_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path: str) -> tuple[dict, dict, dict]:
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def tok(ours: tuple[dict, dict, dict]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(ours[2])


@pytest.fixture(scope="module")
def hf_model(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import gguf

    from jaxllm.models.gguf_file import _FastGGUFReader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", _FastGGUFReader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                                 gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="module")
def hf_tok(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


# ---- (1) GGUF weights and config -----------------------------------------------------------------
def test_gguf_weights_equal_transformers(ours, hf_model) -> None:
    config, weights, _ = ours
    ref = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    assert config["tie_word_embeddings"] and "lm_head.weight" not in weights
    assert set(ref) - {"lm_head.weight"} == set(weights)
    for name, w in weights.items():
        assert w.dtype == np.float32 and w.shape == ref[name].shape, name
        if not np.array_equal(w, ref[name]):  # exact is expected; allow float noise only
            np.testing.assert_allclose(w, ref[name], rtol=0, atol=1e-6, err_msg=name)
    assert np.array_equal(ref["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_gguf_config_matches_transformers(ours, hf_model) -> None:
    config, ref = ours[0], hf_model.config
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias"):
        assert config[key] == getattr(ref, key), key
    assert config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps)
    rope = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta}
    assert config["rope_theta"] == rope["rope_theta"]
    assert config["rope_scaling"] is None and rope.get("rope_type", "default") == "default"
    assert config["architectures"] == ["LlamaForCausalLM"]


# ---- (2) tokenizer and chat template -------------------------------------------------------------
def test_tokenizer_matches_transformers(tok, hf_tok) -> None:
    for text in TEXTS:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == hf_tok.encode(text, add_special_tokens=add), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id)
    assert tok.vocab_size == len(hf_tok) == 49152


def test_chat_template_matches_transformers(tok, hf_tok) -> None:
    for messages in CHATS:
        for gen in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == hf_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            ids = hf_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True) == list(ids)


def test_chat_template_features(tok) -> None:
    import jinja2

    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
                "{% endif %}{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}GO{{ eos_token }}{% endif %}")
    out = tok.apply_chat_template([{"role": "user", "content": "é<&>"}], chat_template=template)
    assert out == '<|im_start|>{"role": "user", "content": "é<&>"}\nGO<|im_end|>'
    with pytest.raises(jinja2.TemplateError, match="no bad"):
        tok.apply_chat_template([{"role": "bad", "content": ""}], chat_template=template)


# ---- (3) incremental detokenizer and stop strings ------------------------------------------------
def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool, chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.finish()]


def test_detokenizer_streams_multibyte_without_replacement(tok) -> None:
    split = 0
    for text in TEXTS[1:4]:
        ids = tok.encode(text)
        split += any("\ufffd" in tok.decode([i]) for i in ids)  # tokens that hold part of a character
        deltas = _stream(tok, tok.encode("Say:"), ids, skip=True)
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas) and deltas[-1] == ""
    assert split  # the texts really exercise characters split across tokens


def test_detokenizer_random_ids_concatenate_to_decode(tok) -> None:
    rng = np.random.default_rng(0)
    fragments = sorted({i for t in TEXTS for i in tok.encode(t) if "\ufffd" in tok.decode([i])})
    special = [0, 1, 2, 5]
    for trial in range(150):
        pool = rng.choice(3, size=int(rng.integers(1, 40)), p=[0.4, 0.5, 0.1])
        ids = [int(rng.integers(0, tok.vocab_size)) if k == 0 else int(rng.choice(fragments)) if k == 1
               else int(rng.choice(special)) for k in pool]
        prompt = [int(x) for x in rng.integers(0, tok.vocab_size, size=int(rng.integers(0, 8)))]
        skip = bool(trial % 2)
        deltas = _stream(tok, prompt, ids, skip, chunk=int(rng.integers(1, 4)))
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (prompt, ids)


def test_find_stop() -> None:
    assert find_stop("Hello world", 5, ["wor"], include_stop=False) == 6
    assert find_stop("Hello world", 5, ["wor"], include_stop=True) == 9
    assert find_stop("abcXYZ", 2, ["XY"], False) == 3  # match straddles the previous text
    assert find_stop("STOP and more", 4, ["STOP"], False) is None  # old text was already searched
    assert find_stop("a b c d", 7, ["d", "b"], False) == 2  # earliest match wins
    assert find_stop("a b c d", 7, ["c d", "d"], True) == 7
    assert find_stop("anything", 3, [], False) is None
    assert find_stop("anything", 3, [""], False) is None
    assert find_stop("xyz", 0, ["z"], False) is None


# ---- (4) conversion cache ------------------------------------------------------------------------
_FIRST_LOAD = """
import json, sys, time
from jaxllm.models.loader import load_model_files
from jaxllm.models.detokenizer import IncrementalDetokenizer
t = time.perf_counter()
config, weights, tok = load_model_files(None, cache_dir=sys.argv[1])
dt = time.perf_counter() - t
d = IncrementalDetokenizer(tok, [])
text = "".join(d.add([i]) for i in tok.encode("héllo 😀"))
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
print(json.dumps({"seconds": dt, "torch": "torch" in sys.modules, "text": text, "n": len(weights), "chat": chat}))
"""


def test_cache_round_trip_is_torch_free_and_faster(tmp_path, ours, tok) -> None:
    import orbax.checkpoint  # noqa: F401  (import cost is not what this measures)

    cache = str(tmp_path / "cache")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _FIRST_LOAD, cache], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"subprocess {time.perf_counter() - t:.2f}s")
    assert first["torch"] is False and first["text"] == "héllo 😀" and first["n"] == len(ours[1])
    entry = cache_path(resolve_model(None), cache)
    assert os.path.isfile(os.path.join(entry, MARKER)) and os.listdir(cache) == [os.path.basename(entry)]

    t = time.perf_counter()
    config, weights, tok2 = load_model_files(None, cache_dir=cache)
    second = time.perf_counter() - t
    print(f"first load {first['seconds']:.2f}s, cached load {second:.2f}s")
    assert second < first["seconds"] / 1.5
    assert config == ours[0] and set(weights) == set(ours[1])
    for name, w in ours[1].items():
        assert weights[name].dtype == np.float32 and np.array_equal(weights[name], w), name
    assert first["chat"] == tok2.apply_chat_template([{"role": "user", "content": "hi"}])
    for text in TEXTS:
        assert tok2.encode(text) == tok.encode(text)
    assert (tok2.bos_token_id, tok2.eos_token_id, tok2.vocab_size) == (tok.bos_token_id, tok.eos_token_id, 49152)


def test_concurrent_publish_keeps_first_and_cleans_up(tmp_path, tok) -> None:
    dst = str(tmp_path / "entry")
    src = embedded_model_path()
    _write_converted(dst, src, {"a": 1}, {"w": np.ones((2, 3), np.float32)}, tok)
    with pytest.raises(FileExistsError):
        _write_converted(dst, src, {"a": 2}, {"w": np.zeros((2, 3), np.float32)}, tok)
    assert os.listdir(tmp_path) == ["entry"]  # the loser's temp folder is gone
    config, weights, _ = load_model_files(dst)
    assert config == {"a": 1} and np.array_equal(weights["w"], np.ones((2, 3), np.float32))


# ---- (5) HF folders ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_sharded_folder(tmp_path, tok, dtype) -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder, max_shard_size="200KB")
    tok.save(str(folder))
    assert (folder / "model.safetensors.index.json").is_file()
    assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) > 1

    config, weights, tok2 = load_model_files(str(folder), cache_dir=str(tmp_path / "cache"))
    ref = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert set(weights) == set(ref)
    for name, w in weights.items():
        assert w.dtype == np.float32 and np.array_equal(w, ref[name]), name
    assert config["num_hidden_layers"] == 2 and config["model_type"] == "llama" and "rope_theta" in config
    assert tok2.encode(TEXTS[2]) == tok.encode(TEXTS[2]) and tok2.chat_template == tok.chat_template
    # HF folders are read lazily in place (no float32 copy in the cache).
    assert not os.path.exists(tmp_path / "cache")

    # convert() writes a folder that is a model path of its own (no cache involved).
    dst = str(tmp_path / "converted")
    assert convert(str(folder), dst) == dst
    config3, weights3, tok3 = load_model_files(dst, cache_dir=str(tmp_path / "unused"))
    assert config3 == config and all(np.array_equal(weights3[k], weights[k]) for k in weights)
    assert tok3.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and not os.path.exists(tmp_path / "unused")
    with pytest.raises(FileExistsError):
        convert(str(folder), dst)


def test_missing_or_empty_paths_raise_clearly(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model_files(missing, cache_dir=str(tmp_path / "c"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="empty"):
        load_model_files(str(empty), cache_dir=str(tmp_path / "c"))
    assert resolve_model(None).endswith(".gguf") and os.path.isfile(resolve_model(None))
    assert resolve_model(os.path.dirname(resolve_model(None))) == resolve_model(None)
