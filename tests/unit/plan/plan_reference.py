"""Item-by-item reference planners (slow, obviously correct) that the fast ones must match."""

from __future__ import annotations


def next_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """NeMo AutoModel pack_dataset / torchtune PackedDataset: order-preserving next fit."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, s in enumerate(sizes):
        if used + s > capacity:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += s
    if current:
        packs.append(current)
    return packs


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Each item, largest first, into the oldest pack with room."""
    packs: list[list[int]] = []
    rooms: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for p, room in enumerate(rooms):
            if sizes[i] <= room:
                packs[p].append(i)
                rooms[p] -= sizes[i]
                break
        else:
            packs.append([i])
            rooms.append(capacity - sizes[i])
    return packs


def best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Each item, largest first, into the fullest pack that still has room."""
    packs: list[list[int]] = []
    rooms: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fits = [p for p, room in enumerate(rooms) if sizes[i] <= room]
        if fits:
            p = min(fits, key=lambda p: rooms[p])
            packs[p].append(i)
            rooms[p] -= sizes[i]
        else:
            packs.append([i])
            rooms.append(capacity - sizes[i])
    return packs


def optimum(sizes: list[int], capacity: int) -> int:
    """Fewest packs, by exhaustive search (tiny inputs only)."""
    items = sorted(sizes, reverse=True)
    best = len(items)

    def place(k: int, rooms: list[int]) -> None:
        nonlocal best
        if len(rooms) >= best:
            return
        if k == len(items):
            best = len(rooms)
            return
        seen = set()
        for p, room in enumerate(rooms):
            if items[k] <= room and room not in seen:
                seen.add(room)
                rooms[p] -= items[k]
                place(k + 1, rooms)
                rooms[p] += items[k]
        place(k + 1, [*rooms, capacity - items[k]])

    place(0, [])
    return best
