#!/usr/bin/env bash
# One device call on one H200 (< 7 minutes): the engine as its users run it, on the Llama-3-8B
# shape with dummy weights (--random-shape), DEFAULT engine settings unless stated.
#   1. scripts/bench_engine.py: TTFT of one 2,048- and one 32,768-token prompt vs the FLOP floor;
#      prefill throughput 64 x 2,048 (max_tokens 1) and MFU; the mixed random workload
#      (--random-input-len 544 --random-output-len 288 --random-range-ratio 0.88, 1,000 prompts)
#      vs its roofline. Then the same TTFT / prefill calls through HF transformers (sdpa, random
#      bf16 weights) in their own process.
#   2. scripts/bench_latency.py: decode step latency at batch 1 and 64 (context 2,048) vs the floor.
#   3. `jaxllm serve --random-shape llama3-8b` + scripts/bench_serving.py at request rates 4, 16, inf
#      (p50/p99 TTFT and ITL, the run's roofline).
# HF=0 skips the HF peer of part 1; ENGINE_ARGS go to its bench_engine.py (e.g. "--parts mixed mixed_unfitted"). PARTS picks the parts (default "engine latency serving"); split over two calls when one
# call's 600 s is too short for all three.
# Every log is kept whole in $OUT; at the end they are searched for XLA's "Can't reduce memory use"
# warning (never filtered) and the count is reported. Figures: $OUT/gpu_engine.json.
# The H200 image lacks the server's fastapi/uvicorn/pydantic: run scripts/fetch_wheels.sh here
# first and carry ".whl"; they are installed into /tmp/site.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import fastapi, uvicorn, pydantic, prometheus_client" 2>/dev/null; then
  # every carried wheel (fastapi 0.165 also needs opentelemetry-api, which the image lacks)
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PWD:/tmp/site
  else
    echo "server packages missing and not carried: run scripts/fetch_wheels.sh, carry .whl"
  fi
fi
SHAPE=${SHAPE:-llama3-8b}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
t_all=$(date +%s)
PARTS=${PARTS:-"engine latency serving"}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }

if has engine; then
echo "== 1a engine (jaxllm, defaults)"
timeout -k 10 ${T1:-150} python3 scripts/bench_engine.py --random-shape $SHAPE ${ENGINE_ARGS:-} --output-json "$OUT/engine_jax.json" \
  > "$OUT/engine_jax.log" 2>&1; echo "rc $?"; grep "^== " "$OUT/engine_jax.log" | cut -c1-400

if [ "${HF:-1}" = 1 ]; then
echo "== 1b engine peer (HF transformers, sdpa)"
timeout -k 10 ${T2:-60} python3 scripts/bench_engine.py --random-shape $SHAPE --peer hf --output-json "$OUT/engine_hf.json" \
  > "$OUT/engine_hf.log" 2>&1; echo "rc $?"; grep "^== " "$OUT/engine_hf.log" | cut -c1-400
fi
fi

if has latency; then
echo "== 2 decode latency"
timeout -k 10 ${T3:-60} python3 scripts/bench_latency.py --random-shape $SHAPE --batch-size 1 64 --input-len 2048 \
  --num-iters 10 --max-num-batched-tokens 64 --output-json "$OUT/latency.json" > "$OUT/latency.log" 2>&1
echo "rc $?"; tail -5 "$OUT/latency.log"
fi

if has serving; then
echo "== 3 serving"
PORT=${PORT:-8321}
python3 -m jaxllm.cli serve --random-shape $SHAPE --port $PORT --max-model-len 2048 \
  --uvicorn-log-level warning > "$OUT/serve.log" 2>&1 &
SRV=$!
for _ in $(seq ${T4:-100}); do curl -sf localhost:$PORT/health > /dev/null && break; kill -0 $SRV 2>/dev/null || break; sleep 1; done
grep -E "KV cache|engine ready" "$OUT/serve.log" | cut -c1-300
SERVE="scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --dataset-name random --random-input-len 544
  --random-output-len 288 --random-range-ratio 0.88 --ignore-eos --roofline-shape $SHAPE --max-concurrency 256"
# The client measures copy bandwidth / matmul rate with a small share of the GPU beside the server.
for spec in "4 40" "16 100" "inf 100"; do
  set -- $spec
  echo "-- rate $1 ($2 prompts)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 timeout -k 10 ${T5:-30} python3 $SERVE --request-rate $1 --num-prompts $2 \
    --result-json "$OUT/serving_rate_$1.json" > "$OUT/serving_rate_$1.log" 2>&1
  echo "rc $?"; tail -7 "$OUT/serving_rate_$1.log"
done
kill $SRV 2>/dev/null; wait $SRV 2>/dev/null
fi

echo "== summary ($(( $(date +%s) - t_all )) s)"
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception as e:
        return {"error": f"{name}: {e}"}
jx, hf, lat = load("engine_jax.json"), load("engine_hf.json"), load("latency.json")
s = {"jaxllm": jx, "hf": hf, "latency": lat, "ratios": {}}
for k in [k for k in jx if k.startswith("ttft_")]:
    a, b = jx.get(k, {}), hf.get(k, {})
    if "ttft_s" in a and "ttft_s" in b:
        s["ratios"][k + "_hf_over_jaxllm"] = b["ttft_s"] / a["ttft_s"]
    if "x_floor" in a:
        s["ratios"][k + "_x_floor"] = a["x_floor"]
a, b = jx.get("prefill", {}), hf.get("prefill", {})
if "tokens_per_s" in a and "tokens_per_s" in b:
    s["ratios"]["prefill_jaxllm_over_hf"] = a["tokens_per_s"] / b["tokens_per_s"]
for k in ("mfu_measured", "mfu_spec"):
    if k in a:
        s["ratios"]["prefill_" + k] = a[k]
if "fraction_of_roofline" in jx.get("mixed", {}):
    s["ratios"]["mixed_fraction_of_roofline"] = jx["mixed"]["fraction_of_roofline"]
for r in lat.get("rows", []):
    s["ratios"][f"decode_b{r['batch']}_x_floor"] = r["x_floor"]
s["serving"] = {}
for rate in ("4", "16", "inf"):
    d = load(f"serving_rate_{rate}.json")
    s["serving"][rate] = {k: d.get(k) for k in ("completed", "failed", "errors", "output_token_throughput",
                                                "ttft_ms", "itl_ms", "e2e_ms", "roofline")}
warn = {}
for log in sorted(glob.glob(os.path.join(out, "*.log"))):
    n = sum(line.count("Can't reduce memory use") for line in open(log, errors="replace"))
    warn[os.path.basename(log)] = n
s["xla_memory_warnings"] = warn
with open(os.path.join(out, "gpu_engine.json"), "w") as f:
    json.dump(s, f, indent=2)
print(json.dumps(s["ratios"], indent=1))
for rate, d in s["serving"].items():
    t, i = d.get("ttft_ms") or {}, d.get("itl_ms") or {}
    print(f"serving rate {rate}: completed {d.get('completed')} failed {d.get('failed')}; TTFT p50/p99 "
          f"{t.get('p50')}/{t.get('p99')} ms; ITL p50/p99 {i.get('p50')}/{i.get('p99')} ms; "
          f"roofline fraction {(d.get('roofline') or {}).get('fraction')}")
print("XLA 'Can't reduce memory use' warnings per log:", warn, "total", sum(warn.values()))
EOF
