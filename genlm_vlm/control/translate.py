"""genlm-control's Boolean conditions as xgrammar grammars, exactly (see docs/API.md,
"genlm-control in the engine").

* :func:`fsa_ebnf`: a byte-level ``BoolFSA`` (genlm-grammar's automaton after epsilon removal:
  ``start``/``I``, ``arcs(i)``, ``F``) becomes a right-linear EBNF grammar: one rule per state,
  the arcs to each next state merged into one character class, an empty alternative where the
  state is final. xgrammar's character classes hold code points, not bytes, so the byte arcs of a
  multi-byte character are put back together into that character; an automaton that accepts
  bytes that are not UTF-8 (a lone continuation byte, a text ending inside a character) has no
  such grammar and is refused. Every code point is written ``\\uXXXX`` or ``\\UXXXXXXXX``
  (xgrammar's ``\\x`` takes every hex digit that follows: ``"\\x3fA"`` is U+03FA).
* :func:`cfg_ebnf`: a byte-level ``BoolCFG`` (``.cfg``) becomes one EBNF rule per nonterminal,
  for ASCII terminals only (genlm-grammar's byte CFG of a non-ASCII grammar can accept bytes that
  are not UTF-8, which no xgrammar grammar does).
* :func:`condition_constraint`: one condition as a :class:`~genlm_vlm.smc.Constraint`. The
  translation is kept on the condition object and, by content, across condition objects: an
  equal ``BoolFSA``/``BoolCFG`` built again (genlm-control's ``from_regex`` keeps no pattern)
  is recognised by its arcs or rules (:func:`content_key`, far cheaper than translating) and
  gets the EBNF text translated before. Compiled grammars are kept per grammar compiler (one per
  model vocabulary and EOS ids), keyed by that text. Both caches are bounded (least recently
  used dropped first); :func:`cache_counts` counts their hits and misses.

Anything that cannot be translated exactly raises :class:`UntranslatableError` naming the part
and why.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Iterable
from typing import Any

from ..smc.constraints import Grammar, JSONSchema

__all__ = ["EmptyLanguageError", "UntranslatableError", "cache_counts", "cfg_ebnf", "condition_constraint",
           "content_key", "fsa_ebnf", "is_json_schema"]


class UntranslatableError(ValueError):
    """A genlm-control condition with no exact xgrammar grammar, or a sampler the engine cannot
    run exactly (the message says why and what to do instead)."""


class EmptyLanguageError(UntranslatableError):
    """A condition that accepts no text at all: no run, in the engine or genlm-control's, can
    finish under it."""


# ------------------------------------------------------------------------------ EBNF text
def _cp(c: int) -> str:
    return f"\\u{c:04X}" if c <= 0xFFFF else f"\\U{c:08X}"


def char_class(code_points: Iterable[int]) -> str:
    """An EBNF character class holding exactly ``code_points`` (runs written as ranges)."""
    cps = sorted(set(code_points))
    parts = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        parts.append(_cp(cps[i]) if i == j else f"{_cp(cps[i])}-{_cp(cps[j])}")
        i = j + 1
    return "[" + "".join(parts) + "]"


def _utf8_length(lead: int) -> int:
    """Bytes in a UTF-8 character that starts with ``lead`` (0: ``lead`` starts none)."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


# ------------------------------------------------------------------------------ BoolFSA
def _live(fsa: Any) -> Any:
    """The epsilon-free automaton of a ``BoolFSA`` (or a genlm-grammar ``WFSA``), trimmed to
    the states that are both reachable and able to reach a final state."""
    wfsa = getattr(fsa, "wfsa", fsa)
    if not hasattr(wfsa, "epsremove"):
        raise UntranslatableError(f"{type(fsa).__name__} has no genlm-grammar automaton (.wfsa.epsremove)")
    return wfsa.epsremove.trim


