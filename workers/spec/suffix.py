"""Suffix decoding (the ``suffix`` method, after Arctic Inference): drafts from a count-weighted
suffix trie of what the sequence and its group's earlier outputs already said.

``SuffixTree`` stores every substring of up to ``max_depth`` tokens of the sequences put in it, each
with its number of occurrences. To draft, the longest suffix of the context (shorter than
``max_depth``) that was seen followed by something is looked up, and the walk goes on to the most
frequent next token while the estimated probability stays high enough.

Representation: a node is a run of tokens that every occurrence reaching it goes through whole
(one count for the run, children after its last token), kept as a slice of one stored sequence
(the newest that entered it) rather than a copy. A run that only one occurrence took is a *leaf*,
open-ended: a leaf of the sequence being extended grows with it at no cost. A count is the number
of stored substrings that pass through or end at the node (Arctic's definition); a leaf's is 1.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, MutableSequence
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchinfer.workers.engine.sequence import Sequence

# History groups kept at once (the least recently used one goes beyond this).
MAX_GROUPS = 64


class _Inner:
    """The run ``ref[start:start + length]`` with one count, and its children by first token (the
    root: an empty run)."""

    __slots__ = ("ref", "start", "length", "count", "children", "best", "parent")

    def __init__(self, ref: MutableSequence[int], start: int, length: int, count: int,
                 parent: _Inner | None) -> None:
        self.ref = ref
        self.start = start
        self.length = length
        self.count = count
        self.children: dict[int, _Node] = {}
        self.best: int | None = None  # the first token of the most frequent child; None: not known
        self.parent = parent


class _Leaf:
    """The tokens ``ref[start:]`` of one occurrence below a parent that ends at depth ``depth0``, up
    to ``max_depth`` (``SuffixTree._run_len``); ``ref`` is that occurrence's own sequence."""

    __slots__ = ("ref", "start", "depth0", "parent")
    children = None  # tells a leaf from an inner node
    count = 1

    def __init__(self, ref: MutableSequence[int], start: int, depth0: int, parent: _Inner) -> None:
        self.ref = ref
        self.start = start
        self.depth0 = depth0
        self.parent = parent


_Node = _Inner | _Leaf


@dataclass(slots=True)
class SuffixMatch:
    """Where a context's suffix ends in a tree (valid until the tree changes): ``used`` tokens into
    ``node``'s run, ``length`` tokens long. ``self_counted``: the context itself is stored there (a
    sequence matched in its own tree), so one of the occurrences has no known continuation and is
    left out of the probabilities."""

    node: _Node
    used: int
    length: int
    self_counted: bool


