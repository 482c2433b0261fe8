"""Regular constraints as token automata: a particle's state is a key, a mask is a gather.

A byte automaton (a :class:`~.lazydfa.LazyDFA`, made on demand from a Python regular expression,
from genlm-control's byte automaton, or from a complete :class:`~.lazydfa.ByteDFA`) is bound to a
vocabulary here. A particle's state is the key of the DFA state after the bytes of the tokens it
has generated. For each state a step meets, the tokens allowed next are found once, by walking
every text token's bytes from that state at the same time (numpy, one gather per token byte
position, the DFA's missing rows made first: :class:`TokenWalk`), and kept as a packed bitmask
row (xgrammar's layout) in a table shared by every run over the same pattern and vocabulary
(:class:`TokenMasks`). A step's bitmasks are then one ``index_select`` of that table, and
advancing a particle walks its token's few bytes in the DFA. No grammar matcher runs per particle
per step.

A token may come next in state ``s`` when it has bytes (special tokens and padding columns have
none: never allowed), is not an EOS id, and its bytes do not lead ``s`` to the dead state; an
EOS id may come next where ``s`` accepts. So the language is exactly the DFA's: a text is
allowed when its bytes are accepted, whatever the tokens it is cut into (a token may end inside a
multi-byte character, or cross several of the pattern's parts).

Memory: the mask table holds at most ``max_rows`` rows (by default as many as fit in
:data:`MASK_BYTES`), the DFA at most its cache's bytes; past those the least recently used rows
and states are dropped and made again when needed (the same bits: the result never depends on
the caches). The time spent making states and rows is in the bound constraint's ``seconds`` (a
run's ``stats["constraint_s"]``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .bytenfa import ByteNFA
from .constraint_base import BoundConstraint, Constraint, ConstraintError
from .futures import Futures
from .lazydfa import ByteDFA, LazyDFA
from .walk_cpu import TokenBytes

if TYPE_CHECKING:
    import torch

#: Bytes of bitmask rows one (pattern, vocabulary) table may keep (least recently used dropped).
MASK_BYTES = 64 << 20
#: :attr:`TokenMasks._used` of a free row: above every gather's number.
_FREE = np.iinfo(np.int64).max
#: Past this many tokens still walking, a fill keeps only the live ones for the next byte.
COMPACT_ABOVE = 8192
#: A state of 2 to this many NFA positions gets its text tokens as the union of its positions'
#: (:meth:`TokenMasks._text_row`); larger ones are walked.
SPLIT_MAX = 64
#: Walks the position unions may spend before they have saved any (see :meth:`TokenMasks._text_row`).
SPLIT_CREDIT = 8
#: Bytes of the per-position rows (:meth:`TokenMasks._text_row`) one table keeps.
TEXT_ROW_BYTES = 16 << 20
#: States of at most this many NFA positions look their text row up by the signature of their
#: near future (:mod:`.futures`) before walking; larger ones are walked.
SIGNATURE_MAX = 256


class TokenWalk:
    """A vocabulary's text tokens laid out to be walked through a byte DFA all at once: the ids
    of the tokens that have bytes and are not EOS, longest first, and for each byte position
    ``k`` the ``k``-th byte of every token longer than ``k``. Shared by every pattern bound to
    the same vocabulary."""

    def __init__(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int) -> None:
        eos = {int(e) for e in eos_ids}
        n = min(len(byte_vocab), width)
        ids = np.array([i for i in range(n) if byte_vocab[i] and i not in eos], dtype=np.int64)
        lengths = np.array([len(byte_vocab[i]) for i in ids], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        self.ids = ids[order]
        lengths = lengths[order]
        buf = np.frombuffer(b"".join(bytes(byte_vocab[i]) for i in self.ids), dtype=np.uint8)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
        #: Each text token's bytes by id, for a step's advances (:meth:`.LazyDFA.walk_tokens`).
        self.token_bytes = TokenBytes(self.ids, lengths, starts, buf, n)
        longest = self.longest = int(lengths[0]) if len(lengths) else 0
        self.columns: list[np.ndarray] = []
        for k in range(longest):
            count = int(np.searchsorted(-lengths, -k, side="left"))  # tokens longer than k
            self.columns.append(buf[starts[:count] + k].astype(np.int64))
        self.eos = np.array(sorted(e for e in eos if 0 <= e < width), dtype=np.int64)
        self.width = width
        self.words = (width + 31) // 32

    def allowed(self, dfa: LazyDFA, slot: int, eos: bool = True) -> np.ndarray:
        """Bool ``[32 * words]``: the tokens that may come next in the DFA state in ``slot``
        (the caller holds ``dfa.lock``); ``eos=False``: the text tokens only."""
        cur = np.full(len(self.ids), slot, dtype=np.int64)
        alive: np.ndarray | None = None  # positions still walking (None: all), ascending
        for col in self.columns:
            if alive is None:  # every token longer than this byte, dead or not: no bookkeeping
                c = len(col)
                cur[:c] = dfa.gather(cur[:c], col)
                if c > COMPACT_ABOVE:  # a large vocabulary: walk on with the live tokens only
                    alive = np.flatnonzero(cur[:c])
                continue
            a = alive[: np.searchsorted(alive, len(col))]
            if not len(a):
                break
            cur[a] = dfa.gather(cur[a], col[a])
            alive = a[cur[a] != 0]
        mask = np.zeros(32 * self.words, dtype=bool)
        mask[self.ids[cur != 0]] = True
        if eos and dfa.accept[slot]:
            mask[self.eos] = True
        return mask


def _pack_row(mask: np.ndarray) -> np.ndarray:
    """Bool ``[32 * W]`` -> int32 ``[W]`` (bit ``j % 32`` of word ``j // 32`` is token ``j``)."""
    return np.packbits(mask, bitorder="little").view(np.int32)


class TokenMasks:
    """The bitmask rows of one DFA over one vocabulary, filled per state on first use and kept
    (up to ``max_rows``; thread-safe: runs on several threads may share it)."""

    def __init__(self, dfa: LazyDFA, walk: TokenWalk, max_rows: int | None = None) -> None:
        import torch

        self.dfa = dfa
        self.walk = walk
        self.max_rows = max(1, max_rows if max_rows is not None else MASK_BYTES // (4 * walk.words))
        self._rows = torch.zeros((min(64, self.max_rows), walk.words), dtype=torch.int32)
        self._counts = np.zeros(self._rows.shape[0], dtype=np.int64)
        self._where: dict[bytes, int] = {}  # state key -> row
        self._key_of: list[bytes | None] = [None] * self._rows.shape[0]  # row -> state key (None: free)
        #: Per row, the last gather that read it (free rows: :data:`_FREE`, never a victim); the
        #: least recently read row not read by the current gather is evicted first.
        self._used = np.full(self._rows.shape[0], _FREE, dtype=np.int64)
        self._tick = 0
        self._free: list[int] = list(range(self._rows.shape[0] - 1, -1, -1))
        self._lock = threading.Lock()
        self.filled = 0  # rows computed (again, after an eviction)
        self.evicted = 0
        #: Copies of the table on other devices (the rows' device: a step's bitmasks are then
        #: gathered there, only the row indices cross), with the rows changed since each was
        #: brought up to date (None: copy it whole).
        self._on: dict[Any, torch.Tensor] = {}
        self._stale: dict[Any, set[int] | None] = {}
        #: Packed text-token rows (no EOS) by state key, least recently used first (:meth:`_text_row`).
        self._text: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._text_max = max(64, TEXT_ROW_BYTES // (4 * walk.words))
        self.walked = 0  # vocabulary walks (a row made from its positions' rows needs none)
        #: Rows shared by states with the same near future (:mod:`.futures`).
        self.futures = Futures(dfa.nfa, walk.longest, self._text_max)
        self.shared = 0  # text rows found under a signature (no walk, no union)
        #: Walks the position unions may still spend past the walks they saved (see :meth:`_text_row`).
        self._credit = SPLIT_CREDIT

    def gather(self, states: Sequence[bytes], words: int, device: Any = None) -> tuple[torch.Tensor, np.ndarray]:
        """The bitmask rows of ``states`` (DFA state keys; ``int32 [len(states), words]``, a new
        tensor on ``device``: the host by default) and the allowed-token count of each (host
        numpy), filling rows for states met for the first time."""
        import torch

        with self._lock:
            self._tick += 1
            where = self._where
            get = where.get
            idx = [get(k, -1) for k in states]
            if -1 in idx:  # states met for the first time (or whose rows were evicted)
                used, tick = self._used, self._tick
                for r in idx:  # this gather's rows are never chosen as victims
                    if r >= 0:
                        used[r] = tick
                with self.dfa.lock:
                    self.dfa.trim()
                    for k in dict.fromkeys(states):
                        if k not in where:
                            self._fill(k)
                idx = [where[k] for k in states]
            at = np.array(idx, dtype=np.int64)
            self._used[at] = self._tick
            table = self._rows if device is None else self._table_on(torch.device(device))
            rows = table if words >= table.shape[1] else table[:, :words]
            if rows.device.type == "cpu":  # numpy's gather: a new array, no index tensor
                return torch.from_numpy(rows.numpy()[at]), self._counts[at]
            return rows.index_select(0, torch.from_numpy(at).to(rows.device, non_blocking=True)), self._counts[at]

    @property
    def table(self) -> torch.Tensor:
        """The host table: ``int32 [rows, words]``, one bitmask row per row key kept."""
        return self._rows

    def _table_on(self, device: Any) -> torch.Tensor:
        """The table on ``device``, brought up to date (under the lock)."""
        import torch

        if device == self._rows.device:
            return self._rows
        copy = self._on.get(device)
        stale = self._stale.get(device)
        if copy is None or stale is None or copy.shape != self._rows.shape:
            copy = self._on[device] = self._rows.to(device)
        elif stale:
            at = torch.tensor(sorted(stale), dtype=torch.int64)
            copy.index_copy_(0, at.to(device), self._rows.index_select(0, at).to(device))
        self._stale[device] = set()
        return copy

    def _fill(self, key: bytes) -> None:
        """Compute ``key``'s row into a free row, evicting the least recently read row that the
        current gather did not read when none is free."""
        import torch

        if not self._free:
            if self._rows.shape[0] < self.max_rows:
                old = self._rows.shape[0]
                new = min(self.max_rows, 2 * old)
                grown = torch.zeros((new, self.walk.words), dtype=torch.int32)
                grown[:old] = self._rows
                self._rows = grown
                self._stale = dict.fromkeys(self._stale)  # device copies: whole again
                self._counts = np.concatenate([self._counts, np.zeros(new - old, dtype=np.int64)])
                self._used = np.concatenate([self._used, np.full(new - old, _FREE, dtype=np.int64)])
                self._key_of += [None] * (new - old)
                self._free = list(range(new - 1, old - 1, -1))
            else:
                victim = int(np.argmin(self._used))
                if self._used[victim] >= self._tick:  # every row is read by this gather
                    raise RuntimeError(
                        f"a step needs more distinct automaton states than the mask table holds ({self.max_rows})"
                    )
                del self._where[self._key_of[victim]]  # type: ignore[arg-type]
                self._free.append(victim)
                self.evicted += 1
        row = self._free.pop()
        if key:
            bits = self._text_row(key).copy()
            if self.dfa.accepts(key) and len(self.walk.eos):
                eos = np.zeros(32 * self.walk.words, dtype=bool)
                eos[self.walk.eos] = True
                bits |= _pack_row(eos)
        else:  # the dead state: nothing
            bits = np.zeros(self.walk.words, dtype=np.int32)
        self._rows[row] = torch.from_numpy(bits)
        self._counts[row] = int(np.bitwise_count(bits.view(np.uint32)).sum())
        self._where[key] = row
        self._key_of[row] = key
        self._used[row] = self._tick
        self.filled += 1
        for stale in self._stale.values():
            if stale is not None:
                stale.add(row)


    def _text_row(self, key: bytes) -> np.ndarray:
        """The packed row of the text tokens (EOS aside) that may come next in the live state
        ``key`` (under the locks). A token's bytes lead a set of NFA positions somewhere live
        exactly when they lead one of its positions somewhere live (moves and epsilon closures
        are unions over positions, and a state keeps live positions only), so a state of
        :data:`SPLIT_MAX` positions or fewer gets the union of the rows of its positions' own
        states (``closure({p})``, each a subset of it): states that differ only in which
        positions they combine (``(a|b)*a(a|b){15}`` has 65,536 of them over 34 positions)
        share their work. Larger states, one-position states and states equal to a position's
        own are walked (:meth:`TokenWalk.allowed`). So is a state whose union needs more new
        walks than the unions saved so far plus :data:`SPLIT_CREDIT`: where states rarely share
        positions, the unions cost at most that many walks more than walking every state."""
        got = self._text.get(key)
        if got is not None:
            self._text.move_to_end(key)
            return got
        dfa = self.dfa
        positions = dfa.positions(key)
        signature = self.futures.signature(positions.tolist()) if len(positions) <= SIGNATURE_MAX else None
        bits = None if signature is None else self.futures.find(signature)
        if bits is not None:
            self.shared += 1
        elif 1 < len(positions) <= SPLIT_MAX:
            subs = [dfa.position_key(p) for p in positions.tolist()]
            extra = sum(sub not in self._text for sub in subs) - 1  # walks past the one a walk of key costs
            if key not in subs and extra <= self._credit:
                self._credit -= extra  # a state whose positions' rows are all known earns one
                bits = np.zeros(self.walk.words, dtype=np.int32)
                for sub in subs:
                    bits |= self._text_row(sub)
        if bits is None:
            bits = _pack_row(self.walk.allowed(dfa, dfa.slot(key), eos=False))
            self.walked += 1
        if signature is not None:
            self.futures.file(signature, bits)
        self._text[key] = bits
        while len(self._text) > self._text_max:
            self._text.popitem(last=False)
        return bits


class BoundAutomaton(BoundConstraint):
    """A byte automaton bound to a vocabulary (see the module docstring); a state is a DFA state
    key (``bytes``, ``b""`` dead). One per SMC run (its :attr:`seconds` are the run's: masks,
    advances, and the states and rows they made); the mask table is shared."""

    def __init__(self, masks: TokenMasks, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], what: str) -> None:
        self.masks_table = masks
        self.dfa = masks.dfa
        self.width = masks.walk.width
        self._vocab = byte_vocab
        self._eos = frozenset(int(e) for e in eos_ids)
        self.what = what
        self.seconds = 0.0
        self.last_counts: np.ndarray | None = None

    def initial(self) -> bytes:
        return self.dfa.start

    def bitmasks(self, states: Sequence[bytes]) -> torch.Tensor:
        return self.bitmasks_upto(states, self.width)

    def bitmasks_upto(self, states: Sequence[bytes], width: int) -> torch.Tensor:
        return self.bitmasks_on(states, width, None)

    def bitmasks_on(self, states: Sequence[bytes], width: int, device: Any) -> torch.Tensor:
        """Gathered on ``device`` from the table's copy there (see :meth:`BoundConstraint.bitmasks_on`)."""
        t0 = time.perf_counter()
        words = max(1, (int(width) + 31) // 32)
        bits, self.last_counts = self.masks_table.gather(states, words, device)
        self.seconds += time.perf_counter() - t0
        return bits

    def advance(self, state: bytes, token: int) -> bytes:
        return self.advance_many((state,), (token,))[0]

    def advance_many(self, states: Sequence[bytes], tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Each state after its token: every walk at once where it can be
        (:meth:`.LazyDFA.walk_tokens`), the rest (moves not made yet, EOS, a token not allowed)
        one by one."""
        t0 = time.perf_counter()
        dfa = self.dfa
        with dfa.lock:
            dfa.trim()
            out, rest = dfa.walk_tokens(states, tokens, self.masks_table.walk.token_bytes)
            for k in rest:
                out[k] = self._advance_one(states[k], int(tokens[k]))
        self.seconds += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def _advance_one(self, state: bytes, t: int) -> bytes:
        """One particle's move (under the DFA's lock): EOS ends an accepted text (the dead state
        follows), any other token walks its bytes; a token not allowed raises ``ValueError``."""
        dfa = self.dfa
        if t in self._eos and state and dfa.accepts(state):
            return b""  # the text ended: nothing may follow
        data = self._vocab[t] if 0 <= t < min(len(self._vocab), self.width) and t not in self._eos else b""
        nxt = dfa.step(state, data) if data and state else b""
        if not nxt:
            raise ValueError(f"{self.what}: token {t} is not allowed here (the mask allowed it?)")
        return nxt

    def copy(self, state: bytes) -> bytes:
        return state


def bind_automaton(make: Callable[[], LazyDFA], key: Any, byte_vocab: Sequence[bytes], eos_ids: Sequence[int],
                   width: int, cache: dict[Any, Any] | None, what: str) -> BoundAutomaton:
    """The automaton ``make()`` builds, bound to a vocabulary: its mask table (and the DFA under
    it) is kept in ``cache`` under ``key`` (the :data:`TABLES` bound last per cache), the
    vocabulary's :class:`TokenWalk` once per EOS ids and width. Raises
    :class:`~.constraint_base.ConstraintError` where no token can start a text."""
    if not eos_ids:
        raise ConstraintError("the model has no EOS token id: give eos_token_ids= to smc()")
    eos = tuple(int(e) for e in eos_ids)
    cache = {} if cache is None else cache
    tables = cache.setdefault("dfa-masks", OrderedDict())  # key -> TokenMasks, least recently bound first
    full = (key, eos, width)
    t0 = time.perf_counter()
    with _tables_lock:
        masks = tables.get(full)
        if masks is None:
            walk = cache.get(("token-walk", eos, width))
            if walk is None:
                walk = cache[("token-walk", eos, width)] = TokenWalk(byte_vocab, eos, width)
            masks = tables[full] = TokenMasks(make(), walk)
            while len(tables) > TABLES:
                tables.popitem(last=False)
        tables.move_to_end(full)
    bound = BoundAutomaton(masks, byte_vocab, eos, what)
    if not bool(bound.bitmasks([bound.initial()]).any()):
        raise ConstraintError(f"{what}: no token of this vocabulary can start a match (empty language)")
    #: Seconds the bind took (the NFA's reading, the start state, the first mask row).
    bound.bind_seconds = time.perf_counter() - t0
    bound.seconds = 0.0
    return bound


#: Mask tables (one per pattern or automaton) a model keeps; the least recently bound go first.
TABLES = 8
_tables_lock = threading.Lock()


class ByteAutomaton(Constraint):
    """Texts whose bytes ``automaton`` accepts, then EOS: a byte-level automaton as a token
    automaton (see the module docstring). ``automaton``: a complete :class:`~.lazydfa.ByteDFA`,
    or a :class:`~.bytenfa.ByteNFA` (determinised on demand). ``name`` names it in messages."""

    def __init__(self, automaton: ByteDFA | ByteNFA, name: str = "ByteAutomaton") -> None:
        if not isinstance(automaton, ByteDFA | ByteNFA):
            raise TypeError(f"ByteAutomaton needs a ByteDFA or a ByteNFA, got {type(automaton).__name__}")
        self.automaton = automaton
        self.name = name
        self._key: str | None = None
        self._nfa: ByteNFA | None = None

    def key(self) -> str:
        """A digest of the automaton (equal automata, equal keys: their mask tables are shared)."""
        if self._key is None:
            h = hashlib.blake2b(digest_size=16)
            a = self.automaton
            if isinstance(a, ByteDFA):
                h.update(np.ascontiguousarray(a.table).tobytes())
                h.update(np.ascontiguousarray(a.accept).tobytes())
                h.update(f"{a.start} {a.dead0}".encode())
            else:
                h.update(a.digest())
            self._key = h.hexdigest()
        return self._key

    def dfa(self) -> LazyDFA:
        """A fresh :class:`~.lazydfa.LazyDFA` of the automaton (nothing made past its start)."""
        return LazyDFA(self.nfa(), self.describe())

    def nfa(self) -> ByteNFA:
        """The automaton as a :class:`~.bytenfa.ByteNFA`."""
        if self._nfa is None:
            a = self.automaton
            self._nfa = a.to_nfa() if isinstance(a, ByteDFA) else a
        return self._nfa

    def bind(self, byte_vocab: Sequence[bytes], eos_ids: Sequence[int], width: int,
             cache: dict[Any, Any] | None = None) -> BoundConstraint:
        what = self.describe()
        return bind_automaton(self.dfa, ("automaton", self.key()), byte_vocab, eos_ids, width, cache, what)

    def describe(self) -> str:
        return self.name
