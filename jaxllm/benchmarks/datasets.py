"""Benchmark workloads with vLLM's flags: `--dataset-name random|jsonl`.

random: prompts of random token ids whose lengths are uniform in
[N(1-R), N(1+R)] for `--random-input-len N --random-range-ratio R` (outputs likewise
with `--random-output-len M`), as vLLM's `RandomDataset`; R = 0 gives fixed lengths.
jsonl: one prompt per line of `--dataset-path`, either a JSON object
`{"prompt": "text" or [ids], "output_len": 128}` (`max_tokens` / `output_tokens` also
read; no length: `--random-output-len`) or a bare line of text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: str | list[int]  # token ids (random) or text / ids (jsonl)
    output_len: int


def check_range_ratio(ratio: float) -> float:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio} "
                         f"(lengths are uniform in [N*(1-R), N*(1+R)])")
    return ratio


def length_range(n: int, ratio: float) -> tuple[int, int]:
    """The inclusive [low, high] of lengths around n (low >= 1)."""
    check_range_ratio(ratio)
    return max(1, math.floor(n * (1 - ratio))), max(1, math.ceil(n * (1 + ratio)))


def random_lengths(num: int, n: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    low, high = length_range(n, ratio)
    return rng.integers(low, high + 1, size=num)


def random_dataset(num: int, input_len: int, output_len: int, ratio: float, vocab_size: int,
                   seed: int = 0) -> list[Sample]:
    """`num` prompts of random ids (away from the first and last ids, often special)."""
    rng = np.random.default_rng(seed)
    ins = random_lengths(num, input_len, ratio, rng)
    outs = random_lengths(num, output_len, ratio, rng)
    margin = min(100, vocab_size // 4)
    return [Sample(rng.integers(margin, vocab_size - margin, size=int(i)).tolist(), int(o))
            for i, o in zip(ins, outs)]


def jsonl_dataset(path: str, num: int | None, default_output_len: int) -> list[Sample]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = line
            if isinstance(row, str):
                out.append(Sample(row, default_output_len))
            elif isinstance(row, dict) and isinstance(row.get("prompt"), (str, list)):
                n = row.get("output_len", row.get("max_tokens", row.get("output_tokens", default_output_len)))
                out.append(Sample(row["prompt"], int(n)))
            else:
                raise ValueError(f"{path}:{lineno}: expected text or a JSON object with 'prompt'")
            if num is not None and len(out) == num:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """vLLM's dataset flags (`--input-len` / `--output-len` kept as aliases)."""
    p.add_argument("--dataset-name", choices=["random", "jsonl"], default="random")
    p.add_argument("--dataset-path", default=None, help="jsonl: one prompt per line")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int, default=128)
    p.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [N*(1-R), N*(1+R)], 0 <= R < 1")


def load_dataset(args: argparse.Namespace, vocab_size: int) -> list[Sample]:
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        return jsonl_dataset(args.dataset_path, args.num_prompts, args.random_output_len)
    return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                          args.random_range_ratio, vocab_size, getattr(args, "seed", 0))


def max_lengths(args: argparse.Namespace) -> tuple[int, int]:
    """Upper bounds of (prompt, output) lengths the random dataset can draw (max_model_len)."""
    return (length_range(args.random_input_len, args.random_range_ratio)[1],
            length_range(args.random_output_len, args.random_range_ratio)[1])


def percentiles(values, scale: float = 1000.0) -> dict:
    """mean / p50 / p90 / p99 (scaled, default seconds -> ms); Nones when empty."""
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}
