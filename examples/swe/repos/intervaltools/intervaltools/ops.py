"""Operations on lists of closed intervals `(start, end)` with start <= end.

Closed means both ends belong to the interval: (1, 3) and (3, 5) share the point 3, so they
merge into (1, 5), and their intersection is the single point (3, 3).
"""


def _checked(intervals):
    out = []
    for start, end in intervals:
        if start > end:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        out.append((start, end))
    return out


def merge(intervals):
    """The union of `intervals` as sorted, non-overlapping intervals."""
    merged = []
    for start, end in sorted(_checked(intervals)):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a, b):
    """The points in both `a` and `b`, as merged intervals."""
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if start <= end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def coverage(intervals):
    """The total length covered, each point counted once."""
    return sum(end - start for start, end in merge(intervals))


def gaps(intervals, start, end):
    """The parts of [start, end] that no interval covers."""
    out, cursor = [], start
    for s, e in merge(intervals):
        if e < start or s > end:
            continue
        if s > cursor:
            out.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        out.append((cursor, end))
    return out
