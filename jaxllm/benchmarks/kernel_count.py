"""Kernel launches of a compiled XLA GPU module, from its text: what a GPU profile counts as
"kernels a step" (`scripts/trace_stats.py`), read from the compiler's output instead
(`scripts/aot_kernels.py` compiles a step for a Hopper GPU on a machine without one).

`count(hlo)`: the scheduled module's kernels by family (each fusion, custom call and copy is
one kernel; loops count their body as often as their known trip count). `thunks(text)`: the
host's launches from XLA's thunk-sequence dump, where command buffers (CUDA graphs) show:
a command buffer is one launch, whatever it holds.
"""

from __future__ import annotations

import collections
import re

# Instructions of a scheduled GPU module that launch nothing.
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
             "conditional", "call", "after-all", "add-dependency", "opt-barrier",
             "partition-id", "replica-id", "copy-done", "async-done", "domain"}


def family(instr: str, opcode: str, text: str) -> str:
    """A kernel's family: custom calls by target (jaxllm's kernels by name), fusions by kind."""
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', text)
        name = re.search(r"(jaxllm_\w+)", text)  # a jaxllm kernel's name, from its op_name
        return " ".join(["custom-call", target.group(1) if target else "?"] + ([name.group(1)] if name else []))
    if opcode == "fusion":
        kind = re.search(r"kind=(k\w+)", text)
        return f"fusion {kind.group(1) if kind else ''} " + re.sub(r"[.\d]+$", "", instr)
    return opcode


def parse(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
    """Computation name -> [(instruction name, opcode, line)] of a scheduled HLO module's text."""
    comps: dict[str, list] = {}
    cur = None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$", line)
        if m:
            cur = comps.setdefault(("ENTRY " if line.startswith("ENTRY") else "") + m.group(1), [])
            continue
        if line == "}":
            cur = None
            continue
        m = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = \S+(?: \S+)*? ([\w\-]+)\(", line)
        if cur is not None and m:
            cur.append((m.group(1), m.group(2), line))
    return comps


BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1, "bf16": 2,
         "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


IN_PLACE = re.compile(r"dynamic_update_slice|scatter")  # fusions updating a buffer in place


def out_bytes(line: str) -> int:
    """Bytes an instruction's result holds (a tuple: its parts), from its line's shape."""
    head = line.split("=", 1)[1].split(" fusion(")[0].split(" custom-call(")[0].split(" copy(")[0]
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", head):
        if dtype in BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * BYTES[dtype]
    return total


def count(hlo: str, weight: str = "kernels") -> collections.Counter:
    """Kernel launches a run of the module makes, by family: the entry computation's, with each
    while loop's body counted as often as its known trip count (1 where XLA records none) and
    each conditional's branches counted at their largest. `weight="bytes"`: the bytes their
    results hold instead (what each family writes a run), in-place updates (a cache's
    dynamic-update-slice or scatter, whose result is the whole buffer) left out."""
    comps = parse(hlo)
    by_name = {k.removeprefix("ENTRY "): v for k, v in comps.items()}

    def walk(name: str) -> collections.Counter:
        out = collections.Counter()
        for instr, op, line in by_name[name]:
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(n.group(1)) if n else 1
                inner = walk(body) + walk(cond)
                out.update({k: v * n for k, v in inner.items()})
            elif op == "conditional":
                branches = re.findall(r"%?([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", line).group(1)) \
                    if "branch_computations" in line else \
                    [re.search(r"true_computation=%?([\w.\-]+)", line).group(1),
                     re.search(r"false_computation=%?([\w.\-]+)", line).group(1)]
                out.update(max((walk(b) for b in branches), key=lambda c: sum(c.values())))
                out["conditional"] += 1 if weight == "kernels" else 0
            elif op == "call":
                out.update(walk(re.search(r"to_apply=%?([\w.\-]+)", line).group(1)))
            elif op not in NO_KERNEL:
                out[family(instr, op, line)] += 1 if weight == "kernels" else \
                    0 if IN_PLACE.search(instr) else out_bytes(line)
        return out

    entry = next(k for k in comps if k.startswith("ENTRY "))
    return walk(entry.removeprefix("ENTRY "))


def thunks(text: str) -> dict:
    """Launches of a compiled module from XLA's thunk sequence dump (after its thunk passes):
    top-level thunks are what the host issues one by one (a kCommandBuffer is one CUDA graph
    launch, whatever it holds); indented ones run inside a command buffer."""
    top, inside = collections.Counter(), collections.Counter()
    for line in text.splitlines():
        m = re.match(r"^( *)\d+: (k\w+)", line)
        if m:
            (inside if m.group(1) else top)[m.group(2)] += 1
    return {"launches": sum(top.values()), "top": dict(top), "in_graphs": dict(inside)}
