"""A run's roofline: for each engine step, the larger of bytes moved / copy bandwidth and
FLOPs / matmul rate, summed over the run's steps; both rates measured in the same process.

Per step, for the tokens it ran (T), the rows it sampled and each row's context:
  FLOPs = 2 * (matmul params) * T + 2 * E * V * sampled + 4 * L * H * D * (query, key) pairs
  bytes = weights + KV read (each row's whole context) + KV written (T tokens)
(causal pairs within a chunk count once: q * end - q * (q - 1) / 2). The achieved fraction is
floor / measured time: 1.0 is the hardware's limit for that exact sequence of steps.

Mixture-of-experts models (a `ModelConfig` with `moe`): the matmul params are the ACTIVE ones
per token (attention, the dense MLP of `mlp_only_layers` / `decoder_sparse_step` layers, and
per MoE layer the router, top_k experts and Qwen2-MoE's shared expert with its gate), and a
step reads only the experts its tokens touch: weights - all experts + touched experts, where
touched is measured (`step_cost(..., touched=)`) or, under uniform routing, the expected
number of distinct experts n tokens pick with k distinct each: E * (1 - (1 - k/E)^n) per layer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any


def expected_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts that `tokens` tokens route to, each picking `top_k` distinct
    of `num_experts` uniformly at random: E * (1 - (1 - k/E)^n) (an expert is missed by one
    token with probability 1 - k/E, by all n independently)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def param_counts(m: Any) -> dict[str, int]:
    """A `ModelConfig`'s parameters (biases left out): `total` held and `active` per token
    (embeddings, norms and the LM head included: the published "A3B" of Qwen3-30B-A3B counts
    this way), and `matmul_active`, the linear weights a token goes through below the LM head
    (attention; a dense layer's MLP; a MoE layer's router, top_k experts and shared expert
    with its gate)."""
    E, F, H, K, D, L = (m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim,
                        m.num_layers)
    attn = E * H * D + 2 * E * K * D + H * D * E
    other = L * 2 * E + E + (L * 2 * D if m.qk_norm else 0)  # RMSNorms, q/k norms
    other += m.vocab_size * E * (1 if m.tie_word_embeddings else 2)  # embeddings, LM head
    moe = m.moe
    if moe is None:
        linear = L * (attn + 3 * E * F)
        return {"total": linear + other, "active": linear + other, "matmul_active": linear}
    Lm = len(moe.moe_layers)
    Fs = moe.shared_expert_intermediate_size
    expert = 3 * E * moe.moe_intermediate_size
    common = L * attn + (L - Lm) * 3 * E * F + Lm * (E * moe.num_experts + (3 * E * Fs + E if Fs else 0))
    active = common + Lm * moe.top_k * expert
    return {"total": common + Lm * moe.num_experts * expert + other, "active": active + other,
            "matmul_active": active}


@dataclasses.dataclass(frozen=True)
class ModelCost:
    weight_bytes: int
    matmul_params: int  # per-token linear weights of all layers (MoE: the active ones)
    head_params: int  # E * V, per sampled row
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # 4 * L * H * D
    # Mixture of experts (zeros for a dense model): a step reads only the experts it touches.
    moe_layers: int = 0
    num_experts: int = 0  # E: logical experts, as the router picks them
    top_k: int = 0
    local_experts: int = 0  # expert slots held per layer (on this device under expert parallelism)
    expert_bytes: int = 0  # one slot's weights (gate, up, down) of one layer, as this device holds them

    @property
    def all_expert_bytes(self) -> int:
        return self.moe_layers * self.local_experts * self.expert_bytes

    def touched(self, tokens: float) -> float:
        """Expected distinct (layer, slot) pairs a step of `tokens` tokens reads here, uniform
        routing (each held slot is one expert; replicas of EPLB are not modelled)."""
        if not self.moe_layers:
            return 0.0
        return self.moe_layers * self.local_experts * expected_touched(self.num_experts, self.top_k, tokens) \
            / self.num_experts

    def weights_read(self, tokens: float, touched: float | None = None) -> float:
        """Weight bytes a step of `tokens` tokens reads: all of a dense model; a MoE model's
        non-expert weights plus the experts touched (`touched`: measured distinct (layer,
        expert) pairs over all MoE layers; None: the uniform-routing expectation)."""
        if not self.moe_layers:
            return float(self.weight_bytes)
        t = self.touched(tokens) if touched is None else touched
        return float(self.weight_bytes - self.all_expert_bytes + t * self.expert_bytes)

    @classmethod
    def of(cls, m: Any, weight_bytes: int, kv_bytes_per_token: int, expert_bytes: int = 0,
           local_experts: int | None = None) -> "ModelCost":
        """From a `ModelConfig` (jaxllm.models.config; MoE fields from models/moe_config.py).
        `expert_bytes`: one expert of one layer as held (MoE only; 0 reads every expert)."""
        c = cls(weight_bytes, param_counts(m)["matmul_active"], m.hidden_size * m.vocab_size, kv_bytes_per_token,
                4 * m.num_layers * m.num_heads * m.head_dim)
        moe = m.moe
        if moe is None or not expert_bytes:
            return c
        return dataclasses.replace(c, moe_layers=len(moe.moe_layers), num_experts=moe.num_experts,
                                   top_k=moe.top_k, local_experts=local_experts or moe.num_experts,
                                   expert_bytes=expert_bytes)

    @classmethod
    def of_runner(cls, runner: Any) -> "ModelCost":
        """Per device, as the runner holds the model (its weights, its KV heads, its experts)."""
        m = runner.model_cfg
        kv = runner.kv_pages
        per_token = kv.nbytes // (runner.num_blocks * runner.block_size)
        tp = runner.tp.tp if runner.tp is not None else 1
        per_token //= tp
        expert_bytes = local = 0
        if m.moe is not None:
            eplb = getattr(runner, "eplb", None)
            slots = eplb.num_slots if eplb is not None else m.moe.num_experts
            local = slots // tp if runner.tp is not None and runner.tp.expert_parallel else slots
            split = getattr(runner.tp, "expert_split", None) if runner.tp is not None else None
            if split is not None:  # E / groups experts here, each a 1 / splits slice of F
                local = slots // split[0]
            held = _expert_bytes_on_device(runner.step_params)
            expert_bytes = held // (len(m.moe.moe_layers) * local)
        c = cls.of(m, runner.device_bytes["weight_bytes"], per_token, expert_bytes, local)
        if tp > 1:
            c = dataclasses.replace(c, matmul_params=c.matmul_params // tp, head_params=c.head_params // tp,
                                    attn_flops_per_pair=c.attn_flops_per_pair // tp)
        return c


EXPERT_WEIGHT_NAMES = ("e_gate", "e_up", "e_down")


def _expert_bytes_on_device(params: Any) -> int:
    """Bytes of the routed experts' weights (models/moe_model.py's e_gate / e_up / e_down,
    stacked or per layer) held by the first device of each array."""
    import jax

    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
        if names & set(EXPERT_WEIGHT_NAMES) and hasattr(leaf, "nbytes"):
            shards = getattr(leaf, "addressable_shards", None)
            total += shards[0].data.nbytes if shards else leaf.nbytes
    return int(total)


Step = tuple[int, list[tuple[int, int, bool]]]  # (tokens, [(query len, context end, sampled)])


def step_cost(cost: ModelCost, step: Step, touched: float | None = None) -> tuple[float, float]:
    """(bytes, FLOPs) of one step. MoE: `touched` distinct (layer, expert) pairs read, measured
    (None: the uniform-routing expectation for the step's tokens, `ModelCost.weights_read`)."""
    tokens, rows = step
    pairs = sum(q * end - q * (q - 1) / 2 for q, end, _ in rows)
    sampled = sum(1 for *_, s in rows if s)
    flops = 2.0 * cost.matmul_params * tokens + 2.0 * cost.head_params * sampled + cost.attn_flops_per_pair * pairs
    nbytes = cost.weights_read(tokens, touched) + cost.kv_bytes_per_token * (sum(end for _, end, _ in rows) + tokens)
    return float(nbytes), flops


def step_floor(nbytes: float, flops: float, copy_bytes_per_s: float, matmul_flops_per_s: float) -> float:
    """Seconds of one step at the roofline: the larger of its bytes and its FLOPs at the rates."""
    return max(nbytes / copy_bytes_per_s, flops / matmul_flops_per_s)


def run_floor(cost: ModelCost, steps: list[Step], copy_bytes_per_s: float, matmul_flops_per_s: float,
              touched: list[float] | None = None) -> dict:
    """The roofline of a sequence of steps: seconds, and how many steps each bound limits.
    `touched`: per step, the measured distinct (layer, expert) pairs (MoE; see `step_cost`)."""
    total = bytes_total = flops_total = 0.0
    memory_bound = 0
    for i, st in enumerate(steps):
        b, f = step_cost(cost, st, None if touched is None else touched[i])
        total += step_floor(b, f, copy_bytes_per_s, matmul_flops_per_s)
        memory_bound += b / copy_bytes_per_s >= f / matmul_flops_per_s
        bytes_total += b
        flops_total += f
    return {"floor_s": total, "steps": len(steps), "memory_bound_steps": memory_bound,
            "compute_bound_steps": len(steps) - memory_bound, "bytes": bytes_total, "flops": flops_total,
            "copy_bytes_per_s": copy_bytes_per_s, "matmul_flops_per_s": matmul_flops_per_s}


def step_kind(step: Step) -> str:
    """"decode" (every row one new token), "prefill" (none does) or "mixed"."""
    ones = sum(1 for q, _, _ in step[1] if q == 1)
    return "decode" if ones == len(step[1]) else "prefill" if ones == 0 else "mixed"


def breakdown(cost: ModelCost, steps: list[Step], times: list[float], end: float, copy_bytes_per_s: float,
              matmul_flops_per_s: float, lag: int = 1) -> dict:
    """Per kind of step (`step_kind`): steps, tokens, floor seconds and measured seconds.

    Measured: the wall time between the scheduler's calls, given to the step `lag` calls
    before (with async scheduling the host schedules step k + 1 once step k - 1's tokens are
    back, so that interval is step k - 1's device time; lag 0 for synchronous steps). The
    first `lag` intervals (the pipeline filling) are left out: a profile, not an exact sum."""
    edges = times[1:] + [end]
    spans = [b - a for a, b in zip(times, edges)]
    out: dict[str, dict] = {}
    for k, st in enumerate(steps):
        d = out.setdefault(step_kind(st), {"steps": 0, "tokens": 0, "floor_s": 0.0, "measured_s": 0.0})
        d["steps"] += 1
        d["tokens"] += st[0]
        d["floor_s"] += step_floor(*step_cost(cost, st), copy_bytes_per_s, matmul_flops_per_s)
        d["measured_s"] += spans[k + lag] if k + lag < len(spans) else 0.0
    for d in out.values():
        d["x_floor"] = d["measured_s"] / d["floor_s"] if d["floor_s"] else None
    return out


class StepRecorder:
    """Records every step the engine's scheduler emits (wraps `scheduler.schedule`), and when."""

    def __init__(self, engine: Any):
        self.steps: list[Step] = []
        self.times: list[float] = []
        self.enabled = True
        sched = engine.scheduler
        inner = sched.schedule

        def schedule(*a, **kw):
            out = inner(*a, **kw)
            if self.enabled and out.scheduled:
                self.steps.append((out.num_batched_tokens, [
                    (len(s.token_ids), s.start_pos + len(s.token_ids), bool(s.sample)) for s in out.scheduled]))
                self.times.append(time.perf_counter())
            return out

        sched.schedule = schedule

    def clear(self) -> None:
        self.steps, self.times = [], []


def _timed(fn, *args, warm_s: float = 1.0, reps: int = 20, inner: int = 3) -> float:
    """The fastest of `reps` rounds, each `inner` calls queued back to back (the host's dispatch
    and sync are not timed per call): a floor takes the best rate the device reaches. A median
    of single synced calls varied by 15% between two runs on one H200 (docs/benchmarks.md)."""
    t = time.perf_counter()
    while time.perf_counter() - t < warm_s:  # an idle GPU starts at a low clock
        fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            y = fn(*args)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def copy_rate(gib: float = 2.0) -> float:
    """Copy bandwidth (bytes/s): read + write of a float32 array, on the default device now."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices()[0].platform == "cpu"
    n = int((min(gib, 0.25) if cpu else gib) * (1 << 30)) // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy_s = _timed(jax.jit(lambda a: a + 1.0), x, warm_s=0.2 if cpu else 1.0)
    del x
    return 2 * n * 4 / copy_s


def measure_rates(copy_gib: float = 2.0, matmul_n: int = 8192, dtype: Any = None) -> dict:
    """Copy bandwidth (`copy_rate`) and the dense matmul rate (FLOP/s, bf16 on accelerators,
    f32 on CPU), measured on the default device now."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices()[0].platform == "cpu"
    copy = copy_rate(copy_gib)
    if cpu:
        matmul_n = min(matmul_n, 1024)
    dt = dtype or (jnp.float32 if cpu else jnp.bfloat16)
    a = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), dt)
    mm_s = _timed(jax.jit(lambda u: u @ u), a, warm_s=0.2 if cpu else 1.0, reps=5 if cpu else 20)
    del a
    return {"copy_bytes_per_s": copy, "matmul_flops_per_s": 2 * matmul_n ** 3 / mm_s}