class SuffixTree:
    """A bounded-depth suffix trie with occurrence counts.

    A tree either grows one sequence (``extend``, O(depth) per token: the nodes where its suffixes
    end are kept) or holds whole sequences (``insert``/``remove`` by key), not both. It has at most
    (stored tokens) x ``max_depth`` nodes (``num_nodes``); unique text takes one per token and
    repeats share theirs. ``remove`` gives a sequence's nodes back: the tree returns to the nodes it
    would have without that sequence. (Runs point into the newest sequence that entered them, so
    removing sequences oldest first also frees their tokens at once; out of order, a surviving run
    may keep a removed sequence's tokens alive until it goes.)"""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Inner([], 0, 0, 0, None)  # its count: the stored tokens (a suffix starts at each)
        self.num_nodes = 0  # besides the root
        self._seqs: dict[Hashable, array[int]] = {}  # whole sequences, by key
        self._growing: list[int] = []  # the sequence extend() grows
        # _active[d]: the node whose run ends where the growing sequence's last d tokens end
        # (d = 0: the root). Longer suffixes end in its own leaves, which grow with it untouched.
        self._active: list[_Inner] = [self._root]

    @property
    def num_tokens(self) -> int:
        return self._root.count

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    # --- building -----------------------------------------------------------------------------

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the growing sequence."""
        if self._seqs:
            raise ValueError("a suffix tree that holds whole sequences cannot grow one")
        ref, active = self._growing, self._active
        for token in tokens:
            active = self._append(ref, active, int(token))
        self._active = active

    def insert(self, key: Hashable, tokens: Iterable[int]) -> None:
        """Store the whole sequence ``tokens`` under ``key`` (a new key)."""
        if self._growing:
            raise ValueError("a suffix tree that grows a sequence cannot hold whole ones")
        if key in self._seqs:
            raise ValueError(f"suffix tree already holds a sequence {key!r}")
        ref: array[int] = array("q")
        active = [self._root]
        for token in tokens:
            active = self._append(ref, active, int(token))
        self._seqs[key] = ref

    def remove(self, key: Hashable) -> bool:
        """Take the sequence stored under ``key`` out again (False: no such key): every count it
        added is taken back, nodes left with none are dropped and runs are joined again."""
        ref = self._seqs.pop(key, None)
        if ref is None:
            return False
        root, depth_cap, n = self._root, self.max_depth, len(ref)
        path: list[_Node] = []  # the nodes this occurrence passes, from the root down
        for i in range(n):
            root.count -= 1
            path.clear()
            node: _Node = root
            depth, end = 0, min(depth_cap, n - i)
            while depth < end and isinstance(node, _Inner):
                child = node.children.get(ref[i + depth])
                if child is None:  # unreachable in a consistent tree
                    break
                path.append(child)
                depth += child.length if isinstance(child, _Inner) else end
                node = child
            for node in reversed(path):  # deepest first, so joins can go on upwards
                parent = node.parent
                assert parent is not None
                first = node.ref[node.start]
                if parent.best == first:
                    parent.best = None
                if isinstance(node, _Leaf):
                    del parent.children[first]
                    self.num_nodes -= 1
                    continue
                node.count -= 1
                if node.count == 0:
                    del parent.children[first]
                    self.num_nodes -= 1
                else:
                    self._join(node)
        return True

    def _append(self, ref: MutableSequence[int], active: list[_Inner], token: int) -> list[_Inner]:
        """Append ``token`` to the sequence ``ref`` whose suffixes end at ``active``; return the new
        active nodes. Each suffix shorter than max_depth gains the child ``token``: a new leaf when
        unseen, else one more count on a node whose run starts with it (split off when longer)."""
        pos = len(ref)
        ref.append(token)
        root = self._root
        root.count += 1
        depth_cap = self.max_depth
        reached: list[_Inner | None] = [root] + [None] * len(active)  # by depth
        for d in range(len(active) - 1, -1, -1):  # deepest first: a split never moves a run's end
            node = active[d]
            child = node.children.get(token)
            if child is None:  # unseen: a new leaf, and all longer suffixes + token are unseen too
                node.children[token] = _Leaf(ref, pos, d, node)
                self.num_nodes += 1
                self._note_count(node, token, 1)
                continue
            if node is not root and len(node.children) == 1 and node.count == child.count + 1:
                # Only this suffix ends at node and everything else goes on into child: node's run
                # (this sequence's last tokens) takes the token over and ends one deeper.
                self._lengthen(node, child)
                child = node
            elif isinstance(child, _Leaf):  # one earlier occurrence's leaf: its first token has two
                upper = _Inner(ref, pos, 1, 2, node)
                self._shift_leaf(child, upper)
                node.children[token] = upper
                self.num_nodes += 1
                child = upper
            elif child.length > 1:  # only the run's first token gains this occurrence
                upper = _Inner(ref, pos, 1, child.count + 1, node)
                child.start += 1
                child.length -= 1
                child.parent = upper
                upper.best = child.ref[child.start]
                upper.children[upper.best] = child
                node.children[token] = upper
                self.num_nodes += 1
                child = upper
            else:
                child.count += 1
                child.ref, child.start = ref, pos  # the newest occurrence holds the run
            if child is not node:
                self._note_count(node, token, child.count)
            if d + 1 < depth_cap:
                reached[d + 1] = child
        # the suffixes seen before form a prefix of the depths (a suffix's suffixes were seen too)
        new_active: list[_Inner] = []
        for n in reached:
            if n is None:
                break
            new_active.append(n)
        return new_active

    def _lengthen(self, node: _Inner, child: _Node) -> None:
        """Move ``child``'s first token to the end of ``node``'s run (its only child, with equal
        counts once this occurrence went on); a child of one token is merged into ``node`` whole."""
        del node.children[child.ref[child.start]]
        node.best = None
        node.length += 1
        if isinstance(child, _Leaf):
            self._shift_leaf(child, node)
        elif child.length > 1:
            child.start += 1
            child.length -= 1
            node.best = child.ref[child.start]
            node.children[node.best] = child
        else:
            node.children = child.children
            node.best = child.best
            for grandchild in node.children.values():
                grandchild.parent = node
            self.num_nodes -= 1

    def _shift_leaf(self, leaf: _Leaf, parent: _Inner) -> None:
        """Make ``leaf``'s first token part of ``parent`` just above it (the leaf goes when that was
        all of it, at max_depth)."""
        leaf.start += 1
        leaf.depth0 += 1
        leaf.parent = parent
        if self._run_len(leaf) > 0:
            parent.best = leaf.ref[leaf.start]
            parent.children[parent.best] = leaf
        else:
            self.num_nodes -= 1

    def _join(self, node: _Inner) -> None:
        """Merge ``node`` into its only child when every occurrence through it goes on into that
        child (equal counts): the child's run reaches up over node's (the occurrences the child
        points into went through node just before)."""
        parent = node.parent
        if parent is None or len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.count != node.count:
            return
        child.start -= node.length
        if isinstance(child, _Leaf):
            child.depth0 -= node.length
        else:
            child.length += node.length
        child.parent = parent
        parent.children[node.ref[node.start]] = child
        self.num_nodes -= 1

    @staticmethod
    def _note_count(node: _Inner, token: int, count: int) -> None:
        """Keep ``node.best`` right after its child ``token`` grew to ``count``."""
        best = node.best
        if best is None or best == token:
            return
        best_count = node.children[best].count
        if count > best_count or (count == best_count and token < best):
            node.best = token

    def _run_len(self, node: _Node) -> int:
        if isinstance(node, _Inner):
            return node.length
        return min(len(node.ref) - node.start, self.max_depth - node.depth0)

    # --- drafting -----------------------------------------------------------------------------

    def _walk(self, context: SequenceOf[int], m: int) -> tuple[_Node, int] | None:
        """Where the last ``m`` tokens of ``context`` end: (node, tokens used of its run), or None."""
        node: _Node = self._root
        used = 0
        for i in range(len(context) - m, len(context)):
            token = context[i]
            if used < self._run_len(node):
                if node.ref[node.start + used] != token:
                    return None
                used += 1
            elif isinstance(node, _Inner) and token in node.children:
                node, used = node.children[token], 1
            else:
                return None
        return node, used

    def _continues(self, node: _Node, used: int) -> bool:
        if used < self._run_len(node):
            return True
        return isinstance(node, _Inner) and bool(node.children)

    def match(self, context: SequenceOf[int]) -> SuffixMatch | None:
        """The longest suffix of ``context`` (under ``max_depth`` tokens) stored with a next token.

        Being stored with a continuation holds for a suffix's suffixes too, so a binary search over
        the length needs O(depth log depth) steps."""
        lo, hi = 0, min(self.max_depth - 1, len(context))
        found: tuple[_Node, int] | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            at = self._walk(context, mid)
            if at is not None and self._continues(*at):
                lo, found = mid, at
            else:
                hi = mid - 1
        if found is None:
            return None
        return SuffixMatch(found[0], found[1], lo, self_counted=False)

    def match_growing(self) -> SuffixMatch | None:
        """``match`` for the growing sequence in its own tree, read off its suffix nodes (each was
        seen before, so it has a next token); its own occurrence is left out of the probabilities."""
        for depth in range(len(self._active) - 1, 0, -1):
            node = self._active[depth]
            if node.children:
                return SuffixMatch(node, node.length, depth, self_counted=True)
        return None

    def speculate(self, match: SuffixMatch, max_tokens: int, min_token_prob: float,
                  max_spec_factor: float) -> tuple[list[int], float]:
        """Drafts continuing ``match``, and their score (the expected number accepted).

        Up to ``min(max_tokens, ceil(match.length * max_spec_factor))`` tokens: each step takes the
        most frequent next token (ties: the smaller id) with probability child count / node count;
        the walk stops when the running product of those falls under ``min_token_prob``. The score
        is the sum of the running products."""
        limit = min(max_tokens, math.ceil(match.length * max_spec_factor))
        node, used = match.node, match.used
        discount = 1 if match.self_counted else 0
        prob, score = 1.0, 0.0
        drafts: list[int] = []
        while len(drafts) < limit:
            if used < self._run_len(node):  # inside a run: every occurrence here goes on
                token, p = node.ref[node.start + used], 1.0
                used += 1
            elif isinstance(node, _Inner) and node.children:
                token = node.best if node.best is not None else self._best_child(node)
                child = node.children[token]
                p = child.count / max(node.count - discount, 1)
                node, used = child, 1
            else:
                break
            discount = 0
            prob *= p
            if prob < min_token_prob:
                break
            drafts.append(token)
            score += prob
        return drafts, score

    @staticmethod
    def _best_child(node: _Inner) -> int:
        children = node.children
        best = min(children, key=lambda t: (-children[t].count, t))
        node.best = best
        return best

    # --- inspection ---------------------------------------------------------------------------

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """Every stored substring with its count (for tests and debugging: O(nodes * depth))."""
        counts: dict[tuple[int, ...], int] = {}
        stack: list[tuple[_Inner, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                run = tuple(child.ref[child.start:child.start + self._run_len(child)])
                for j in range(1, len(run) + 1):
                    counts[prefix + run[:j]] = child.count
                if isinstance(child, _Inner):
                    stack.append((child, prefix + run))
        return counts

    def count_nodes(self) -> int:
        """The nodes reachable from the root (``num_nodes`` says the same, in O(1))."""
        total, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            total += len(node.children)
            stack.extend(c for c in node.children.values() if isinstance(c, _Inner))
        return total


GroupKey = tuple[str | None, str | None]  # (request.spec_group, adapter name)


class _History:
    """One group's finished outputs: their tree and keys, oldest first."""

    __slots__ = ("tree", "keys")

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.keys: deque[int] = deque()


