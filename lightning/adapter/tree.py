"""The spans of one rollout attempt as a forest, with parents that went missing repaired from timing."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy

from lightning.types import Span


@dataclass(eq=False)
class SpanNode:
    """One span in the forest, with its parent and its children (ordered by start time, then sequence id)."""

    span: Span
    parent: SpanNode | None = None
    children: list[SpanNode] = field(default_factory=list)
    attached_by_time: bool = False
    """True when the parent was not named by `parent_id` but found by timing (see `build_forest`)."""

    def ancestors(self) -> Iterator[SpanNode]:
        """The parent, its parent, and so on up to the root."""
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def walk(self) -> Iterator[SpanNode]:
        """This node and its descendants, depth first, children in order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


def build_forest(spans: Sequence[Span]) -> list[SpanNode]:
    """The root nodes of the spans' forest, ordered by start time then sequence id.

    A span's parent is the span named by its `parent_id`. When that span is not in the set (it was lost, or
    the agent's HTTP client sent the proxy no traceparent, so the proxy's span has no parent at all), the
    parent is the innermost span whose [start_time, end_time] contains the span's own interval, in the same
    trace or not: innermost means the shortest, ties going to the smaller sequence id (sequence ids are given
    as spans end, so of two spans with one interval the inner one has the smaller). A span with no such
    container, or without both times, is a root. A link that would close a cycle is never made.
    """
    nodes = [SpanNode(span) for span in sorted(spans, key=_order)]
    by_span_id: dict[str, SpanNode] = {}
    for node in nodes:
        by_span_id.setdefault(node.span.span_id, node)

    orphans = []
    for node in nodes:
        parent = by_span_id.get(node.span.parent_id) if node.span.parent_id else None
        if parent is not None and not _is_ancestor_or_self(node, parent):
            _attach(node, parent)
        else:
            orphans.append(node)

    # In start order (as `nodes`): the candidates that start no later than a span are found by bisection, and
    # those of them that end no earlier in one vectorised comparison (10,000 parentless spans took 40 s compared
    # pair by pair in Python).
    timed = [node for node in nodes if _interval(node.span) is not None]
    starts = [node.span.start_time for node in timed]
    ends = numpy.array([node.span.end_time for node in timed], dtype=float)
    for node in orphans:
        container = _innermost_container(node, timed, starts, ends)
        if container is not None:
            _attach(node, container, by_time=True)

    for node in nodes:
        node.children.sort(key=lambda child: _order(child.span))
    return [node for node in nodes if node.parent is None]


def iter_forest(roots: Iterable[SpanNode]) -> Iterator[SpanNode]:
    """Every node of the forest, depth first, roots and children in order."""
    for root in roots:
        yield from root.walk()


def _innermost_container(
    node: SpanNode, candidates: list[SpanNode], starts: list[float], ends: numpy.ndarray
) -> SpanNode | None:
    """The shortest of `candidates` (in start order; their `starts` and `ends`) whose interval contains the node's,
    ties to the smaller sequence id (the first in that order), never one that would close a cycle."""
    interval = _interval(node.span)
    if interval is None:
        return None
    start, end = interval
    count = bisect.bisect_right(starts, start)  # the candidates that start no later than the node
    best: SpanNode | None = None
    best_key: tuple[float, int] | None = None
    for index in numpy.flatnonzero(ends[:count] >= end):
        candidate = candidates[index]
        candidate_start, candidate_end = _interval(candidate.span)  # type: ignore[misc]
        if candidate is node or not (candidate_start <= start and end <= candidate_end):
            continue
        key = (candidate_end - candidate_start, candidate.span.sequence_id)
        if (best_key is None or key < best_key) and not _is_ancestor_or_self(node, candidate):
            best, best_key = candidate, key
    return best


def _attach(node: SpanNode, parent: SpanNode, *, by_time: bool = False) -> None:
    node.parent = parent
    node.attached_by_time = by_time
    parent.children.append(node)


def _is_ancestor_or_self(node: SpanNode, other: SpanNode) -> bool:
    """Whether `node` is `other` or one of its ancestors, i.e. whether node -> other would close a cycle."""
    return other is node or any(ancestor is node for ancestor in other.ancestors())


def _interval(span: Span) -> tuple[float, float] | None:
    if span.start_time is None or span.end_time is None:
        return None
    return span.start_time, span.end_time


def _order(span: Span) -> tuple[float, int]:
    return (span.start_time if span.start_time is not None else math.inf, span.sequence_id)