def cost_of_config(hf_config: dict, dtype_bytes: int = 2) -> ModelCost:
    """A model's cost from its HF config (weights and KV in `dtype_bytes`, one device)."""
    from jaxllm.models.registry import config_from_hf

    m = config_from_hf(hf_config)  # MoE fields filled in for MoE architectures
    expert = 3 * m.hidden_size * m.moe.moe_intermediate_size * dtype_bytes if m.moe is not None else 0
    return ModelCost.of(m, param_counts(m)["total"] * dtype_bytes,
                        m.num_layers * 2 * m.num_kv_heads * m.head_dim * dtype_bytes, expert)


def serving_floor(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], mean_batch: float,
                  copy_bytes_per_s: float, matmul_flops_per_s: float) -> dict:
    """A served run's roofline seen from the client, which does not see the engine's steps:
    prompts cost their FLOPs (compute-bound), and the outputs are decode steps of the run's
    mean running batch (sampled from the server's metrics) at the mean context."""
    n_out, n_in = sum(output_lens), sum(prompt_lens)
    B = max(mean_batch, 1.0)
    ctx = (n_in + n_out / 2) / max(len(prompt_lens), 1)
    prefill = sum(2.0 * cost.matmul_params * p + cost.attn_flops_per_pair * p * (p + 1) / 2 for p in prompt_lens)
    steps = n_out / B
    step_b, step_f = step_cost(cost, (int(round(B)), [(1, int(ctx), True)] * int(round(B))))
    step_s = step_floor(step_b, step_f, copy_bytes_per_s, matmul_flops_per_s)
    floor = prefill / matmul_flops_per_s + steps * step_s
    return {"floor_s": floor, "mean_batch": B, "decode_steps": steps, "decode_step_floor_s": step_s,
            "prefill_floor_s": prefill / matmul_flops_per_s, "copy_bytes_per_s": copy_bytes_per_s,
            "matmul_flops_per_s": matmul_flops_per_s}
