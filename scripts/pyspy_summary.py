"""Summarise a py-spy `--threads -f raw` profile: per thread, its samples and the frames it spends
most of them in (inclusive, by function), so the host's critical path can be read off.

    python3 scripts/pyspy_summary.py pyspy.txt [--top 12]
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in open(args.path, encoding="utf-8", errors="replace"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread")), frames[0])
        totals[thread] += int(n)
        seen = set()
        for f in frames:
            func, _, where = f.partition(" (")
            name = f"{func} [{where.rstrip(')').rsplit('/', 1)[-1].split(':')[0]}]" if where else func
            if name not in seen and not f.startswith(("thread", "process")):
                seen.add(name)
                per_thread[thread][name] += int(n)
    print(f"== {args.path}")
    for thread, total in totals.most_common(8):
        print(f"-- {thread}: {total} samples")
        for name, n in per_thread[thread].most_common(args.top):
            print(f"   {100 * n / total:5.1f}%  {name[:110]}")


if __name__ == "__main__":
    main()
