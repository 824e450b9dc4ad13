"""Admission order of waiting sequences: ``fcfs``, ``lpm``, ``dfs-weight`` (SGLang's names).

Before each admission round the scheduler hands its waiting queue to :meth:`AdmissionOrder.
reorder`. With ``fcfs`` nothing moves. Otherwise, when at least two sequences wait, the first
:data:`LOOKAHEAD` of them are re-sorted so that work sharing KV goes first:

* ``lpm`` (longest prefix match): most cached prompt tokens first (a prefix-index lookup per
  waiting sequence), so cached prefixes are used before eviction takes them;
* ``dfs-weight``: waiting sequences are grouped by the prompt blocks they share with each
  other (a trie over their block-aligned prompts); groups are visited depth first, heaviest
  (most sequences) first, so a shared prefix is computed once and its sharers follow while it
  is resident.

Fairness: sequences that were preempted (they ran already), then sequences that have waited
through :data:`MAX_WAIT_ROUNDS` reorderings (in arrival order), go before every re-sorted one,
so nothing starves. Ties keep queue order (the sorts are stable).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from prefixkv.cache.protocol import PrefixCache
from prefixkv.engine.sequence import Sequence

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
LOOKAHEAD = 128
"""Most waiting sequences examined per round (the rest keep their place, behind)."""
MAX_WAIT_ROUNDS = 32
"""Reorderings a sequence may be passed over in before it goes first regardless of policy."""
MAX_TRIE_BLOCKS = 64
"""``dfs-weight`` groups by at most this many leading blocks of each prompt."""


class AdmissionOrder:
    """Reorders a waiting queue in place according to ``policy`` (see the module docstring).

    ``cache`` (the prefix index, or ``None`` with caching off, where every policy is FCFS)
    is only queried, with ``lock=False``: ``lpm`` lookups count as index queries and refresh
    the recency of the matched blocks, as SGLang's do.
    """

    def __init__(
        self,
        policy: str,
        cache: PrefixCache | None,
        block_size: int,
        *,
        max_wait_rounds: int = MAX_WAIT_ROUNDS,
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {policy!r}"
            )
        if max_wait_rounds < 1:
            raise ValueError(f"max_wait_rounds must be >= 1, got {max_wait_rounds}")
        self.policy = policy
        self.cache = cache
        self.block_size = block_size
        self.max_wait_rounds = max_wait_rounds
        self._rounds: dict[Sequence, int] = {}  # waiting sequence -> reorderings waited
        self._ticket: dict[Sequence, int] = {}  # waiting sequence -> order first seen
        self._next_ticket = 0
        self._preempted: set[Sequence] = set()

    def note_preempted(self, seq: Sequence) -> None:
        """``seq`` went back to the waiting queue after running: it keeps the front."""
        self._preempted.add(seq)

    def forget(self, seq: Sequence) -> None:
        """``seq`` left the waiting queue (admitted or finished)."""
        self._rounds.pop(seq, None)
        self._ticket.pop(seq, None)
        self._preempted.discard(seq)

    def reorder(self, waiting: deque[Sequence]) -> None:
        """Re-sort the head of ``waiting`` in place (a no-op for ``fcfs`` or < 2 waiting)."""
        if self.policy == "fcfs" or self.cache is None or len(waiting) < 2:
            return
        for s in waiting:
            if s not in self._ticket:
                self._ticket[s] = self._next_ticket
                self._next_ticket += 1
        head = [waiting.popleft() for _ in range(min(LOOKAHEAD, len(waiting)))]
        for s in head:
            self._rounds[s] = self._rounds.get(s, 0) + 1

        def due(s: Sequence) -> bool:
            return s in self._preempted or self._rounds[s] > self.max_wait_rounds

        first = sorted(
            (s for s in head if due(s)), key=lambda s: (s not in self._preempted, self._ticket[s])
        )
        rest = [s for s in head if not due(s)]
        ordered = self._lpm(rest) if self.policy == "lpm" else self._dfs_weight(rest)
        waiting.extendleft(reversed(first + ordered))

    def _lpm(self, seqs: list[Sequence]) -> list[Sequence]:
        assert self.cache is not None
        cached = {
            s: self.cache.match_prefix(s.token_ids[:-1], namespace=s.request.namespace).match_length
            for s in seqs
        }
        return sorted(seqs, key=lambda s: -cached[s])

    def _dfs_weight(self, seqs: list[Sequence]) -> list[Sequence]:
        root = _Node()
        bs = self.block_size
        for order, s in enumerate(seqs):
            node = root
            node.weight += 1
            tokens = s.token_ids
            usable = min((len(tokens) - 1) // bs, MAX_TRIE_BLOCKS)
            key: object = s.request.namespace  # tenants never share: separate subtrees
            for b in range(usable + 1):
                node = node.child(key, order)
                node.weight += 1
                if b < usable:
                    key = tuple(tokens[b * bs : (b + 1) * bs])
            node.seqs.append(s)
        return list(root.walk())


class _Node:
    __slots__ = ("children", "first", "seqs", "weight")

    def __init__(self, first: int = 0) -> None:
        self.children: dict[object, _Node] = {}
        self.seqs: list[Sequence] = []
        self.weight = 0
        self.first = first  # arrival order of the first sequence through here (tie-break)

    def child(self, key: object, order: int) -> _Node:
        node = self.children.get(key)
        if node is None:
            node = self.children[key] = _Node(order)
        return node

    def walk(self) -> Iterable[Sequence]:
        stack: list[_Node] = [self]
        while stack:
            node = stack.pop()
            yield from node.seqs
            kids = sorted(node.children.values(), key=lambda n: (-n.weight, n.first))
            stack.extend(reversed(kids))