def _moves(machine: Any, state: Any, finals: set[Any], what: str) -> dict[Any, set[int]]:
    """Next boundary states from ``state`` and the characters (code points) that lead there."""
    zero = machine.R.zero
    out: dict[Any, set[int]] = defaultdict(set)
    for byte, nxt, w in machine.arcs(state):
        if w == zero:
            continue
        if not isinstance(byte, int) or not 0 <= byte <= 255:
            raise UntranslatableError(
                f"{what}: arc label {byte!r} is not a byte (build it with to_bytes=True, the default)"
            )
        n = _utf8_length(byte)
        if n == 0:
            raise UntranslatableError(
                f"{what} accepts bytes that are not UTF-8 (byte 0x{byte:02X} where a character starts); "
                "xgrammar grammars match UTF-8 text only"
            )
        stack = [(nxt, bytes([byte]))]
        while stack:
            q, seen = stack.pop()
            if len(seen) == n:
                try:
                    out[q].add(ord(seen.decode("utf-8")))
                except UnicodeDecodeError:
                    raise UntranslatableError(
                        f"{what} accepts the byte sequence {seen!r}, which is not UTF-8"
                    ) from None
                continue
            if q in finals:
                raise UntranslatableError(f"{what} accepts a text that ends inside a UTF-8 character ({seen!r})")
            for b, q2, w2 in machine.arcs(q):
                if w2 == zero:
                    continue
                if not (isinstance(b, int) and 0x80 <= b <= 0xBF):
                    raise UntranslatableError(
                        f"{what} accepts bytes that are not UTF-8 ({seen!r} followed by {b!r})"
                    )
                stack.append((q2, seen + bytes([b])))
    return out


def fsa_ebnf(fsa: Any, what: str = "BoolFSA") -> str:
    """The exact right-linear EBNF grammar (root rule ``root``) of a byte-level ``BoolFSA``'s
    language (see the module docstring). Raises :class:`UntranslatableError`."""
    machine = _live(fsa)
    zero = machine.R.zero
    finals = {q for q, w in machine.F if w != zero}
    starts = [q for q, w in machine.I if w != zero]
    if not starts:
        raise EmptyLanguageError(f"{what}: the language is empty (no string is accepted): check the condition")
    names: dict[Any, str] = {}
    order: list[Any] = []

    def name(q: Any) -> str:
        if q not in names:
            names[q] = f"s{len(names)}"
            order.append(q)
        return names[q]

    root = " | ".join(name(q) for q in starts)
    lines = [f"root ::= {root}"]
    k = 0
    while k < len(order):  # breadth first over the boundary states reached
        q = order[k]
        k += 1
        alts = [f"{char_class(cps)} {name(nxt)}" for nxt, cps in _moves(machine, q, finals, what).items()]
        if q in finals:
            alts.append('""')
        lines.append(f"{names[q]} ::= {' | '.join(alts)}")
    return "\n".join(lines) + "\n"


def fsa_automaton(fsa: Any, what: str = "BoolFSA") -> Any:
    """A byte-level ``BoolFSA`` as a :class:`~genlm_vlm.smc.automaton.ByteAutomaton`: its
    epsilon-free automaton (``.wfsa.epsremove``) as a byte NFA, determinised on demand as a
    ``Regex`` is (:mod:`genlm_vlm.smc.lazydfa`), the language unchanged (bytes that are not UTF-8
    included, as genlm-control reads them). Raises :class:`UntranslatableError`."""
    from ..smc.automaton import ByteAutomaton
    from ..smc.bytenfa import ByteNFA

    machine = _live(fsa)
    zero = machine.R.zero
    number: dict[Any, int] = {}

    def state(q: Any) -> int:
        if q not in number:
            number[q] = len(number) + 1  # 0: a fresh start with epsilon moves to every start
        return number[q]

    starts = [state(q) for q, w in machine.I if w != zero]
    if not starts:
        raise EmptyLanguageError(f"{what}: the language is empty (no string is accepted): check the condition")
    finals = frozenset(state(q) for q, w in machine.F if w != zero)
    arcs: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    todo = list(number)
    seen = set(todo)
    while todo:
        q = todo.pop()
        for byte, nxt, w in machine.arcs(q):
            if w == zero:
                continue
            if not isinstance(byte, int) or not 0 <= byte <= 255:
                raise UntranslatableError(
                    f"{what}: arc label {byte!r} is not a byte (build it with to_bytes=True, the default)"
                )
            arcs[state(q)].append((byte, byte, state(nxt)))
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    n = len(number) + 1
    nfa = ByteNFA.from_byte_arcs([starts] + [[] for _ in range(n - 1)], [arcs.get(i, []) for i in range(n)], 0,
                                 finals)
    return ByteAutomaton(nfa, f"translated {what}")


