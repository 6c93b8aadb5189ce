"""Waiting queues for the two scheduling policies.

FCFS is a deque: arrivals at the back, preempted requests back at the front
so they resume before anyone who arrived after them. The priority queue keeps
requests sorted by `Request.sort_key` = (priority, arrival time, sequence
number): lower priority values first, FCFS among equals; a preempted request
simply goes back to its place. A sorted list (not a heap) because the
scheduler iterates the queue in order and removes from the middle on abort,
and waiting queues are short next to the cost of a step.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator, Protocol

from jaxllm.runtime.request import Request


class RequestQueue(Protocol):
    def add(self, req: Request) -> None: ...
    def add_preempted(self, req: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class _Queue:
    """What both queues share: `_q` is kept in pop order (index 0 is next)."""

    _q: deque[Request] | list[Request]

    def peek(self) -> Request:
        return self._q[0]

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class FCFSQueue(_Queue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_preempted(self, req: Request) -> None:
        self._q.appendleft(req)

    def pop(self) -> Request:
        return self._q.popleft()


class PriorityQueue(_Queue):
    def __init__(self) -> None:
        self._q: list[Request] = []

    def add(self, req: Request) -> None:
        bisect.insort(self._q, req, key=lambda r: r.sort_key)

    add_preempted = add

    def pop(self) -> Request:
        return self._q.pop(0)


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (expected 'fcfs' or 'priority')")
