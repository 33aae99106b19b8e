"""The scheduler's waiting queue: FCFS or priority order (vLLM v1's ``request_queue.py``).

FCFS is a deque: new requests join the back, preempted requests go back to the front so they
resume before newer ones. Priority is a heap on ``(priority, arrival_time, sequence number)``:
lower priority values first, then earlier arrivals; a preempted request keeps its key, so it
resumes before later requests of its priority. Torch-free.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterable, Iterator
from typing import Literal

from pkgd.engine.request import Request


class FCFSQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._q: collections.deque[Request] = collections.deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request: it goes ahead of everything waiting."""
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._q = collections.deque(r for r in self._q if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest ``priority`` first, then earliest ``arrival_time``, then creation order (``Request.arrival_seq``)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, request.arrival_seq, request)
        heapq.heappush(self._heap, key)

    prepend = add  # the key already puts a preempted request back in its place

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


RequestQueue = FCFSQueue | PriorityQueue


def create_request_queue(policy: Literal["fcfs", "priority"]) -> RequestQueue:
    """The waiting queue for ``scheduler.policy``; raises `ValueError` for an unknown policy."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected 'fcfs' or 'priority'")