# ------------------------------------------------------------------------------ BoolCFG
def cfg_ebnf(cfg: Any, what: str = "BoolCFG") -> str:
    """The EBNF grammar (root rule ``root``) of a byte-level genlm-grammar CFG with ASCII
    terminals (a ``BoolCFG``'s ``.cfg``). Raises :class:`UntranslatableError`."""
    cfg = getattr(cfg, "cfg", cfg)
    trimmed = cfg.trim() if callable(getattr(cfg, "trim", None)) else cfg
    zero = trimmed.R.zero
    terminals = set(trimmed.V)
    bodies: dict[Any, list[str]] = defaultdict(list)
    names: dict[Any, str] = {}

    def name(sym: Any) -> str:
        if sym not in names:
            names[sym] = f"n{len(names)}"
        return names[sym]

    for rule in trimmed:
        if rule.w == zero:
            continue
        parts = []
        for sym in rule.body:
            if sym in terminals:
                if not isinstance(sym, int) or not 0 <= sym <= 0x7F:
                    raise UntranslatableError(
                        f"{what} has the terminal {sym!r}, which is not an ASCII byte: genlm-grammar's byte CFG of a "
                        "non-ASCII grammar can accept bytes that are not UTF-8 (the byte nonterminals of its multi-byte "
                        "terminals share names), which no xgrammar grammar can match; only ASCII grammars are translated"
                    )
                parts.append(char_class([sym]))
            else:
                parts.append(name(sym))
        bodies[rule.head].append(" ".join(parts) if parts else '""')
    if trimmed.S not in bodies:
        raise EmptyLanguageError(
            f"{what}: the language is empty (no string derives from the start symbol): check the grammar"
        )
    lines = [f"root ::= {name(trimmed.S)}"]
    for head, alts in bodies.items():
        lines.append(f"{name(head)} ::= {' | '.join(alts)}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ caches
#: Most translations (EBNF texts by content key) and compiled grammars per compiler kept.
MAX_TRANSLATIONS = 256
MAX_COMPILED = 64

_lock = threading.Lock()
_translations: OrderedDict[Hashable, Any] = OrderedDict()
#: Attribute of a grammar compiler holding its compiled grammars by text.
_KEPT = "_genlm_vlm_compiled"
_counts = dict.fromkeys(("translated", "translation_hits", "compiled", "compile_hits"), 0)


def cache_counts() -> dict[str, int]:
    """Counters since import: FSA/CFG translations done (``translated``) and found by content
    (``translation_hits``); grammars compiled (``compiled``) and found compiled for their
    compiler (``compile_hits``)."""
    with _lock:
        return dict(_counts)


def content_key(potential: Any) -> Hashable | None:
    """What a ``BoolFSA``'s (or ``BoolCFG``'s) language is made of, as a hashable value: its
    semiring and the states, arcs (rules) and start/final states of non-zero weight, before
    epsilon removal and trimming. Equal keys, equal languages, equal translations. None when
    some part is not hashable (then nothing is cached across objects)."""
    kind = type(potential).__name__
    try:
        if kind == "BoolFSA":
            m = getattr(potential, "wfsa", None)
            if m is None or not hasattr(m, "arcs"):
                return None
            zero = m.R.zero
            key: Hashable = (
                kind, m.R,
                frozenset(q for q, w in m.I if w != zero),
                frozenset(q for q, w in m.F if w != zero),
                frozenset((i, a, j) for i in m.states for a, j, w in m.arcs(i) if w != zero),
            )
        elif kind == "BoolCFG":
            cfg = getattr(potential, "cfg", None)
            if cfg is None:
                return None
            zero = cfg.R.zero
            key = (kind, cfg.R, cfg.S, frozenset((r.head, tuple(r.body)) for r in cfg if r.w != zero))
        else:
            return None
        hash(key)
    except (TypeError, AttributeError):  # an unhashable state or symbol, another layout
        return None
    return key


def _translation(potential: Any, key: Hashable | None, translate: Any) -> Any:
    """The translation of ``potential`` (an EBNF text, or a token automaton): the one kept for
    ``key``, else ``translate(potential)`` (kept for ``key``; an :class:`UntranslatableError` is
    raised each time, never kept)."""
    if key is not None:
        with _lock:
            if key in _translations:  # None is kept too: "no token automaton for this one"
                _translations.move_to_end(key)
                _counts["translation_hits"] += 1
                return _translations[key]
    out = translate(potential)
    with _lock:
        _counts["translated"] += 1
        if key is not None:
            _translations[key] = out
            while len(_translations) > MAX_TRANSLATIONS:
                _translations.popitem(last=False)
    return out


def compiled_grammar(compiler: Any, ebnf: str) -> Any:
    """``compiler.compile_grammar(ebnf)``, kept per compiler by the text, on the compiler
    itself (made once per model vocabulary, it owns its compiled grammars: they go when it
    goes; xgrammar's ``GrammarCompiler`` is not hashable, so no weak dictionary can hold them)."""
    with _lock:
        kept = getattr(compiler, _KEPT, None)
        if kept is None:
            kept = OrderedDict()
            try:
                setattr(compiler, _KEPT, kept)
            except AttributeError:  # a compiler that takes no attributes: nothing kept
                pass
        hit = kept.get(ebnf)
        if hit is not None:
            kept.move_to_end(ebnf)
            _counts["compile_hits"] += 1
            return hit
    out = compiler.compile_grammar(ebnf)  # outside the lock: compiling can take a while
    with _lock:
        _counts["compiled"] += 1
        kept[ebnf] = out
        while len(kept) > MAX_COMPILED:
            kept.popitem(last=False)
    return out


# ------------------------------------------------------------------------------ constraints
class TranslatedGrammar(Grammar):
    """A :class:`~genlm_vlm.smc.Grammar` translated from a genlm-control condition; its
    compiled grammar is kept per grammar compiler by its text (:func:`compiled_grammar`), so
    equal translations of different condition objects compile once per model vocabulary. It
    holds only its text: it pickles (to a replica) as such, and the receiver compiles its own."""

    def __init__(self, ebnf: str, source: str) -> None:
        super().__init__(ebnf)
        self.source = source

    def _compile(self, compiler: Any) -> Any:
        return compiled_grammar(compiler, self.ebnf)

    def describe(self) -> str:
        return f"translated {self.source}"


def is_json_schema(potential: Any) -> bool:
    """Whether ``potential`` is what ``genlm.control.JsonSchema(schema)`` returns (a product of
    its parser and its validator)."""
    p1, p2 = getattr(potential, "p1", None), getattr(potential, "p2", None)
    return type(p1).__name__ == "ParserPotential" and type(p2).__name__ == "FullValidatorJsonSchema"


_CACHE = "_genlm_vlm_translation"


def condition_constraint(potential: Any, *, json_schema: bool = False) -> Any:
    """One byte-level genlm-control condition as a :class:`~genlm_vlm.smc.Constraint`:
    ``BoolFSA`` and ``BoolCFG`` exactly (:class:`TranslatedGrammar`); ``JsonSchema`` only with
    ``json_schema=True``, as :class:`~genlm_vlm.smc.JSONSchema` (xgrammar's JSON language, which
    differs from genlm-control's: see docs/API.md). The result is kept on ``potential``; an equal
    ``BoolFSA``/``BoolCFG`` object reuses the translated text (:func:`content_key`)."""
    kind = type(potential).__name__
    cached = getattr(potential, "__dict__", {}).get(_CACHE)
    if cached is not None and (kind != "Product" or json_schema):
        return cached
    if kind == "BoolFSA":
        key = content_key(potential)
        out: Any = _translation(potential, None if key is None else ("automaton", key), fsa_automaton)
    elif kind == "BoolCFG":
        out = TranslatedGrammar(_translation(potential, content_key(potential), cfg_ebnf), "BoolCFG")
    elif is_json_schema(potential):
        if not json_schema:
            raise UntranslatableError(
                "JsonSchema: xgrammar's JSON language differs from genlm-control's (property order, whitespace, "
                "number forms; see docs/API.md); pass json_schema=True to run it as genlm_vlm.smc.JSONSchema anyway"
            )
        out = JSONSchema(potential.p2.schema)
    elif kind in ("WFSA", "WCFG"):
        raise UntranslatableError(
            f"{kind} is a weighted potential: its weights are not a 0/-inf condition, and only Boolean "
            "conditions become token masks: use BoolFSA / BoolCFG for a condition"
        )
    else:
        raise UntranslatableError(
            f"{kind}: not a condition the bridge translates; it translates BoolFSA, BoolCFG and (with "
            "json_schema=True) JsonSchema"
        )
    try:
        potential.__dict__[_CACHE] = out
    except AttributeError:  # pragma: no cover - a potential without a __dict__
        pass
    return out

