"""Expert-parallel load balancing (vLLM's EPLB): redundant expert slots placed by measured load.

`config.py` the flag's schema; `placement.py` DeepSeek's greedy hierarchical packing (numpy,
host side); `balancer.py` the device side: per-expert load counters, the logical-to-physical
map the step takes as an input array, and moving expert weights between slots.
"""
