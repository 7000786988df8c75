"""Running one model over the ranks of ``mx.distributed`` (``mlx.launch -n N mlxc ...``).

Every rank loads the checkpoint sharded (``loading.load_model(group=...)``: tensor
parallelism, the generated ``Model.shard``) and runs the same forwards in the same order: each
layer's all-reduces pair up across the ranks, so the ranks must agree on every input. Rank 0
reads the prompt and prints (``mlxc generate``) or binds HTTP (``mlxc serve``), and hands the
other ranks what they need through :func:`broadcast` (a small all-sum, as mlx-lm's server
does). The logits are the same on every rank (each all-reduce hands every rank the same sum),
so greedy decoding agrees without any exchange; sampling agrees once the random seeds do
(:func:`agree_on_seed`).

``mlxc serve``: every rank runs the scheduler; :class:`Lockstep` is its once-per-tick hook.
Rank 0 admits from its HTTP queue and broadcasts the tick's work (the admitted requests with
their prompt ids, sampling parameters and model inputs; the requests cancelled); the other
ranks admit the same requests (their events go nowhere) and drop the same ones. Everything
else in a tick (prefill chunks, the decode batch, ``--max-kv-size`` trims, stop strings, a
failing request) follows from those inputs the same way on every rank.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable

import mlx.core as mx
import numpy as np

from mlxc.runtime.serving.admission import Failed, Request


def world() -> mx.distributed.Group | None:
    """The group ``mlx.launch`` started this process in; None when it runs alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def broadcast(payload: object, group: mx.distributed.Group) -> object:
    """Rank 0's ``payload`` on every rank; other ranks pass None.

    Two all-sums: the length, then the pickled bytes (zeros from every rank but 0, so no byte
    overflows). The ranks are one job started together (``mlx.launch``), so they trust each
    other's pickles. On the default stream: the collectives of a forward still in flight
    there come first on every rank, so the ranks' collectives always pair up in order.
    """
    data = pickle.dumps(payload) if group.rank() == 0 else b""
    n = int(mx.distributed.all_sum(mx.array([len(data)], mx.int32), group=group).item())
    buffer = np.zeros(n, np.uint8)
    if group.rank() == 0:
        buffer[:] = np.frombuffer(data, np.uint8)
    total = mx.distributed.all_sum(mx.array(buffer), group=group)
    return pickle.loads(bytes(np.array(total)))


def agree_on_seed(group: mx.distributed.Group) -> int:
    """Seed MLX's global generator with rank 0's seed on every rank (samplers without a seed
    of their own draw from it) and return it."""
    seed = int(np.random.default_rng().integers(2**31)) if group.rank() == 0 else None
    seed = broadcast(seed, group)
    mx.random.seed(seed)
    return seed


def same_on_every_rank(tokens: list[int], group: mx.distributed.Group) -> bool:
    """Whether every rank generated ``tokens``: ranks that drew different tokens would have fed
    their layers different inputs, and the all-reduces would have mixed them silently."""
    digest = np.frombuffer(
        hashlib.sha256(np.array(tokens, np.int64).tobytes()).digest()[:8], np.int64
    )
    gathered = mx.distributed.all_gather(mx.array(digest), group=group)
    return bool(mx.all(gathered == gathered[0]).item())


class Lockstep:
    """The scheduler's hook under ``mlx.launch``: each tick's admissions and cancellations,
    decided on rank 0 and the same on every rank (see the module docstring)."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.cancelled: set[str] = set()  # ids the scheduler drops this tick

    def admit(
        self, admit: Callable[[], list[Request] | None], running: Iterable
    ) -> list[Request] | None:
        """This tick's admitted requests (None: stop). ``admit``: the scheduler's own admission
        (called on rank 0 only); ``running``: its running sequences."""
        if self.group.rank() == 0:
            admitted = admit()
            work = None
            if admitted is not None:
                cancelled = [s.request.id for s in running if s.request.cancelled]
                requests = []
                for r in admitted:
                    request = (r.id, r.prompt_ids, r.params, r.model_inputs)
                    try:
                        pickle.dumps(request)
                    except Exception as e:  # noqa: BLE001 - that request fails, not the group
                        r.send(Failed(f"cannot hand the request to every rank: {e}"))
                        cancelled.append(r.id)  # dropped here before any forward runs it
                        continue
                    requests.append(request)
                work = {"admit": requests, "cancel": cancelled}
            broadcast(work, self.group)
        else:
            work = broadcast(None, self.group)
            admitted = None
            if work is not None:  # the events of these copies go nowhere: rank 0 answers
                admitted = [
                    Request(rid, ids, params, _ignore, _nothing, inputs)
                    for rid, ids, params, inputs in work["admit"]
                ]
        self.cancelled = set(work["cancel"]) if work is not None else set()
        return admitted


def _ignore(event) -> None:
    pass


def _nothing() -> None:
    pass
