"""The jitted step's inputs on the device: a `HostBatch` packed into two int32 arrays.

Packed by length (T tokens, R rows), a step costs two host-to-device transfers; the fields
unpack by free slices inside the step. The shape comment of each field names its dimensions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.batch import HostBatch
from jaxllm.kernels.metadata import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """A step's inputs as two int32 arrays, so a step costs two host-to-device transfers.

    The nine fields of a `HostBatch` as nine arrays cost nine transfers, each
    with its own host-side dispatch; packed by length (T or R), they unpack by
    free slices inside the jitted step. `num_seqs` is not sent: real rows, and
    only they, have a non-zero `seq_len` (checked when packing).
    """

    per_token: jax.Array  # [5, T] int32: tokens, positions, token_req, slot_mapping, prev_index
    # [R, B + 3 + S] int32: block table (B) | seq_len | logits index | query end | spec entry (S)
    per_row: jax.Array
    # S: columns of the overlapped speculative entry (`HostBatch.spec_prev`, spec/shift.py); 0: none
    spec_width: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def from_host(cls, hb: HostBatch, sharding=None, spec_width: int = 0) -> "Batch":
        if int(hb.num_seqs[0]) != int(np.count_nonzero(hb.seq_lens)):
            raise ValueError(f"num_seqs {hb.num_seqs[0]} != rows with a context {hb.seq_lens}")
        prev = hb.prev_index if hb.prev_index is not None else np.full_like(hb.tokens, -1)
        per_token = np.stack([hb.tokens, hb.positions, hb.token_req, hb.slot_mapping, prev])
        cols = [hb.block_tables, hb.seq_lens[:, None], hb.logits_indices[:, None],
                hb.query_start_loc[1:, None]]
        if spec_width:
            R = len(hb.seq_lens)
            cols.append(hb.spec_prev if hb.spec_prev is not None else np.full((R, spec_width), -1, np.int32))
        per_row = np.concatenate(cols, axis=1, dtype=np.int32)
        return jax.device_put(cls(per_token, per_row, spec_width), sharding)

    @property
    def _B(self) -> int:
        return self.per_row.shape[1] - 3 - self.spec_width

    def tokens(self, prev_ids: jax.Array) -> jax.Array:  # [T]
        """Token ids, with the previous step's sampled ids ([P]) where they were unknown."""
        prev = self.per_token[4]
        return jnp.where(prev >= 0, prev_ids[jnp.maximum(prev, 0)], self.per_token[0])

    @property
    def logits_indices(self) -> jax.Array:  # [R]
        return self.per_row[:, self._B + 1]

    @property
    def md(self) -> AttentionMetadata:
        rows, B = self.per_row, self._B
        seq_lens = rows[:, B]
        qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), rows[:, B + 2]])
        num_seqs = jnp.count_nonzero(seq_lens).astype(jnp.int32)[None]
        return AttentionMetadata(self.per_token[1], self.per_token[2], self.per_token[3],
                                 rows[:, :B], seq_lens, qsl, num_seqs)

    def copied(self) -> "Batch":
        """The same batch read from a copy the step makes (JAXLLM_STABLE_BATCH=1, an experiment).
        The step's inputs are new buffers every step, and XLA fuses their cheap slicing into each
        layer's kernels, so every layer's command buffer (CUDA graph) reads a buffer whose address
        changed and may be updated every step (session 29, the compiled batch-1 steps). A sort
        keyed by iota (the identity, which XLA neither fuses into its consumers nor removes)
        gives the layers one temporary to read, at the same address from step to step."""
        def copy(a: jax.Array) -> jax.Array:
            flat = a.reshape(-1)
            keys = jnp.arange(flat.shape[0], dtype=jnp.int32)
            return jax.lax.sort((keys, flat), num_keys=1)[1].reshape(a.shape)
        return Batch(copy(self.per_token), copy(self.per_row), self.spec_width)

    def inputs(self, prev_ids: jax.Array, block_size: int) -> tuple[jax.Array, AttentionMetadata]:
        """(token ids [T], attention metadata), moved back over the drafts the previous step
        rejected where this step overlaps a speculative one (jaxllm/spec/shift.py)."""
        tokens, md = self.tokens(prev_ids), self.md
        if not self.spec_width:
            return tokens, md
        from jaxllm.spec import shift
        return shift.correct(tokens, md, self.per_row[:, self._B + 3:], self.per_token[4], prev_ids,
                             block_size)