class _Live:
    """One live sequence's own tree over its prompt + output, and how many tokens it was fed."""

    __slots__ = ("tree", "fed")

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.fed = 0


class SuffixProposer:
    """The ``suffix`` method: each step drafts from whichever scores better, the sequence's own
    tree (prompt + output so far) or its group's history (the outputs of finished sequences).

    A group is ``(request.spec_group, seq.lora)``: the job a request belongs to and its adapter.
    Requests without a group and adapter share the group ``(None, None)``: all ungrouped requests
    of the engine learn from each other's outputs. ``release`` files a sequence's output into its
    group's history, which holds at most ``max_cached_requests`` outputs across all groups (the
    least recently used group's oldest goes first; 0: no history) in at most ``max_groups`` groups.
    Memory: every tree has at most (tokens it holds) x ``max_depth`` nodes, about one per token in
    practice (some 150-250 bytes a token, measured on unique and on templated text); a live
    sequence's tree (its prompt + output) is dropped at ``release``."""

    method = "suffix"

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 1000, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0, max_groups: int = MAX_GROUPS) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix max_depth must be >= 2, got {max_depth}")
        if max_cached_requests < 0 or max_groups < 1:
            raise ValueError(f"suffix history bounds must be >= 0 requests and >= 1 group, got "
                             f"{max_cached_requests} and {max_groups}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.max_groups = max_groups
        self._live: dict[int, _Live] = {}  # seq_id -> its own tree
        self._groups: OrderedDict[GroupKey, _History] = OrderedDict()  # least recently used first
        self._num_cached = 0  # outputs held across all groups
        self._next_key = 0

    @property
    def num_cached_outputs(self) -> int:
        return self._num_cached

    def history(self, key: GroupKey) -> SuffixTree | None:
        """The history tree of group ``key`` (None: none kept)."""
        group = self._groups.get(key)
        return group.tree if group is not None else None

    @staticmethod
    def group_key(seq: Sequence) -> GroupKey:
        request = seq.request
        return (request.spec_group if request is not None else None, seq.lora)

    def propose(self, seqs: SequenceOf[Sequence], max_tokens: SequenceOf[int]) -> list[list[int]]:
        """Drafts for each of ``seqs``, at most ``max_tokens[i]`` each."""
        return [self._propose_one(seq, k) for seq, k in zip(seqs, max_tokens, strict=True)]

    def _propose_one(self, seq: Sequence, k: int) -> list[int]:
        if k < 1:
            return []
        live = self._live.get(seq.seq_id)
        if live is None:
            live = self._live[seq.seq_id] = _Live(self.max_depth)
        tokens = seq.token_ids
        if len(tokens) > live.fed:
            live.tree.extend(tokens[live.fed:])
            live.fed = len(tokens)
        drafts: list[int] = []
        score = 0.0
        own = live.tree.match_growing()
        if own is not None:
            drafts, score = live.tree.speculate(own, k, self.min_token_prob, self.max_spec_factor)
        key = self.group_key(seq)
        group = self._groups.get(key)
        if group is not None:
            self._groups.move_to_end(key)
            context = tokens[max(len(tokens) - (self.max_depth - 1), 0):]
            found = group.tree.match(context)
            if found is not None:
                theirs, their_score = group.tree.speculate(found, k, self.min_token_prob,
                                                           self.max_spec_factor)
                if their_score > score:
                    drafts = theirs
        return drafts

    def release(self, seq: Sequence) -> None:
        """File ``seq``'s output into its group's history and drop its own tree (a no-op for a
        sequence never proposed for)."""
        if self._live.pop(seq.seq_id, None) is None:
            return
        if self.max_cached_requests > 0 and seq.output_token_ids:
            self._file(self.group_key(seq), seq.output_token_ids)

    def _file(self, key: GroupKey, output: list[int]) -> None:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _History(self.max_depth)
        self._groups.move_to_end(key)
        group.tree.insert(self._next_key, output)
        group.keys.append(self._next_key)
        self._next_key += 1
        self._num_cached += 1
        while self._num_cached > self.max_cached_requests:  # the least recently used group's oldest
            lru_key, lru = next(iter(self._groups.items()))
            lru.tree.remove(lru.keys.popleft())
            self._num_cached -= 1
            if not lru.keys:
                del self._groups[lru_key]
        while len(self._groups) > self.max_groups:
            _, dropped = self._groups.popitem(last=False)
            self._num_cached -= len(dropped.keys)
