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
* :func:`condition_constraint`: one condition as a :class:`~genlm_vlm.smc.Constraint`; the
  translation is kept on the condition object, and each translated grammar is compiled once per
  grammar compiler (one per model vocabulary).

Anything that cannot be translated exactly raises :class:`UntranslatableError` naming the part
and why.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from ..smc.constraints import Grammar, JSONSchema

__all__ = ["UntranslatableError", "cfg_ebnf", "condition_constraint", "fsa_ebnf", "is_json_schema"]


class UntranslatableError(ValueError):
    """A genlm-control condition with no exact xgrammar grammar (the message says why)."""


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
        raise UntranslatableError(f"{what}: the language is empty (no string is accepted)")
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
        raise UntranslatableError(f"{what}: the language is empty (no string derives from the start symbol)")
    lines = [f"root ::= {name(trimmed.S)}"]
    for head, alts in bodies.items():
        lines.append(f"{name(head)} ::= {' | '.join(alts)}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ constraints
class TranslatedGrammar(Grammar):
    """A :class:`~genlm_vlm.smc.Grammar` translated from a genlm-control condition, compiled
    once per grammar compiler (that is, once per model vocabulary and EOS ids)."""

    def __init__(self, ebnf: str, source: str) -> None:
        super().__init__(ebnf)
        self.source = source
        self._compiled: dict[int, tuple[Any, Any]] = {}
        self.compilations = 0

    def _compile(self, compiler: Any) -> Any:
        hit = self._compiled.get(id(compiler))
        if hit is not None and hit[0] is compiler:
            return hit[1]
        compiled = compiler.compile_grammar(self.ebnf)
        self.compilations += 1
        self._compiled[id(compiler)] = (compiler, compiled)
        return compiled

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a replica) without the compiled grammars: the receiver compiles its own."""
        state = dict(self.__dict__)
        state["_compiled"] = {}
        return state

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
    differs from genlm-control's: see docs/API.md). The result is kept on ``potential``."""
    kind = type(potential).__name__
    cached = getattr(potential, "__dict__", {}).get(_CACHE)
    if cached is not None and (kind != "Product" or json_schema):
        return cached
    if kind == "BoolFSA":
        out: Any = TranslatedGrammar(fsa_ebnf(potential), "BoolFSA")
    elif kind == "BoolCFG":
        out = TranslatedGrammar(cfg_ebnf(potential), "BoolCFG")
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
            "conditions become token masks (use BoolFSA / BoolCFG)"
        )
    else:
        raise UntranslatableError(
            f"{kind}: not a condition the bridge translates (BoolFSA, BoolCFG, opt-in JsonSchema)"
        )
    try:
        potential.__dict__[_CACHE] = out
    except AttributeError:  # pragma: no cover - a potential without a __dict__
        pass
    return out

