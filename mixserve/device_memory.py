"""What the engine holds in device memory, lets go of while it sleeps, and takes back (Engine.sleep).

JAX frees a device buffer once no array holds it, and two Array objects may hold one buffer (an
uncommitted array and its device_put to the same device). So sleep deletes nothing: it lets go of
what it serves (`let_go`), counting the buffers that freed, and notes who else holds each weight
(`holders`), so that wake_up takes that one back as it is, not as a second copy from the host.
"""

from __future__ import annotations

import weakref

import jax
import numpy as np


def buffers(x: jax.Array) -> dict[tuple[int, int], int]:
    """x's device buffers, (device id, address) -> bytes: two Array objects may share them (an
    uncommitted array and its device_put to the same device are two objects over one buffer)."""
    return {(shard.device.id, shard.data.unsafe_buffer_pointer()): shard.data.nbytes
            for shard in x.addressable_shards}


def live_bytes() -> int:
    """The device buffers all live arrays hold, each once."""
    return sum({key: n for x in jax.live_arrays() if not x.is_deleted() for key, n in buffers(x).items()}.values())


def host_copy(x: jax.Array) -> np.ndarray:
    """x whole in host memory: a copy, read a shard at a time (np.array(x) may also keep one on x
    itself for as long as x lives, as an array a caller holds does; and on a CPU give a view of
    the device buffer)."""
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            out[shard.index] = np.asarray(shard.data)
    return out


def holders(arrays: list[jax.Array]) -> dict[int, tuple[weakref.ref, ...]]:
    """For each of arrays (by id), weakly, the other live arrays of its value that share its
    memory: over the same buffers (an uncommitted array given to the engine, and the committed
    one it serves, are two objects), or over one whole replica of it (a one-device model given
    to an engine on a mesh: its replicated parameters' first device reuses the buffer)."""
    ours = {id(x) for x in arrays}
    shared = {}
    for y in jax.live_arrays():
        if id(y) not in ours and not y.is_deleted():
            for key in memory_keys(y):
                shared.setdefault(key, []).append(weakref.ref(y))
    return {id(x): tuple(ref for key in memory_keys(x) for ref in shared.get(key, ())) for x in arrays}


def memory_keys(x: jax.Array) -> list[tuple]:
    """What two arrays of one value share when one's memory is the other's: all its buffers, and
    each buffer that holds the whole of it (a replica), with the shape and dtype it has there."""
    whole = [(shard.device.id, shard.data.unsafe_buffer_pointer(), x.shape, x.dtype)
             for shard in x.addressable_shards if shard.data.shape == x.shape]
    return [tuple(buffers(x)), *whole]


def let_go(arrays: list[jax.Array]) -> int:
    """Drop the references in arrays (the list is emptied: its caller holds them nowhere else)
    and return the bytes that freed: the device buffers no live array holds any more (two
    Array objects may share one), each once."""
    sizes = {key: n for x in arrays if not x.is_deleted() for key, n in buffers(x).items()}  # (a trainer's, donated)
    arrays.clear()  # (no gc.collect: 130 ms in a test process, for arrays only a reference cycle would hold)
    held = {key for x in jax.live_arrays() if not x.is_deleted() for key in buffers(x)}
    return sum(n for key, n in sizes.items() if key not in held)
