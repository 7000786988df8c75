"""The server's prefix cache: a multi-turn chat or a shared system prompt prefills only its new
tokens.

A trie over a prompt's prefill chunks (``generate.prefill_chunks``): a node is one chunk, keyed
by its tokens (and, once an image token has been seen, by a digest of the request's images),
and holds what each layer cache needs to resume at the chunk's end beyond its ancestors'
blocks (the ``prefix_block`` / ``resume`` capability of the cache kinds, ``runtime.model.cache``):
a full-KV layer the chunk's keys and values, a windowed layer the chunk's last ``window - 1``
keys at most, a recurrent layer its whole state at that boundary. A request walks its own
chunk schedule down the trie; the deepest node it may resume at gives the tokens it skips.

Why blocks are prefill chunks: a request that resumes at a chunk boundary prefills the rest on
the very boundaries it would have used without the hit, so every forward computes the same
arrays, bit for bit, and greedy output is identical by construction, not within a tolerance.
The boundaries are also where the scheduler evaluates a sequence's caches anyway, so a
snapshot costs one copy of the chunk's keys and no extra forward. The price: reuse comes in
whole chunks (``--prefill-chunk-size``), and a prompt's last chunk is always prefilled (its
logits give the first token).

When a node may be resumed at (``resumable``):

- Snapshots are taken while prefilling only, after each chunk; a full-KV layer that has been
  trimmed (``--max-kv-size``) returns no block and the sequence stops adding nodes: a prefix is
  reusable only while held whole from its start, sinks and all. Decode states are never stored
  (the next turn would then differ from a fresh prefill in how its tokens were computed).
- Images: a node before the request's first image token is keyed by tokens alone (any request
  sharing them may resume there, text-only or with images, whose vision inputs then run with
  the first chunk after the hit as they would have with the first chunk). A text-only request
  to a model that takes images marks its nodes ``TEXT``: its text may hold image placeholder
  ids, embedded as text, so a request with images never resumes there (text requests do). Nodes after it are
  keyed by the images' digest too; they may be resumed at only once every image token has been
  seen, with the prompt state (MRoPE positions) copied at that boundary; the request's vision
  inputs are then not run at all. A boundary inside the images stores its blocks (its
  descendants need them) but is no resume point.

The trie holds at most ``budget`` bytes of blocks and keys (what is really held: every block
is a copy of its own, never a view of a live buffer); past it, the least recently used leaf
goes first (an inner node's blocks are part of every descendant's prefix).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

TEXT = b"text"  # the key marker of a text-only request's chunks on a model that takes images


def image_digest(model_inputs: Mapping[str, Any]) -> bytes:
    """A digest of a request's vision inputs (pixel data, grids, sizes): the image part of the
    key of every node at or after its first image token."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(model_inputs):
        value = np.asarray(model_inputs[name])
        h.update(f"{name}:{value.dtype.str}:{value.shape};".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.digest()


class Node:
    """One prefill chunk of a cached prefix; see the module docstring."""

    def __init__(self, parent: Node | None, key: tuple[bytes, bytes | None], end: int) -> None:
        self.parent = parent
        # (the chunk's tokens as int32 bytes, its marker: None, TEXT or the image digest)
        self.key = key
        self.end = end  # tokens of the prefix up to and including this chunk
        self.children: dict[tuple[bytes, bytes | None], Node] = {}
        self.blocks: list[list[mx.array]] = []  # per layer cache, its prefix_block
        self.prompt_state: Any = None  # the sequence's prompt state (MRoPE) when images are past
        self.resumable = False
        self.images_done = False  # every image token of its prefix's request is in it
        self.nbytes = 0
        self.last_used = 0
        self.evicted = False

    def path(self) -> list[Node]:
        """The nodes from the first chunk down to this one."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


@dataclass
class Hit:
    node: Node

    @property
    def tokens(self) -> int:
        return self.node.end

    @property
    def images_done(self) -> bool:
        """The prefix holds every image token: the request's vision inputs are not needed."""
        return self.node.images_done


def chunk_key(prompt_ids: Sequence[int], start: int, end: int, marker: bytes | None):
    return (np.asarray(prompt_ids[start:end], np.int32).tobytes(), marker)


def cacheable(caches: list) -> bool:
    """Whether every layer cache of a sequence can snapshot and resume its prefix."""
    return bool(caches) and all(
        callable(getattr(c, "prefix_block", None)) and callable(getattr(c, "resume", None))
        for c in caches
    )


class PrefixCache:
    """The trie, its byte budget and LRU order (scheduler thread only)."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.root = Node(None, (b"", None), 0)
        self.nbytes = 0
        self.nodes = 0
        self.hits = 0  # requests that resumed from a cached prefix
        self.hit_tokens = 0  # prompt tokens they did not prefill
        self._clock = itertools.count(1)

    def lookup(
        self,
        prompt_ids: Sequence[int],
        chunks: list[tuple[int, int]],
        markers: Sequence[bytes | None] = (None,),
    ) -> Hit | None:
        """The deepest node this prompt may resume at: its own chunk schedule (``chunks``)
        walked down the trie, never into its last chunk, through nodes keyed by one of
        ``markers`` (the request's). Counts a hit and touches its path."""
        node, best = self.root, None
        for start, end in chunks[:-1]:
            tokens, _ = chunk_key(prompt_ids, start, end, None)
            child = next(
                (c for m in markers if (c := node.children.get((tokens, m))) is not None), None
            )
            if child is None:
                break
            node = child
            if node.resumable:
                best = node
        if best is None:
            return None
        self._touch(best)
        self.hits += 1
        self.hit_tokens += best.end
        return Hit(best)

    def restore(self, hit: Hit, caches: list) -> None:
        """Make the fresh ``caches`` (``make_cache()``) what they were at the hit's boundary."""
        path = hit.node.path()
        for layer, cache in enumerate(caches):
            cache.resume([n.blocks[layer] for n in path], hit.node.end)
        if hit.node.prompt_state is not None:
            caches.rope_state = copy.deepcopy(hit.node.prompt_state)

    def child(self, parent: Node, key: tuple[bytes, bytes | None]) -> Node | None:
        return parent.children.get(key)

    def insert(
        self,
        parent: Node,
        key: tuple[bytes, bytes | None],
        end: int,
        blocks: list[list[mx.array]],
        *,
        resumable: bool,
        images_done: bool = False,
        prompt_state: Any = None,
    ) -> Node | None:
        """Add a child of ``parent`` holding ``blocks`` (evaluated copies), then evict to the
        budget. None when ``parent`` has been evicted (its sequence stops adding nodes) or the
        new node did not fit."""
        if parent.evicted:
            return None
        node = parent.children.get(key)
        if node is None:
            node = Node(parent, key, end)
            node.blocks = blocks
            node.resumable, node.images_done = resumable, images_done
            node.prompt_state = copy.deepcopy(prompt_state)
            node.nbytes = len(key[0]) + sum(a.nbytes for layer in blocks for a in layer)
            parent.children[key] = node
            self.nbytes += node.nbytes
            self.nodes += 1
        self._touch(node)
        self._evict()
        return None if node.evicted else node

    def _touch(self, node: Node) -> None:
        now = next(self._clock)
        while node is not None:  # an ancestor is at least as recent as its descendants
            node.last_used = now
            node = node.parent

    def _evict(self) -> None:
        while self.nbytes > self.budget:
            leaves = [n for n in self._all() if not n.children]
            if not leaves:
                return
            leaf = min(leaves, key=lambda n: n.last_used)
            del leaf.parent.children[leaf.key]
            leaf.evicted, leaf.blocks, leaf.prompt_state = True, [], None
            self.nbytes -= leaf.nbytes
            self.nodes -= 1

    def _all(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def stats(self) -> dict[str, int]:
        return {
            "bytes": self.nbytes,
            "budget": self.budget,
            "nodes": self.nodes,
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
        }
