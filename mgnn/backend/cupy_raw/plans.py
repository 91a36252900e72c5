"""Index plans of the stacked-state launches: runs of consecutive slots, chain and point plans."""

import numpy as np

from .launch import MAX_BATCH


def _check_count(count):
    if count > MAX_BATCH:
        raise ValueError(f"{count} states in one batched launch exceed CUDA's grid limit of "
                         f"{MAX_BATCH}; use more ranks or fewer layers per rank")


def _cdiv(a, b):
    return -(-a // b)


#: This backend has the stacked-state kernels of ``mgnn.backend.STACKED_KERNELS``.
stacked_states = True

#: Most cached launch plans (chains / points arrays) a RawBackend keeps; the cache is cleared
#: when it is full (a solver reuses a handful of arrays per level).
PLAN_CACHE_SIZE = 256


def _host_index(a, name, ndim):
    """``a`` as a host int64 array of ``ndim`` dimensions (a device array is copied: a sync)."""
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        a = a.get()
    a = np.asarray(a)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.size == 0:
        return np.zeros((0, 2) if ndim == 2 else (0,), np.int64)
    a = a.astype(np.int64, copy=False)
    if a.ndim != ndim or (ndim == 2 and a.shape[1] != 2):
        raise ValueError(f"{name} must have shape {'(n, 2)' if ndim == 2 else '(n,)'}, got "
                         f"{a.shape}")
    return a


def _runs(slots, outs):
    """Maximal runs of consecutive points whose slots and output slots both step by constants:
    a list of ``(slot0, stride, out0, out_stride, count)`` (Python ints), at most MAX_BATCH
    points each."""
    slots, outs = [int(v) for v in slots], [int(v) for v in outs]
    runs, n, a = [], len(slots), 0
    while a < n:
        b = min(a + 2, n)  # one or two points always form a run
        ds, do = slots[b - 1] - slots[a], outs[b - 1] - outs[a]
        while (b < n and b - a < MAX_BATCH and slots[b] - slots[b - 1] == ds
               and outs[b] - outs[b - 1] == do):
            b += 1
        runs.append((slots[a], ds, outs[a], do, b - a))
        a = b
    return runs


def _chain_plan(chains):
    """(launches, (lowest, highest) slot) of a chains array (n, 2) of (first, length): wave k
    advances slot first + k of every chain longer than k, one launch per arithmetic run of those
    slots (so one per wave when the firsts are evenly spaced and the lengths equal). Raises
    ValueError when chains overlap or one reads a slot another writes."""
    chains = chains[np.argsort(chains[:, 0], kind="stable")]
    if (chains[:, 1] < 0).any():
        raise ValueError(f"chain lengths must be >= 0, got {chains[:, 1].tolist()}")
    chains = chains[chains[:, 1] > 0]
    first, length = chains[:, 0], chains[:, 1]
    ends = first + length  # one past the last slot a chain writes
    clash = np.nonzero(ends[:-1] >= first[1:])[0]
    if clash.size:
        c = clash[0]
        raise ValueError(f"chains (first, length) {chains[c].tolist()} and "
                         f"{chains[c + 1].tolist()} overlap or depend on each other (each chain "
                         "reads the slot before its first; chains must be independent)")
    if not length.size:
        return (), (1, 0)
    launches = []
    for k in range(int(length.max())):
        active = first[length > k] + k
        launches += _runs(active, active)
    return tuple(launches), (int(first.min()), int(ends.max()) - 1)


def _points_plan(slots, out_slots):
    """(runs, (lowest, highest) slot, (lowest, highest) output slot) of a points call;
    ValueError on a length mismatch or a repeated output slot."""
    if slots.shape != out_slots.shape:
        raise ValueError(f"slots {slots.shape} and out_slots {out_slots.shape} differ in length")
    if np.unique(out_slots).size != out_slots.size:
        raise ValueError(f"out_slots must be distinct, got {out_slots.tolist()}")
    if not slots.size:
        return (), (1, 0), (0, -1)
    return (tuple(_runs(slots, out_slots)), (int(slots.min()), int(slots.max())),
            (int(out_slots.min()), int(out_slots.max())))
