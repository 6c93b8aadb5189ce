"""The sampler's per-row parameters: as the jitted draw reads them, and packed for the transfer.

`SamplingTensors` has fifteen fields; shipped as fifteen arrays they cost fifteen host-to-device
transfers per step, each with its own host-side dispatch (on the H200 host, `Sampler.prepare`'s
`device_put` was a third to a half of the serving engine thread's time, py-spy,
`scripts/gpu_structured_profile.sh`). `pack` puts them in three arrays: the float knobs, the
integer ones with the history and suppressed ids, and the bitmask; `PackedSampling.unpack`
slices them back inside the jitted function, where slicing is free.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("greedy", "top_k", "step", "prompt_len", "num_logprobs")  # then seed (2 words), history, suppress


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as device arrays (R = padded row count).

    Padding rows are greedy with every knob disabled, so they cost nothing and
    never force the top-k/top-p sort.
    """

    temperature: jax.Array  # [R] f32; greedy and padding rows hold 1.0
    greedy: jax.Array  # [R] bool; True for greedy and padding rows
    top_k: jax.Array  # [R] i32; disabled -> V
    top_p: jax.Array  # [R] f32; disabled -> 1.0
    min_p: jax.Array  # [R] f32; disabled -> 0.0
    presence_penalty: jax.Array  # [R] f32
    frequency_penalty: jax.Array  # [R] f32
    repetition_penalty: jax.Array  # [R] f32
    seed: jax.Array  # [R, 2] uint32 (high, low) words of the 64-bit seed = a threefry key
    step: jax.Array  # [R] i32 number of tokens generated so far (folded into the key)
    prompt_len: jax.Array  # [R] i32; history[:, :prompt_len] is prompt, the rest output
    history: jax.Array  # [R, H] i32 prompt+output ids, -1 padded; H = max_model_len, or 1 if no penalties
    suppress_ids: jax.Array  # [R, S] i32 ids forced to -inf (min_tokens not reached); -1 padded
    num_logprobs: jax.Array  # [R] i32 requested top-n logprobs; -1 = none
    bitmask: jax.Array  # [R, ceil(V/32)] i32 allowed-token bits (structured outputs), or [R, 0]: none


@dataclasses.dataclass(frozen=True)
class PackedSampling:
    """`SamplingTensors` in three arrays (R = padded rows, H = history width, S = suppress width)."""

    floats: jax.Array  # [6, R] f32: _FLOATS in order
    ints: jax.Array  # [R, 7 + H + S] i32: _INTS | seed high, low (bit-cast uint32) | history | suppress
    bitmask: jax.Array  # [R, ceil(V/32)] i32, or [R, 0]: no constrained row
    history_width: int  # H (static)

    def unpack(self) -> SamplingTensors:
        f, i, n, h = self.floats, self.ints, len(_INTS), self.history_width
        named = {name: f[k] for k, name in enumerate(_FLOATS)}
        named.update({name: i[:, k] for k, name in enumerate(_INTS)})
        named["greedy"] = named["greedy"] != 0
        named["seed"] = jax.lax.bitcast_convert_type(i[:, n:n + 2], jnp.uint32)
        named["history"] = i[:, n + 2:n + 2 + h]
        named["suppress_ids"] = i[:, n + 2 + h:]
        return SamplingTensors(**named, bitmask=self.bitmask)


jax.tree_util.register_dataclass(PackedSampling, data_fields=["floats", "ints", "bitmask"],
                                 meta_fields=["history_width"])


def pack(t: SamplingTensors) -> PackedSampling:
    """Host numpy `SamplingTensors` -> `PackedSampling` of numpy arrays (ready for one device_put)."""
    floats = np.stack([np.asarray(getattr(t, name), np.float32) for name in _FLOATS])
    cols = [np.asarray(getattr(t, name)).astype(np.int32)[:, None] for name in _INTS]
    seed = np.ascontiguousarray(np.asarray(t.seed, np.uint32)).view(np.int32)
    ints = np.concatenate(cols + [seed, np.asarray(t.history, np.int32), np.asarray(t.suppress_ids, np.int32)],
                          axis=1)
    return PackedSampling(floats, ints, np.asarray(t.bitmask, np.int32), int(t.history.shape[1]))
