"""Context-free grammar constraints: a bounded-depth pushdown automaton on the device (ALGORITHMS.md §6).

    g = compile_grammar(open("expr.lark").read(), tokenizer)       # Lark subset; GBNF ("::=") too
    g = compile_schema_grammar(schema, tokenizer)                   # JSON schemas with $ref cycles
    g.backend                                                       # "device" or "llguidance" (+ g.reason)
    out = decode(config, params, prompts, lengths, ..., constraint=g.constraint())
    both = stack_grammars([g1, g2]); c = both.constraint(starts=[0, 1, 1])   # a grammar per row

Host (compile once). lark reads the grammar (GrammarBuilder: rules as EBNF trees, terminals, %ignore;
GBNF goes through llguidance's gbnf_to_lark first). Rules that are not on a recursion cycle are inlined;
a feedback set of the rule graph (plus `start`) stays as "called" rules. Each called rule becomes one
DFA over bytes and calls (Thompson NFA, subset construction; each terminal's regex is a byte DFA from
outlines-core, see _byte_dfa; no regex engine here). %ignore'd terminals may appear between any two
items of a rule (not before the first or after the last byte: llguidance's reading of %ignore).

Byte level (deterministic, LL(1) over bytes). In DFA state q with next byte b exactly one of:
    consume   a byte edge q -b-> q', or a chain of call edges whose callee can start with b: each call
              pushes its return state (not when the return state is a pure exit: a tail call), then b
    pop       q is accepting and b does not continue it: return to the state on the stack top, retry b
    forbid    otherwise
is right. compile checks it (FIRST / FOLLOW sets per called rule); a grammar where it does not hold
(left recursion, a called rule matching the empty string, a byte that could both continue and end a
rule) goes to the llguidance fallback. The result is a table over (state, byte): kind, next state,
pushed states, and the depth it needs (so no row ever reaches a state it cannot finish within
`max_depth` stack entries).

Device. A row's state is (q, stack int32[max_depth], depth). A token is its byte string, run byte by
byte through the table (`_simulate`: vectorised gathers over the [V, L] byte table; each token keeps a
small buffer of the entries it pushed above the row's stack; pops below it read the row's stack).
Most of that does not depend on the stack, so compile precomputes it (token_codes, like xgrammar's
context-independent tokens): per state and token class, "fails on its own", "stays above the stack it
found and needs k entries" (allowed iff depth + k <= max_depth), or "pops into the stack". A popping
token (one of the state's `pops` list: the tokens whose first unconsumable byte can follow the rule)
that pops once depends only on the return state it pops into, the row's stack top: its outcome is
precomputed per (state, return state) pair too (PopPairs). `allowed` is then one [R, V] gather, one
[R, M] gather of the popping tokens' outcomes for the row's stack top, and a run from the row's
configuration of only the tokens that pop twice or more (two closing brackets in one token).
EOS pops the stack: allowed where q and every stacked return state accept.
The device tables are padded to power-of-two sizes (GrammarConstraint's shapes), so grammars of
similar size share one compiled decode.
Nesting deeper than `max_depth` is forbidden (masked), so texts nesting deeper are cut off; a state
is only entered when its rule can still finish within the bound (no dead ends).

Fallback. When the device form cannot hold the grammar (not LL(1) over bytes, larger than the table
bound, needing more than max_depth to accept anything) the constraint is llguidance's matcher on the
host: `allowed` is a jax.pure_callback of the row's token history (a pure function, so beams and
rollback need nothing special); `backend` says which one is used and `reason` why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.constraints.automaton import _bucket, special_token_ids, token_bytes
from jaxdecode.constraints.trie import Candidates, ConstraintError
from jaxdecode.kernels.common import next_pow2
from jaxdecode.kernels.constrained import constrained_topk

log = logging.getLogger("jaxdecode.constraints.grammar")
_NEG = float("-inf")
_CALL = 256  # symbol ids: bytes 0..255, then a call of called rule k is 256 + k
MAX_STATES = 20000  # device table bound (states x 256 entries)


class GrammarError(ConstraintError):
    """A grammar that cannot be read or accepts nothing, with what to change."""


class _NotDevice(Exception):
    """The device form cannot hold this grammar (the message says why); llguidance can."""


# ----------------------------------------------------------------------------- reading the grammar
def to_lark(text: str, syntax: str = "auto") -> str:
    """The grammar as Lark text: `syntax` "lark", "gbnf" or "auto" (GBNF when it defines rules with ::=)."""
    if syntax not in ("auto", "lark", "gbnf"):
        raise GrammarError(f"syntax must be 'auto', 'lark' or 'gbnf', got {syntax!r}")
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar is empty; pass the grammar's text (a 'start' rule, Lark or GBNF syntax)")
    if _is_gbnf(text, syntax):
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - its parse errors are plain exceptions with a position
            raise GrammarError(f"cannot read the GBNF grammar: {e}") from None
        text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("%llguidance"))
        text = _LLG_REPEAT.sub(_lark_repeat, text)
    return text


# llguidance's Lark writes counted repetition as x{m,n}; lark's is x ~ m..n. String and regex literals are
# matched first so braces inside them stay as they are.
_LLG_REPEAT = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imsxlu]*|\{(\d+)(,(\d*))?\}')


def _lark_repeat(m):
    if m.group(1) is None:
        return m.group(0)
    lo, comma, hi = m.group(1), m.group(2), m.group(3)
    if not comma:
        return f" ~ {lo}"
    if hi:
        return f" ~ {lo}..{hi}"
    if lo in ("0", "1"):  # {0,} / {1,}
        return "*" if lo == "0" else "+"
    raise GrammarError(f"the repetition {{{lo},}} has no upper bound; write it as {{{lo}}} followed by *")


def _is_gbnf(text: str, syntax: str) -> bool:
    return syntax == "gbnf" or (syntax == "auto" and bool(re.search(r"^\s*[A-Za-z0-9_-]+\s*::=", text, re.MULTILINE)))


@dataclasses.dataclass
class _Grammar:
    rules: dict  # name -> EBNF tree
    terms: dict  # name -> EBNF tree
    ignore: list  # terminal names


def _read(text: str) -> _Grammar:
    from lark.exceptions import LarkError
    from lark.load_grammar import GrammarBuilder

    try:
        builder = GrammarBuilder()
        builder.load_grammar(text, "<grammar>")
        g = builder.build()
    except LarkError as e:
        raise GrammarError(f"cannot read the grammar: {e}".rstrip()) from None
    rules = {}
    for name, params, tree, _opts in g.rule_defs:
        if params:
            raise GrammarError(f"rule {name!s} is a template ({', '.join(map(str, params))}); templates are not "
                               "supported: write the rule out for each use")
        rules[str(name)] = _drop_aliases(tree)
    if "start" not in rules:
        raise GrammarError("the grammar has no 'start' rule (GBNF: 'root'); the text must match start")
    terms = {str(name): tree for name, (tree, _prio) in g.term_defs}
    return _Grammar(rules, terms, [str(i) for i in g.ignore])


def _drop_aliases(tree):
    """The rule tree without its aliases (`x -> name`): an alias only names the parse-tree node, it does not
    change the language, so for a constraint it is dropped (its name is not a rule reference)."""
    from lark import Tree

    if not isinstance(tree, Tree):
        return tree
    if tree.data == "alias":
        return _drop_aliases(tree.children[0])
    tree.children = [_drop_aliases(c) for c in tree.children]
    return tree


def _literal_regex(tok) -> str:
    from lark.exceptions import LarkError
    from lark.load_grammar import _literal_to_pattern

    if str(tok) in ('""', '""i'):  # the empty string (GBNF's `ws ::= | " "`): lark's own reader refuses it
        return ""
    try:
        return _literal_to_pattern(tok).to_regexp()
    except LarkError as e:
        raise GrammarError(f"bad literal {tok!s}: {e}") from None


# lark's common.ESCAPED_STRING is a lazy match with a lookbehind (no DFA): the same language, regular
_EQUIVALENT = {'(?:"(?:(?:.*?)(?<!\\\\)(\\\\\\\\)*?)")': r'"(?:[^"\\\n]|\\[^\n])*"'}


class _TermRegex:
    """Terminal trees -> one regex string each (terminals are regular: lark forbids recursion in them)."""

    def __init__(self, terms):
        self.terms, self.memo = terms, {}

    def term(self, name):
        if name not in self.memo:
            if name not in self.terms:
                raise GrammarError(f"terminal {name} is used but not defined")
            self.memo[name] = None
            rx = self.tree(self.terms[name])
            self.memo[name] = _EQUIVALENT.get(rx, rx)
        if self.memo[name] is None:
            raise GrammarError(f"terminal {name} refers to itself; terminals must be regular (use a rule)")
        return self.memo[name]

    def tree(self, t) -> str:
        from lark import Token
        from lark.grammar import NonTerminal, Terminal

        if isinstance(t, Terminal):
            return f"(?:{self.term(t.name)})"
        if isinstance(t, NonTerminal):
            raise GrammarError(f"terminal refers to rule {t.name}; terminals may only use terminals")
        if isinstance(t, Token):
            return _literal_regex(t)
        d, ch = t.data, t.children
        if d == "expansions":
            return "(?:" + "|".join(self.tree(c) for c in ch) + ")"
        if d == "expansion":
            return "".join(self.tree(c) for c in ch)
        if d in ("value", "literal", "alias"):
            return self.tree(ch[0])
        if d == "maybe":
            return f"(?:{self.tree(ch[0])})?"
        if d == "range":
            a, b = (_literal_regex(c) for c in ch)
            return f"[{a}-{b}]"
        if d == "expr":
            inner, op = self.tree(ch[0]), str(ch[1])
            if op == "~":
                lo, hi = int(ch[2]), int(ch[3]) if len(ch) > 3 else int(ch[2])
                return f"(?:{inner}){{{lo},{hi}}}"
            return f"(?:{inner}){op}"
        raise GrammarError(f"unsupported construct {d!r} in a terminal")


# ----------------------------------------------------------------------------- NFA -> DFA per called rule
_BYTE_VOCAB = None


_END = "\U0010FFFF".encode()  # a noncharacter: the end marker appended to every terminal regex


def _byte_dfa(regex: str, memo={}):  # noqa: B006 - a process-wide cache of byte DFAs
    """outlines-core's DFA of `regex` over single bytes: (initial, finals, {state: {byte: next}}).

    outlines-core 0.2.14's Index drops the transitions that leave an accepting state towards a
    non-accepting one (`a(bc)?` loses the b after a). So the regex is compiled with an end marker
    appended (no state but the last one accepts), a state accepts where the marker's bytes lead to
    acceptance, and states from which no accepting state is reachable are trimmed."""
    global _BYTE_VOCAB
    if regex not in memo:
        import outlines_core

        if _BYTE_VOCAB is None:
            _BYTE_VOCAB = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
        try:
            index = outlines_core.Index(f"(?:{regex})\U0010FFFF", _BYTE_VOCAB)
        except Exception as e:  # noqa: BLE001 - outlines-core raises ValueError / its own errors
            raise _NotDevice(f"outlines-core cannot compile the terminal regex {regex!r}: {e}") from None
        trans = {int(s): {int(b): int(n) for b, n in row.items() if b < 256} for s, row in
                 index.get_transitions().items()}
        ends = {int(f) for f in index.get_final_states()}

        def walk(s):
            for b in _END:
                s = trans.get(s, {}).get(b)
                if s is None:
                    return None
            return s

        finals = {s for s in trans if walk(s) in ends}
        back = {}
        for s, row in trans.items():
            for n in row.values():
                back.setdefault(n, set()).add(s)
        live, todo = set(finals), list(finals)
        while todo:
            for p in back.get(todo.pop(), ()):
                if p not in live:
                    live.add(p)
                    todo.append(p)
        init = int(index.get_initial_state())
        if init not in live:
            raise GrammarError(f"the terminal regex {regex!r} matches nothing")
        trans = {s: {b: n for b, n in row.items() if n in live} for s, row in trans.items() if s in live}
        memo[regex] = (init, finals, trans)
    return memo[regex]


class _NFA:
    def __init__(self, limit):
        self.eps, self.edges, self.limit = [], [], limit  # edges[s]: {symbol: [targets]}

    def new(self):
        if len(self.eps) >= self.limit:
            raise _NotDevice(f"the grammar's automaton has more than {self.limit} states (the device table bound)")
        self.eps.append([])
        self.edges.append({})
        return len(self.eps) - 1

    def edge(self, a, sym, b):
        self.edges[a].setdefault(sym, []).append(b)

    def regex(self, regex):
        init, finals, trans = _byte_dfa(regex)
        ids = {}

        def sid(s):
            if s not in ids:
                ids[s] = self.new()
            return ids[s]

        start, end = sid(init), self.new()
        todo, seen = [init], {init}
        while todo:
            s = todo.pop()
            if s in finals:
                self.eps[sid(s)].append(end)
            for b, n in trans.get(s, {}).items():
                self.edge(sid(s), b, sid(n))
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return start, end

    def to_dfa(self, start, end):
        """Subset construction: (transitions [{symbol: state}], finals set); state 0 is the start."""
        def close(states):
            out, todo = set(states), list(states)
            while todo:
                for n in self.eps[todo.pop()]:
                    if n not in out:
                        out.add(n)
                        todo.append(n)
            return frozenset(out)

        first = close([start])
        num, trans, finals, todo = {first: 0}, [{}], set(), [first]
        while todo:
            cur = todo.pop()
            i = num[cur]
            if end in cur:
                finals.add(i)
            moves = {}
            for s in cur:
                for sym, tgts in self.edges[s].items():
                    moves.setdefault(sym, set()).update(tgts)
            for sym, tgts in moves.items():
                nxt = close(tgts)
                if nxt not in num:
                    if len(num) >= self.limit:
                        raise _NotDevice(f"a rule's DFA has more than {self.limit} states (the device table bound)")
                    num[nxt] = len(trans)
                    trans.append({})
                    todo.append(nxt)
                trans[i][sym] = num[nxt]
        return trans, finals


def _rule_refs(tree) -> set:
    from lark.grammar import NonTerminal

    return {str(c.name) for t in tree.iter_subtrees() if t.data != "alias"  # an alias names, it calls nothing
            for c in t.children if isinstance(c, NonTerminal)}


def _called_rules(rules) -> list:
    """`start` plus a feedback vertex set of the rule graph (greedy: the busiest rule on a remaining
    cycle), so inlining every other rule terminates."""
    for name, tree in rules.items():
        for r in _rule_refs(tree):
            if r not in rules:
                raise GrammarError(f"rule {name} uses rule {r}, which is not defined")
    graph = {n: _rule_refs(t) for n, t in rules.items()}
    kept = ["start"]
    while True:
        cycle = _find_cycle(graph, set(kept))
        if not cycle:
            return kept
        deg = {n: sum(n in graph[m] for m in graph) + len(graph[n]) for n in cycle}
        kept.append(max(cycle, key=lambda n: (deg[n], n)))


def _find_cycle(graph, removed):
    color = {}
    for root in graph:
        if root in removed or root in color:
            continue
        stack, path = [(root, iter(sorted(graph[root] - removed)))], [root]
        color[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = 2
                stack.pop()
                path.pop()
            elif color.get(nxt) == 1:
                return path[path.index(nxt):]
            elif nxt not in color:
                color[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt] - removed))))
                path.append(nxt)
    return None


class _Builder:
    """Rule trees -> NFA fragments (called rules become call edges, the others are inlined)."""

    def __init__(self, g: _Grammar, called, limit):
        self.g, self.called, self.nfa = g, {n: i for i, n in enumerate(called)}, _NFA(limit)
        self.terms = _TermRegex(g.terms)
        ign = [self.terms.term(t) for t in g.ignore]
        self.ignore = "(?:" + "|".join(f"(?:{r})" for r in ign) + ")*" if ign else None

    def seq(self, frags):
        nfa = self.nfa
        if not frags:
            s = nfa.new()
            return s, s
        start, end = frags[0]
        for a, b in frags[1:]:
            nfa.eps[end].append(a)
            end = b
        return start, end

    def sep(self, parts):
        """Items of a rule with the %ignore'd terminals allowed between them."""
        out = []
        for i, p in enumerate(parts):
            if i and self.ignore:
                out.append(self.nfa.regex(self.ignore))
            out.append(p())
        return self.seq(out)

    def alt(self, frags):
        s, e = self.nfa.new(), self.nfa.new()
        for a, b in frags:
            self.nfa.eps[s].append(a)
            self.nfa.eps[b].append(e)
        return s, e

    def star(self, frag, plus=False):
        s, e = self.nfa.new(), self.nfa.new()
        a, b = frag
        self.nfa.eps[s].append(a)
        self.nfa.eps[b] += [e, a]
        if not plus:
            self.nfa.eps[s].append(e)
        return s, e

    def rule_body(self, name):
        return self.tree(self.g.rules[name], (name,))

    def tree(self, t, path):
        from lark import Token
        from lark.grammar import NonTerminal, Terminal

        nfa = self.nfa
        if isinstance(t, Terminal):
            return nfa.regex(self.terms.term(t.name))
        if isinstance(t, Token):
            rx = _literal_regex(t)
            return nfa.regex(rx) if rx else self.seq([])
        if isinstance(t, NonTerminal):
            name = str(t.name)
            if name in self.called:
                s, e = nfa.new(), nfa.new()
                nfa.edge(s, _CALL + self.called[name], e)
                return s, e
            return self.tree(self.g.rules[name], path + (name,))
        d, ch = t.data, t.children
        if d == "expansions":
            return self.alt([self.tree(c, path) for c in ch])
        if d == "expansion":
            return self.sep([lambda c=c: self.tree(c, path) for c in ch])
        if d in ("value", "literal", "alias"):
            return self.tree(ch[0], path)
        if d == "maybe":
            return self.alt([self.tree(ch[0], path), self.seq([])])
        if d == "range":
            return nfa.regex(self.terms.tree(t))
        if d == "expr":
            op = str(ch[1])
            if op == "?":
                return self.alt([self.tree(ch[0], path), self.seq([])])
            if op in ("*", "+"):
                if not self.ignore:
                    return self.star(self.tree(ch[0], path), plus=op == "+")
                # items of a repetition are separated by ignored text too: x (ign x)*
                first = self.tree(ch[0], path)
                more = self.star(self.seq([nfa.regex(self.ignore), self.tree(ch[0], path)]))
                one_or_more = self.seq([first, more])
                return one_or_more if op == "+" else self.alt([one_or_more, self.seq([])])
            if op == "~":
                lo, hi = int(ch[2]), int(ch[3]) if len(ch) > 3 else int(ch[2])
                if hi > 64:
                    raise _NotDevice(f"a repetition ~ {lo}..{hi} in rule {path[0]} is larger than the device form "
                                     "unrolls (64)")
                reps = [lambda: self.tree(ch[0], path)] * lo
                base = self.sep(reps) if lo else self.seq([])
                opt = self.seq([])
                for _ in range(hi - lo):  # nested optionals: (x (x (x)?)?)?
                    tail = self.sep([lambda: self.tree(ch[0], path), lambda o=opt: o])
                    opt = self.alt([tail, self.seq([])])
                return self.sep([lambda: base, lambda: opt]) if lo else opt
        raise GrammarError(f"unsupported construct {d!r} in rule {path[0]}")


# ----------------------------------------------------------------------------- the byte-level PDA
@dataclasses.dataclass(frozen=True, eq=False)
class PushdownTables:
    """Host tables of the byte-level PDA (see the module docstring). Q states, P pushes per byte at most."""
    kind: np.ndarray  # int8[Q, 256]: 0 forbid, 1 consume, 2 pop
    next: np.ndarray  # int32[Q, 256]: state after a consume
    push: np.ndarray  # int32[Q, 256, P]: return states pushed before the consume (bottom first), -1 pad
    npush: np.ndarray  # int32[Q, 256]
    req: np.ndarray  # int32[Q, 256]: stack entries above the current depth this move needs to finish
    final: np.ndarray  # bool[Q]
    need: np.ndarray  # int32[Q]: stack entries above the current depth needed to finish from q
    start: int
    rule_of: np.ndarray  # int32[Q]: which called rule a state belongs to
    rules: tuple  # called rule names
    returns: tuple = ()  # per called rule: the return states that can be on the stack top while it runs
    starts: tuple = ()  # start state of each grammar (several: stack_grammars)

    def __post_init__(self):
        if not self.starts:
            object.__setattr__(self, "starts", (int(self.start),))


def _pda(dfas, names) -> PushdownTables:
    offs = np.cumsum([0] + [len(t) for t, _ in dfas])
    q_total = int(offs[-1])
    if q_total > MAX_STATES:
        raise _NotDevice(f"the grammar needs {q_total} states, more than the device table bound {MAX_STATES}")
    trans = [{} for _ in range(q_total)]
    calls = [{} for _ in range(q_total)]
    final = np.zeros(q_total, bool)
    rule_of = np.zeros(q_total, np.int32)
    for k, (t, fin) in enumerate(dfas):
        for i, row in enumerate(t):
            q = offs[k] + i
            rule_of[q] = k
            final[q] = i in fin
            for sym, n in row.items():
                (trans if sym < _CALL else calls)[q][sym if sym < _CALL else sym - _CALL] = int(offs[k] + n)
    starts = [int(o) for o in offs[:-1]]
    nk = len(dfas)

    # a called rule that matches the empty string makes "call or skip" a guess: not LL(1) over bytes
    nullable = [False] * nk
    changed = True
    while changed:
        changed = False
        for k in range(nk):
            if nullable[k]:
                continue
            seen, todo = {starts[k]}, [starts[k]]
            while todo:
                q = todo.pop()
                if final[q]:
                    nullable[k] = changed = True
                    break
                for c, n in calls[q].items():
                    if nullable[c] and n not in seen:
                        seen.add(n)
                        todo.append(n)
    for k in range(nk):
        if nullable[k]:
            raise _NotDevice(f"rule {names[k]} can match the empty string; the device form needs every recursive "
                             "rule to consume at least one byte (move the optional part to where it is used)")

    first = [set() for _ in range(nk)]
    changed = True
    while changed:
        changed = False
        for k in range(nk):
            new = set(trans[starts[k]]).union(*(first[c] for c in calls[starts[k]]))
            if new != first[k]:
                first[k], changed = new, True

    def first_of(q):
        out = set(trans[q])
        for c in calls[q]:
            out |= first[c]
        return out

    follow = [set() for _ in range(nk)]
    changed = True
    while changed:
        changed = False
        for q in range(q_total):
            for c, n in calls[q].items():
                new = follow[c] | first_of(n) | (follow[rule_of[n]] if final[n] else set())
                if new != follow[c]:
                    follow[c], changed = new, True

    def show(b):
        return repr(bytes([b]))[1:]

    pure_exit = np.array([final[q] and not trans[q] and not calls[q] for q in range(q_total)])
    memo = {}

    def resolve(q, b, busy):
        """(pushes, target) of consuming byte b in state q, or None."""
        key = (q, b)
        if key in memo:
            return memo[key]
        if key in busy:
            raise _NotDevice(f"rule {names[rule_of[q]]} is left-recursive (it can call itself before consuming a "
                             "byte); the device form needs right recursion or repetition (x*)")
        opts = []
        if b in trans[q]:
            opts.append(((), trans[q][b]))
        for c, n in calls[q].items():
            if b in first[c]:
                sub = resolve(starts[c], b, busy | {key})
                if sub is not None:
                    opts.append(((() if pure_exit[n] else (n,)) + sub[0], sub[1]))
        if len(opts) > 1:
            raise _NotDevice(f"in rule {names[rule_of[q]]} the byte {show(b)} can continue more than one way "
                             "(the grammar is not LL(1) over bytes)")
        memo[key] = opts[0] if opts else None
        return memo[key]

    kind = np.zeros((q_total, 256), np.int8)
    nxt = np.full((q_total, 256), -1, np.int32)
    pushes = {}
    for q in range(q_total):
        for b in range(256):
            r = resolve(q, b, frozenset())
            if r is not None:
                if final[q] and b in follow[rule_of[q]]:
                    raise _NotDevice(f"in rule {names[rule_of[q]]} the byte {show(b)} can both continue the rule "
                                     "and follow it (the grammar is not LL(1) over bytes)")
                kind[q, b], nxt[q, b] = 1, r[1]
                if r[0]:
                    pushes[(q, b)] = r[0]
            elif final[q] and b in follow[rule_of[q]]:  # other bytes fail in every return state too
                kind[q, b] = 2
    p = max([len(v) for v in pushes.values()], default=0)
    push = np.full((q_total, 256, max(p, 1)), -1, np.int32)
    npush = np.zeros((q_total, 256), np.int32)
    for (q, b), v in pushes.items():
        push[q, b, :len(v)] = v
        npush[q, b] = len(v)

    # need[q]: the fewest stack entries above q's depth any way to finish q's rule uses
    inf = 1 << 20
    need = np.where(final, 0, inf).astype(np.int64)
    changed = True
    while changed:
        changed = False
        for q in range(q_total):
            best = need[q]
            for n in trans[q].values():
                best = min(best, need[n])
            for c, n in calls[q].items():
                best = min(best, max(need[starts[c]] + (0 if pure_exit[n] else 1), need[n]))
            if best < need[q]:
                need[q], changed = best, True
    # req[q, b]: with the current depth D before the move, the move is allowed iff D + req <= max_depth
    req = np.full((q_total, 256), inf, np.int64)
    cons = kind == 1
    req[cons] = npush[cons] + need[np.maximum(nxt[cons], 0)]
    for (q, b), v in pushes.items():
        req[q, b] = max(req[q, b], max(i + need[r] for i, r in enumerate(v)))
    req[kind == 2] = 0
    # returns[k]: a call of k pushes its return state, a tail call leaves the caller's own on top
    returns = [set() for _ in range(nk)]
    changed = True
    while changed:
        changed = False
        for q in range(q_total):
            for c, n in calls[q].items():
                new = returns[c] | (returns[rule_of[n]] if pure_exit[n] else {n})
                if new != returns[c]:
                    returns[c], changed = new, True
    return PushdownTables(returns=tuple(tuple(sorted(r)) for r in returns),
                          kind=kind, next=nxt, push=push, npush=npush, req=np.minimum(req, inf).astype(np.int32),
                          final=final, need=np.minimum(need, inf).astype(np.int32), start=starts[0],
                          rule_of=rule_of, rules=tuple(names))


def build_tables(lark_text: str) -> PushdownTables:
    """The device tables of a Lark grammar (raises _NotDevice when the device form cannot hold it)."""
    g = _read(lark_text)
    called = _called_rules(g.rules)
    builder = _Builder(g, called, MAX_STATES * 4)
    dfas = []
    for name in called:
        frag = builder.rule_body(name)
        dfas.append(builder.nfa.to_dfa(*frag))
    return _pda(dfas, called)


# ----------------------------------------------------------------------------- host object
@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled for a tokenizer: `backend` "device" (tables) or "llguidance" (host matcher)."""
    lark: str  # the grammar as Lark text
    backend: str
    reason: str  # why llguidance is used ("" on the device)
    vocab_size: int
    eos_ids: tuple
    max_depth: int
    tables: PushdownTables | None
    tok_bytes: np.ndarray | None  # int32[V, L] (padding 0)
    tok_len: np.ndarray | None  # int32[V]: 0 = never allowed (special tokens, ids past the tokenizer)
    token_class: np.ndarray | None = None  # token level (token_codes)
    code: np.ndarray | None = None
    pops: np.ndarray | None = None
    pairs: PopPairs | None = None
    tokenizer: object = None
    parts: tuple = ()  # the grammars stacked here (stack_grammars)

    @property
    def starts(self) -> tuple:
        """The start state of each grammar stacked here (stack_grammars), one for a single grammar."""
        return self.tables.starts if self.tables is not None else (0,)

    def constraint(self, starts=None, *, impl: str = "auto", bucket: bool = True):
        """The device constraint (or llguidance's); `starts`: int[B], which stacked grammar each row
        follows (None: grammar 0 for every row). bucket: device tables padded to power-of-two sizes
        (grammars of similar size share one compiled decode; False: the exact sizes)."""
        if starts is not None:
            st = np.asarray(starts, np.int64).reshape(-1)
            bad = st[(st < 0) | (st >= len(self.starts))]
            if bad.size:
                raise ConstraintError(f"grammar index {int(bad[0])} is outside [0, {len(self.starts)}) (the "
                                      "grammars stacked here)")
            if self.backend != "device" and (st != 0).any():
                raise ConstraintError("per-row grammars need the device backend")
        if self.backend == "device":
            init = np.asarray(self.starts, np.int32)[np.zeros(1, np.int64) if starts is None else st]
            arrays = self._device_arrays(bucket)
            return GrammarConstraint(**{k: jnp.asarray(x) for k, x in arrays.items()}, initial=jnp.asarray(init),
                                     per_row=starts is not None, max_depth=self.max_depth, impl=impl, host=self)
        return LLGuidanceConstraint(grammar=self.lark, tokenizer=self.tokenizer, vocab=self.vocab_size,
                                    grammar_eos=self.eos_ids, impl=impl)

    def _device_arrays(self, bucket: bool) -> dict:
        """GrammarConstraint's table leaves (host int32 / bool arrays). With bucket, each size is rounded up
        to a power of two (at least 8; pushes per byte to a power of two): padded states forbid every byte,
        are not final and nothing leads to them; padded token classes, pops columns and outcome rows reject."""
        t, pp = self.tables, self.pairs
        (q, p), (u, m) = (t.kind.shape[0], t.push.shape[-1]), pp.code.shape
        if bucket:
            q, p, u, m = _bucket(q), next_pow2(p), _bucket(u), _bucket(m)

        def pad(x, shape, value):
            out = np.full(shape, value, np.bool_ if x.dtype == np.bool_ else np.int32)
            out[tuple(slice(0, n) for n in x.shape)] = x
            return out

        def size(x):  # a column count, bucketed
            return _bucket(x.shape[1]) if bucket else x.shape[1]

        return {"kind": pad(t.kind, (q, 256), 0), "next": pad(t.next, (q, 256), -1),
                "push": pad(t.push, (q, 256, p), -1), "npush": pad(t.npush, (q, 256), 0),
                "req": pad(t.req, (q, 256), 0), "final": pad(t.final, (q,), False),
                "tok_bytes": self.tok_bytes, "tok_len": self.tok_len, "token_class": self.token_class,
                "code": pad(self.code, (q, size(self.code)), _REJECT), "pops": pad(self.pops, (q, m), -1),
                "pop_ret": pad(pp.ret, (q, size(pp.ret)), -1), "pop_row": pad(pp.row, (q, size(pp.ret)), 0),
                "pop_code": pad(pp.code, (u, m), _REJECT), "pop_multi": pad(pp.multi, (u, size(pp.multi)), -1)}

    def matcher(self, index: int = 0):
        """A fresh llguidance matcher of this grammar (of stacked grammar `index`): the host reference."""
        if self.parts:
            return self.parts[index].matcher()
        return _llg_matcher(self.lark, self.tokenizer, self.vocab_size, self.eos_ids)


_LLTOK = {}


def _llg_tokenizer(tokenizer, vocab_size, eos_ids):
    import llguidance.hf

    key = (id(tokenizer), vocab_size, tuple(eos_ids))
    if key not in _LLTOK:
        eos = list(eos_ids) if eos_ids else None
        _LLTOK[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos))
    return _LLTOK[key][1]


def _llg_matcher(lark_text, tokenizer, vocab_size, eos_ids):
    import llguidance

    m = llguidance.LLMatcher(_llg_tokenizer(tokenizer, vocab_size, eos_ids),
                             llguidance.LLMatcher.grammar_from_lark(lark_text), log_level=0)
    if m.is_error():
        raise GrammarError(f"llguidance cannot use the grammar: {m.get_error()}")
    return m


def llg_mask(matcher, vocab_size: int) -> np.ndarray:
    """bool[V]: llguidance's allowed tokens (EOS included where it accepts)."""
    bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)


def _token_table(tokenizer, vocab_size, eos_ids):
    tb = token_bytes(tokenizer)
    v = max(len(tb), int(vocab_size or 0))
    specials = special_token_ids(tokenizer)
    lens = np.zeros(v, np.int32)
    for i, b in enumerate(tb):
        if b and i not in specials and i not in eos_ids:
            lens[i] = len(b)
    width = max(int(lens.max()), 1)
    table = np.zeros((v, width), np.int32)
    for i, b in enumerate(tb):
        if lens[i]:
            table[i, :lens[i]] = np.frombuffer(b, np.uint8)
    return table, lens, v


CACHE_VERSION = 2


def _cache_path(lark_text, tokenizer, v, eos_ids) -> Path:
    from jaxdecode.constraints.automaton import tokenizer_fingerprint

    key = hashlib.sha256(json.dumps([CACHE_VERSION, lark_text, tokenizer_fingerprint(tokenizer), v,
                                     sorted(eos_ids)]).encode()).hexdigest()[:40]
    from jaxdecode.files import default_cache_dir
    return default_cache_dir() / "grammars" / f"{key}.npz"


_TABLE_ARRAYS = ("kind", "next", "push", "npush", "req", "final", "need", "rule_of")
_PAIR_ARRAYS = ("ret", "row", "code", "multi")


def _device_form(lark_text, tokenizer, table, lens, eos_ids, cache):
    """(tables, token_class, code, pops, pairs), from the disk cache when there (keyed by grammar, tokenizer bytes,
    vocab size, EOS ids; max_depth is not part of them)."""
    path = _cache_path(lark_text, tokenizer, len(lens), eos_ids) if cache else None
    if path is not None and path.exists():
        try:
            with np.load(path, allow_pickle=True) as z:
                if int(z["version"]) == CACHE_VERSION:
                    meta = z["meta"].item()
                    tables = PushdownTables(**{k: z[k] for k in _TABLE_ARRAYS}, **meta)
                    pairs = PopPairs(**{k: z["pair_" + k] for k in _PAIR_ARRAYS})
                    return tables, z["token_class"], z["code"], z["pops"], pairs
        except Exception:  # noqa: BLE001, S110 - a stale or partial file: compile again
            pass
    tables = build_tables(lark_text)
    token_class, code, pops, pairs = token_codes(tables, table, lens)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            meta = {"start": tables.start, "rules": tables.rules, "returns": tables.returns, "starts": tables.starts}
            np.savez_compressed(tmp, **{k: getattr(tables, k) for k in _TABLE_ARRAYS}, token_class=token_class,
                                code=code, pops=pops, **{"pair_" + k: getattr(pairs, k) for k in _PAIR_ARRAYS},
                                meta=np.array(meta, dtype=object),
                                version=np.int32(CACHE_VERSION))
            os.replace(tmp, path)
        except OSError:  # a read-only home: compile again next time
            pass
    return tables, token_class, code, pops, pairs


def compile_grammar(text: str, tokenizer, *, vocab_size: int | None = None, eos_ids=None, max_depth: int = 16,
                    syntax: str = "auto", fallback: str = "llguidance", cache: bool = True) -> CompiledGrammar:
    """Compile a grammar (Lark subset or GBNF) for `tokenizer`.

    max_depth: stack entries per row on the device (nesting beyond it is masked). fallback:
    "llguidance" (host matcher when the device form cannot hold the grammar) or "error". cache: keep
    device forms on disk (<jaxdecode.files.default_cache_dir()>/grammars)."""
    if fallback not in ("llguidance", "error"):
        raise GrammarError(f"fallback must be 'llguidance' or 'error', got {fallback!r}")
    if not isinstance(max_depth, int) or max_depth < 1:
        raise GrammarError(f"max_depth must be an int >= 1, got {max_depth!r}")
    lark_text = to_lark(text, syntax)
    if eos_ids is None:
        eos_ids = () if getattr(tokenizer, "eos_token_id", None) is None else (int(tokenizer.eos_token_id),)
    eos_ids = tuple(int(e) for e in eos_ids)
    table, lens, v = _token_table(tokenizer, vocab_size, eos_ids)
    try:
        if _is_gbnf(text, syntax):  # what llguidance's converter writes and lark cannot read: llguidance
            try:
                _read(lark_text)
            except GrammarError as e:
                raise _NotDevice(f"the GBNF grammar's Lark form is not readable by lark ({e})") from None
        tables, token_class, code, pops, pairs = _device_form(lark_text, tokenizer, table, lens, eos_ids, cache)
        if tables.need[tables.start] >= 1 << 20:
            raise GrammarError("the grammar accepts no text (every derivation of start is infinite)")
        if tables.need[tables.start] > max_depth:
            raise _NotDevice(f"every text of the grammar nests at least {int(tables.need[tables.start])} rule calls "
                             f"deep, more than max_depth={max_depth}")
        backend, reason = "device", ""
    except _NotDevice as e:
        if fallback == "error":
            raise GrammarError(f"the device form cannot hold this grammar: {e}") from None
        if not _is_gbnf(text, syntax):
            _read(lark_text)  # syntax errors are errors on either backend
        tables, backend, reason = None, "llguidance", str(e)
        token_class = code = pops = pairs = None
        _llg_matcher(lark_text, tokenizer, v, eos_ids)  # llguidance's own checks, now
    log.info("grammar constraint: backend=%s%s", backend, f" ({reason})" if reason else "")
    return CompiledGrammar(lark=lark_text, backend=backend, reason=reason, vocab_size=v, eos_ids=eos_ids,
                           max_depth=max_depth, tables=tables, tok_bytes=table if backend == "device" else None,
                           tok_len=lens if backend == "device" else None, token_class=token_class, code=code,
                           pops=pops, pairs=pairs, tokenizer=tokenizer)


def stack_grammars(grammars) -> CompiledGrammar:
    """One device grammar holding several (same tokenizer, EOS ids): their automata side by side, each
    with its start state, so one batch can give each row its own grammar (`constraint(starts=...)`)."""
    grammars = list(grammars)
    if not grammars:
        raise GrammarError("stack_grammars needs at least one grammar")
    g0 = grammars[0]
    for g in grammars:
        if g.backend != "device":
            raise GrammarError(f"only device grammars can be stacked; one uses llguidance ({g.reason})")
        if g.vocab_size != g0.vocab_size or g.eos_ids != g0.eos_ids or g.tokenizer is not g0.tokenizer:
            raise GrammarError("stacked grammars must be compiled for the same tokenizer, vocab_size and eos_ids")
    ts = [g.tables for g in grammars]
    offs = np.cumsum([0] + [t.kind.shape[0] for t in ts])
    roffs = np.cumsum([0] + [len(t.rules) for t in ts])
    p = max(t.push.shape[-1] for t in ts)

    def shift(x, o):
        return np.where(x >= 0, x + o, x).astype(np.int32)

    push = np.concatenate([np.pad(shift(t.push, o), ((0, 0), (0, 0), (0, p - t.push.shape[-1])), constant_values=-1)
                           for t, o in zip(ts, offs)])
    tables = PushdownTables(
        kind=np.concatenate([t.kind for t in ts]), next=np.concatenate([shift(t.next, o) for t, o in zip(ts, offs)]),
        push=push, npush=np.concatenate([t.npush for t in ts]), req=np.concatenate([t.req for t in ts]),
        final=np.concatenate([t.final for t in ts]), need=np.concatenate([t.need for t in ts]),
        start=int(ts[0].start), rule_of=np.concatenate([t.rule_of + r for t, r in zip(ts, roffs)]).astype(np.int32),
        rules=tuple(f"{i}:{n}" for i, t in enumerate(ts) for n in t.rules),
        returns=tuple(tuple(int(x) + int(o) for x in rr) for t, o in zip(ts, offs) for rr in t.returns),
        starts=tuple(int(t.start) + int(o) for t, o in zip(ts, offs)))
    token_class, code, pops, pairs = token_codes(tables, g0.tok_bytes, g0.tok_len)
    return dataclasses.replace(g0, lark="\n\n".join(g.lark for g in grammars), tables=tables,
                               max_depth=max(g.max_depth for g in grammars), token_class=token_class, code=code,
                               pops=pops, pairs=pairs, parts=tuple(grammars))


# ----------------------------------------------------------------------------- device constraint
@dataclasses.dataclass(frozen=True)
class GrammarState:
    q: jax.Array  # int32[R]: PDA state; -1 = finished (emitted EOS) or dead
    stack: jax.Array  # int32[R, max_depth]: return states, bottom first
    depth: jax.Array  # int32[R]

    @property
    def node(self):
        """The state as a tuple of int32[R] leaves (beam search gathers nodes leaf by leaf)."""
        return (self.q, self.depth) + tuple(self.stack[:, i] for i in range(self.stack.shape[1]))

    @classmethod
    def from_node(cls, node):
        return cls(q=node[0], depth=node[1], stack=jnp.stack(node[2:], axis=-1))

    def replace(self, node=None, **kw):
        return GrammarState.from_node(node) if node is not None else dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(GrammarState, data_fields=["q", "stack", "depth"], meta_fields=[])


def _simulate(c, q0, stack, depth, tokens, *, max_depth: int, local: int):
    """Run tokens' bytes from each row's configuration. `c`: the byte tables (kind, next, push, npush,
    req, tok_bytes, tok_len); q0/depth int32[R], stack int32[R, D], tokens int32[R, W]. Returns ok
    bool[R, W], q int32[R, W], base int32[R, W] (row-stack entries kept), loc int32[R, W, local] / nloc
    int32[R, W] (entries pushed above them), peak int32[R, W] (the most stack entries any move needed)."""
    r, w = tokens.shape
    d = max_depth
    v = c.tok_len.shape[0]
    tok = jnp.clip(tokens, 0, v - 1)
    width = c.tok_bytes.shape[1]
    flat = c.tok_bytes.reshape(-1)  # byte j of token t at t * L + j: one [R, W] gather per byte
    ln = jnp.where((tokens >= 0) & (tokens < v), jnp.take(c.tok_len, tok), 0)  # [R, W]
    init = {"q": jnp.broadcast_to(q0[:, None], (r, w)), "base": jnp.broadcast_to(depth[:, None], (r, w)),
                "loc": jnp.zeros((r, w, local), jnp.int32), "nloc": jnp.zeros((r, w), jnp.int32),
                "pos": jnp.zeros((r, w), jnp.int32), "ok": (ln > 0) & (q0 >= 0)[:, None],
                "peak": jnp.zeros((r, w), jnp.int32)}
    kk = jnp.arange(local, dtype=jnp.int32)

    def running(s):
        return s["ok"] & (s["pos"] < ln)

    def body(s):
        act = running(s)
        b = jnp.take(flat, tok * width + jnp.minimum(s["pos"], width - 1))  # [R, W]
        qc = jnp.maximum(s["q"], 0)
        kind, nq, need = c.kind[qc, b], c.next[qc, b], c.req[qc, b]
        dep = s["base"] + s["nloc"]
        consume = act & (kind == 1) & (dep + need <= d)
        pop = act & (kind == 2) & (dep > 0)
        # consume: write the pushed return states above the token's own entries
        loc, nloc = s["loc"], s["nloc"]
        npush = jnp.where(consume, c.npush[qc, b], 0)
        pushed = c.push[qc, b]  # [R, W, P]
        for j in range(c.push.shape[-1]):
            put = (kk == (nloc + j)[..., None]) & (j < npush)[..., None]
            loc = jnp.where(put, pushed[..., j:j + 1], loc)
        # pop: from the token's own entries first, then from the row's stack
        from_loc = pop & (nloc > 0)
        top_loc = jnp.take_along_axis(loc, jnp.maximum(nloc - 1, 0)[..., None], axis=-1)[..., 0]
        top_row = jnp.take_along_axis(stack, jnp.clip(s["base"] - 1, 0, stack.shape[1] - 1), axis=1)  # [R, W]
        q = jnp.where(consume, nq, jnp.where(from_loc, top_loc, jnp.where(pop, top_row, s["q"])))
        return {"q": q, "base": s["base"] - (pop & ~from_loc), "loc": loc,
                    "nloc": nloc + npush - from_loc, "pos": s["pos"] + consume,
                    "ok": s["ok"] & (~act | consume | pop),
                    "peak": jnp.where(consume, jnp.maximum(s["peak"], dep + need), s["peak"])}

    out = jax.lax.while_loop(lambda s: jnp.any(running(s)), body, init)
    return out["ok"], out["q"], out["base"], out["loc"], out["nloc"], out["peak"]


_REJECT, _POPS = -1, -2
_NOLIMIT = 1 << 20


@jax.jit
def _codes_chunk(c, qs, rs, toks, unknown_top):
    """Tokens toks int32[N, W] (-1: none) from states qs int32[N] with the stack [unknown, rs[i]] below (rs:
    a return state the row's stack top may hold, or the unknown again; the unknown is a state, the last
    row of kind, whose every byte is forbidden). Returns code int32[N, W]: the stack entries above the
    row's depth the token needs when it never pops below the stack it found, _POPS when it pops into it
    and may fit (it fits after popping into rs[i], or pops deeper into the unknown, or unknown_top: every
    token that pops), else _REJECT; and exact int32[N, W], the outcome when rs[i] is the row's stack top:
    the stack entries above the row's depth the token needs (it pops at most once, into rs[i], and
    fits iff depth + exact <= max_depth), _REJECT, or _POPS (it pops twice or more: run it per step)."""
    n = qs.shape[0]
    stack = jnp.stack([jnp.full((n,), c.kind.shape[0] - 1, jnp.int32), rs], axis=1)
    ok, _, base, _, _, peak = _simulate(c, qs, stack, jnp.full((n,), 2, jnp.int32), toks, max_depth=_NOLIMIT,
                                        local=c.tok_bytes.shape[1] * c.push.shape[-1])
    local = base >= 2
    maybe = ok | (base < 1) | unknown_top
    code = jnp.where(local, jnp.where(ok, peak - 2, _REJECT), jnp.where(maybe, _POPS, _REJECT))
    # after one pop the moves run one entry lower: peak - 2 may be -1, the same test as 0 (depth <= max_depth)
    exact = jnp.where(base < 1, _POPS, jnp.where(ok, jnp.maximum(peak - 2, 0), _REJECT))
    return code, exact


def _run_pairs(c, pairs, toks_of, chunk, unknown_top):
    """_codes_chunk over (state, return state) pairs in fixed-size chunks (one compilation per width):
    (code, exact), each [pairs, W]."""
    out = []
    for i in range(0, len(pairs), chunk):
        part = pairs[i:i + chunk]
        part = part + [part[-1]] * (chunk - len(part))
        qs = np.asarray([p[0] for p in part], np.int32)
        got = _codes_chunk(c, jnp.asarray(qs), jnp.asarray([p[1] for p in part], jnp.int32),
                           jnp.asarray(toks_of(qs)), jnp.asarray(unknown_top))
        out.append([np.asarray(x)[: min(chunk, len(pairs) - i)] for x in got])
    return tuple(np.concatenate(x) for x in zip(*out))


def _lists(mask, width=None):
    """int32[Q, M]: the ids where mask[q] (bool[Q, V]), -1 pad (M: the longest list, or width)."""
    out = np.full((mask.shape[0], max(width or int(mask.sum(axis=1).max()), 1)), -1, np.int32)
    for s in range(mask.shape[0]):
        ids = np.flatnonzero(mask[s])
        out[s, :ids.size] = ids
    return out


@dataclasses.dataclass(frozen=True)
class _ByteTables:
    kind: object
    next: object
    push: object
    npush: object
    req: object
    tok_bytes: object
    tok_len: object


jax.tree_util.register_dataclass(_ByteTables, data_fields=["kind", "next", "push", "npush", "req", "tok_bytes",
                                                           "tok_len"], meta_fields=[])


def token_codes(t: PushdownTables, tok_bytes, tok_len, chunk: int | None = None):
    """Precomputed token level (host arrays): token_class int32[V], code int32[Q, C] (_REJECT, _POPS, or
    the stack entries above the row's depth the token needs: allowed iff depth + code <= max_depth), and
    pops int32[Q, M]: each state's _POPS tokens (-1 pad), and PopPairs: their outcome per stack top."""
    # all-forbidden rows appended (the first is the unknown stack entry), up to a power of two so grammars
    # of similar size share the compiled simulation
    extra = next_pow2(t.kind.shape[0] + 1) - t.kind.shape[0]

    def pad(x, value):
        return jnp.asarray(np.concatenate([x, np.full((extra,) + x.shape[1:], value, x.dtype)]), jnp.int32)

    c = _ByteTables(kind=pad(t.kind, 0), next=pad(t.next, -1), push=pad(t.push, -1), npush=pad(t.npush, 0),
                    req=pad(t.req, 0), tok_bytes=jnp.asarray(tok_bytes), tok_len=jnp.asarray(tok_len))
    v = len(tok_len)
    if chunk is None:  # (state, return state) pairs per call: about 2^24 entries of the token buffers
        chunk = max(1, min(64, (1 << 24) // (v * tok_bytes.shape[1] * t.push.shape[-1])))
    q = t.kind.shape[0]
    dead = q  # the appended all-forbidden row: the unknown part of the stack
    # pass 1, from every state over an unknown stack, the tokens whose first byte the state does not forbid
    # (the rest are rejected whatever the stack): the final code of the tokens that stay above the stack.
    # Two groups (two compilations): states with few such tokens run only those, the others all tokens.
    codes = np.full((q, v), _REJECT, np.int32)
    viable = (t.kind[:, tok_bytes[:, 0]] != 0) & (tok_len > 0)[None, :]  # [Q, V]
    counts = viable.sum(axis=1)
    narrow = counts <= v // 8
    if narrow.any():
        states = np.flatnonzero(narrow)
        lists = _lists(viable[states], width=next_pow2(max(int(counts[states].max()), 1)))
        part = _run_pairs(c, [(int(s), dead) for s in states], lambda qs: lists[np.searchsorted(states, qs)],
                          chunk, True)[0]
        rows = np.repeat(states, lists.shape[1]).reshape(lists.shape)
        codes[rows[lists >= 0], lists[lists >= 0]] = part[lists >= 0]
    if (~narrow).any():
        everything = np.broadcast_to(np.arange(v, dtype=np.int32), (chunk, v))
        states = np.flatnonzero(~narrow)
        codes[states] = _run_pairs(c, [(int(s), dead) for s in states], lambda qs: everything, chunk, True)[0]
    # pass 2, the tokens that pop: into each return state the state's rule can find on the stack top;
    # a token no return state takes is rejected (xgrammar-style context-independent rejection)
    maybe = _lists(codes == _POPS, width=next_pow2(int((codes == _POPS).sum(axis=1).max())))  # [Q, M1]
    pairs = [(s, r) for s in range(q) for r in (t.returns[t.rule_of[s]] or (dead,))]
    refined, exact = _run_pairs(c, pairs, lambda qs: maybe[qs], chunk, False)  # [pairs, M1] each
    keep = np.zeros(maybe.shape, bool)
    for (s, _), row in zip(pairs, refined):
        keep[s] |= row == _POPS
    rows = np.repeat(np.arange(q), maybe.shape[1]).reshape(maybe.shape)
    gone = (maybe >= 0) & ~keep
    codes[rows[gone], maybe[gone]] = _REJECT
    cols, token_class = np.unique(codes, axis=1, return_inverse=True)
    pops = _lists(codes == _POPS)
    return (token_class.reshape(-1).astype(np.int32), cols.astype(np.int32), pops,
            _pop_pairs(t, pairs, maybe, keep, exact, pops))


@dataclasses.dataclass(frozen=True, eq=False)
class PopPairs:
    """The outcome of each state's popping tokens per return state on the row's stack top (host arrays), so
    only the tokens that pop twice or more are simulated per step. U: distinct outcome rows."""
    ret: np.ndarray  # int32[Q, Rw]: the return states q's rule can find on the stack top (-1 pad)
    row: np.ndarray  # int32[Q, Rw]: the outcome row of (q, ret[q, i])
    code: np.ndarray  # int32[U, M]: per pops[q] column: entries needed (allowed iff depth + code <=
    #                   max_depth), _REJECT, or _POPS (pops twice or more: simulated)
    multi: np.ndarray  # int32[U, M2]: the _POPS tokens of the row (-1 pad)


def _pop_pairs(t: PushdownTables, pairs, maybe, keep, exact, pops) -> PopPairs:
    """PopPairs from pass 2 of token_codes: `exact` [pairs, M1] over the columns of maybe [Q, M1], of which
    pops[q] keeps those `keep` marks (same order)."""
    q, m = pops.shape
    first = {}
    for i, (s, _) in enumerate(pairs):
        first.setdefault(s, i)
    states = np.flatnonzero((pops >= 0).any(axis=1))
    widths = [len(t.returns[t.rule_of[s]]) for s in states]
    ret = np.full((q, max(widths, default=1)), -1, np.int32)
    row = np.zeros(ret.shape, np.int32)
    code, multi = [np.full(m, _REJECT, np.int32)], [np.zeros(0, np.int32)]  # row 0: rejects all (no pairs)
    for s in states:
        sel = (maybe[s] >= 0) & keep[s]
        toks, rets = maybe[s][sel], t.returns[t.rule_of[s]]
        assert np.array_equal(toks, pops[s][pops[s] >= 0]), s  # pops lists the kept columns in order
        ret[s, :len(rets)] = rets
        for i in range(len(rets)):
            ex = exact[first[s] + i][sel]
            row[s, i] = len(code)
            code.append(np.concatenate([ex, np.full(m - ex.size, _REJECT, np.int32)]))
            multi.append(toks[ex == _POPS])
    ml = np.full((len(multi), max(max(map(len, multi)), 1)), -1, np.int32)
    for i, x in enumerate(multi):
        ml[i, :x.size] = x
    # pairs with the same outcome share a row (many states' popping tokens ignore the return state)
    rows, inv = np.unique(np.concatenate([np.stack(code), ml], axis=1), axis=0, return_inverse=True)
    return PopPairs(ret=ret, row=inv.reshape(-1).astype(np.int32)[row], code=rows[:, :m].astype(np.int32),
                    multi=rows[:, m:].astype(np.int32))


@dataclasses.dataclass(frozen=True)
class GrammarConstraint:
    """The Constraint protocol over a byte-level pushdown automaton (module docstring). A pytree."""
    kind: jax.Array  # int32[Q, 256]
    next: jax.Array  # int32[Q, 256]
    push: jax.Array  # int32[Q, 256, P]
    npush: jax.Array  # int32[Q, 256]
    req: jax.Array  # int32[Q, 256]
    final: jax.Array  # bool[Q]
    tok_bytes: jax.Array  # int32[V, L]
    tok_len: jax.Array  # int32[V]
    token_class: jax.Array  # int32[V]: tokens with the same code in every state share a class
    code: jax.Array  # int32[Q, C]: see token_codes
    pops: jax.Array  # int32[Q, M]: tokens that pop into the row's stack from q (-1 pad)
    pop_ret: jax.Array  # int32[Q, Rw]: PopPairs.ret
    pop_row: jax.Array  # int32[Q, Rw]: PopPairs.row
    pop_code: jax.Array  # int32[U, M]: PopPairs.code
    pop_multi: jax.Array  # int32[U, M2]: PopPairs.multi
    initial: jax.Array  # int32[B] (per_row) or int32[1]: each row's start state
    per_row: bool = False
    max_depth: int = 16
    eos_ids: tuple = ()
    impl: str = "auto"
    host: CompiledGrammar | None = None  # not part of the pytree
    backend = "device"

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @property
    def vocab_size(self) -> int:
        return int(self.tok_len.shape[0])

    @property
    def local_size(self) -> int:  # entries one token can push above the row's stack
        return max(1, min(self.max_depth, self.tok_bytes.shape[1] * self.push.shape[-1]))

    def prepare(self, vocab_size: int, eos_ids: tuple = (), max_new_tokens: int | None = None,
                batch: int | None = None):
        eos_ids = tuple(int(e) for e in eos_ids)
        if self.vocab_size > vocab_size:
            raise ConstraintError(f"the grammar covers {self.vocab_size} token ids but the model's vocabulary has "
                                  f"{vocab_size}; compile it with this model's tokenizer (vocab_size={vocab_size})")
        if not eos_ids:
            raise ConstraintError("a grammar constraint needs eos_ids: the text ends where the grammar accepts and "
                                  "the model emits EOS")
        if self.per_row and batch is not None and self.initial.shape[0] != batch:
            raise ConstraintError(f"the constraint has start states for {self.initial.shape[0]} rows but the batch "
                                  f"has {batch}; pass one grammar index per prompt")
        if self.host is not None:
            for e in eos_ids:
                if e < self.vocab_size and int(self.host.tok_len[e]) > 0:
                    raise ConstraintError(f"EOS id {e} is also a text token; compile the grammar with eos_ids "
                                          f"including {e}")
        return self.replace(eos_ids=eos_ids)

    def init(self, batch: int, beams: int = 1) -> GrammarState:
        r = batch * beams
        init = self.initial if self.per_row else jnp.broadcast_to(self.initial, (batch,))
        return GrammarState(q=jnp.repeat(init.astype(jnp.int32), beams), stack=jnp.zeros((r, self.max_depth), jnp.int32),
                            depth=jnp.zeros((r,), jnp.int32))

    def accepting(self, state: GrammarState):
        """bool[R]: the text may end here: q accepts and so does every return state on the stack (EOS pops
        them all: the stack empties in an accepting state)."""
        live = jnp.arange(self.max_depth)[None, :] < state.depth[:, None]
        rets = jnp.all(~live | jnp.take(self.final, state.stack), axis=1)
        return (state.q >= 0) & jnp.take(self.final, jnp.maximum(state.q, 0)) & rets

    def allowed(self, state: GrammarState, width: int | None = None):
        """bool[R, width]: tokens whose bytes every row can take (EOS ids where it accepts)."""
        width = self.vocab_size if width is None else int(width)
        r = state.q.shape[0]
        qc = jnp.maximum(state.q, 0)
        # context-free part: a token that stays above the row's stack needs `code` entries above its depth
        code = jnp.take(jnp.take(self.code, qc, axis=0), self.token_class, axis=1)  # [R, V]
        mask = (code >= 0) & (state.depth[:, None] + code <= self.max_depth) & (state.q >= 0)[:, None]
        # the tokens that pop into the row's stack: looked up for the (state, stack top) pair when they pop
        # once, run from the row's configuration when they pop twice or more
        top = jnp.take_along_axis(state.stack, jnp.maximum(state.depth - 1, 0)[:, None], axis=1)  # [R, 1]
        hit = jnp.take(self.pop_ret, qc, axis=0) == top  # [R, Rw]
        pair = jnp.take_along_axis(jnp.take(self.pop_row, qc, axis=0), jnp.argmax(hit, axis=1)[:, None], axis=1)[:, 0]
        has = hit.any(axis=1) & (state.depth > 0) & (state.q >= 0)  # a pop needs an entry to pop into
        pl = jnp.take(self.pops, qc, axis=0)  # [R, M]
        once = jnp.take(self.pop_code, pair, axis=0)  # [R, M]
        ok = has[:, None] & (once >= 0) & (state.depth[:, None] + once <= self.max_depth)
        ml = jnp.where(has[:, None], jnp.take(self.pop_multi, pair, axis=0), -1)  # [R, M2]
        ok_ml = _simulate(self, state.q, state.stack, state.depth, ml, max_depth=self.max_depth,
                          local=self.local_size)[0]
        rows = jnp.arange(r)[:, None]
        mask = mask.at[rows, jnp.where(pl >= 0, pl, self.vocab_size)].set(ok, mode="drop")
        mask = mask.at[rows, jnp.where(ml >= 0, ml, self.vocab_size)].set(ok_ml, mode="drop")  # after: overrides
        if width > self.vocab_size:
            mask = jnp.pad(mask, ((0, 0), (0, width - self.vocab_size)))
        mask = mask[:, :width]
        acc = self.accepting(state)
        for e in self.eos_ids:
            if e < width:
                mask = mask.at[:, e].set(acc)
        return mask

    def _after(self, state: GrammarState, tokens):
        """(q, depth, stack) after each of tokens int32[R, W]: int32[R, W], int32[R, W], int32[R, W, D]
        (a token that does not fit: q = -1)."""
        ok, q, base, loc, nloc, _ = _simulate(self, state.q, state.stack, state.depth, tokens.astype(jnp.int32),
                                              max_depth=self.max_depth, local=self.local_size)
        dd = jnp.arange(self.max_depth, dtype=jnp.int32)
        idx = jnp.clip(dd - base[..., None], 0, loc.shape[-1] - 1)  # [R, W, D]
        mine = (dd >= base[..., None]) & (dd < (base + nloc)[..., None])
        stack = jnp.where(mine, jnp.take_along_axis(loc, idx, axis=-1), state.stack[:, None, :])
        return jnp.where(ok, q, -1), jnp.where(ok, base + nloc, 0), stack

    def advance(self, state: GrammarState, tokens) -> GrammarState:
        q, depth, stack = self._after(state, tokens[:, None])
        return GrammarState(q=q[:, 0], depth=depth[:, 0], stack=stack[:, 0])

    def complete(self, state: GrammarState):
        return jnp.zeros(state.q.shape, bool)  # a grammar row ends by emitting EOS (prepare requires eos_ids)

    def candidates(self, state: GrammarState, logits, num_beams: int, scores=None, *, min_depth: int = 0,
                   max_depth: int | None = None) -> Candidates:
        """Each row's best allowed tokens (the mask form of the constrained top-k kernel), with the state
        after each as node leaves (q, depth, stack[0], ..., stack[D-1])."""
        return _candidates(self, state, logits, num_beams)

    def after_nodes(self, state: GrammarState, tokens):
        q, depth, stack = self._after(state, tokens)
        return (q, depth) + tuple(stack[..., i] for i in range(self.max_depth))

    def step_to(self, state: GrammarState, next_nodes) -> GrammarState:
        return GrammarState.from_node(next_nodes)


def _candidates(c, state, logits, num_beams):
    """Each row's best num_beams + len(eos_ids) allowed tokens; next: the state after each, as node leaves."""
    k = min(num_beams + len(c.eos_ids), logits.shape[-1])
    mask = c.allowed(state, logits.shape[-1])
    values, tokens = constrained_topk(logits, k, mask=mask, impl=c.impl)
    ok = tokens >= 0
    ends = jnp.zeros(tokens.shape, bool)
    for e in c.eos_ids:
        ends = ends | (tokens == e)
    nxt = c.after_nodes(state, jnp.where(ok & ~ends, tokens, -1))
    return Candidates(logprobs=jnp.where(ok, values, _NEG), tokens=jnp.where(ok, tokens, -1), ends=ends & ok,
                      next=nxt)


def _flatten(c: GrammarConstraint):
    return ((c.kind, c.next, c.push, c.npush, c.req, c.final, c.tok_bytes, c.tok_len, c.token_class, c.code, c.pops,
             c.pop_ret, c.pop_row, c.pop_code, c.pop_multi, c.initial), (c.per_row, c.max_depth, c.eos_ids, c.impl))


jax.tree_util.register_pytree_node(GrammarConstraint, _flatten, lambda aux, leaves: GrammarConstraint(*leaves, *aux))


# ----------------------------------------------------------------------------- llguidance fallback
@dataclasses.dataclass(frozen=True)
class HistoryState:
    tokens: jax.Array  # int32[R, T]: the row's tokens so far
    n: jax.Array  # int32[R]; -1 = finished (emitted EOS)

    @property
    def node(self):
        return (self.n,) + tuple(self.tokens[:, i] for i in range(self.tokens.shape[1]))

    @classmethod
    def from_node(cls, node):
        return cls(n=node[0], tokens=jnp.stack(node[1:], axis=-1))

    def replace(self, node=None, **kw):
        return HistoryState.from_node(node) if node is not None else dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(HistoryState, data_fields=["tokens", "n"], meta_fields=[])


class _HostMasks:
    """llguidance masks as a pure function of a token history (matchers cached by prefix)."""

    def __init__(self, grammar, tokenizer, vocab, eos_ids):
        self.args = (grammar, tokenizer, vocab, eos_ids)
        self.cache = {}

    def matcher(self, prefix: tuple):
        if prefix in self.cache:
            return self.cache[prefix]
        if not prefix:
            m = _llg_matcher(*self.args)
        else:
            parent = self.matcher(prefix[:-1])
            m = None if parent is None else parent.deep_copy()
            if m is not None and not m.consume_token(prefix[-1]):
                m = None
        if len(self.cache) > 50000:
            self.cache.clear()
        self.cache[prefix] = m
        return m

    def __call__(self, tokens, n):
        tokens, n = np.asarray(tokens), np.asarray(n)
        v = self.args[2]
        out = np.zeros((tokens.shape[0], v), bool)
        for i in range(tokens.shape[0]):
            if n[i] < 0:
                continue
            m = self.matcher(tuple(int(t) for t in tokens[i, :n[i]]))
            if m is not None and not m.is_error():
                out[i] = llg_mask(m, v)
        return out


_HOST = {}


@dataclasses.dataclass(frozen=True)
class LLGuidanceConstraint:
    """The Constraint protocol with llguidance's masks computed on the host each step."""
    grammar: str
    tokenizer: object
    vocab: int
    grammar_eos: tuple = ()
    eos_ids: tuple = ()
    max_new_tokens: int = 0
    impl: str = "auto"
    backend = "llguidance"

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def _host(self):
        key = (self.grammar, id(self.tokenizer), self.vocab, self.grammar_eos)
        if key not in _HOST:
            _HOST[key] = _HostMasks(self.grammar, self.tokenizer, self.vocab, self.grammar_eos)
        return _HOST[key]

    def prepare(self, vocab_size: int, eos_ids: tuple = (), max_new_tokens: int | None = None,
                batch: int | None = None):
        eos_ids = tuple(int(e) for e in eos_ids)
        if self.vocab > vocab_size:
            raise ConstraintError(f"the grammar covers {self.vocab} token ids but the model's vocabulary has "
                                  f"{vocab_size}; compile it with this model's tokenizer (vocab_size={vocab_size})")
        if not eos_ids or set(eos_ids) - set(self.grammar_eos):
            raise ConstraintError(f"the llguidance grammar constraint ends texts with EOS ids {self.grammar_eos}; "
                                  f"the decoder's eos_ids are {eos_ids}: compile the grammar with eos_ids={eos_ids}")
        if not max_new_tokens:
            raise ConstraintError("the llguidance grammar constraint needs max_new_tokens (its token history size)")
        return self.replace(eos_ids=eos_ids, max_new_tokens=int(max_new_tokens))

    def init(self, batch: int, beams: int = 1) -> HistoryState:
        r = batch * beams
        return HistoryState(tokens=jnp.zeros((r, max(self.max_new_tokens, 1)), jnp.int32), n=jnp.zeros((r,), jnp.int32))

    def allowed(self, state: HistoryState, width: int | None = None):
        width = self.vocab if width is None else int(width)
        host = self._host()
        mask = jax.pure_callback(host, jax.ShapeDtypeStruct((state.n.shape[0], self.vocab), jnp.bool_),
                                 state.tokens, state.n)
        if width > self.vocab:
            mask = jnp.pad(mask, ((0, 0), (0, width - self.vocab)))
        return mask[:, :width]

    def advance(self, state: HistoryState, tokens) -> HistoryState:
        tokens = tokens.astype(jnp.int32)
        t = state.tokens.shape[1]
        live = (state.n >= 0) & (state.n < t)
        put = (jnp.arange(t)[None, :] == state.n[:, None]) & live[:, None]
        toks = jnp.where(put, tokens[:, None], state.tokens)
        end = jnp.zeros(tokens.shape, bool)
        for e in self.eos_ids:
            end = end | (tokens == e)
        return HistoryState(tokens=toks, n=jnp.where(live & ~end, state.n + 1, -1))

    def complete(self, state: HistoryState):
        return jnp.zeros(state.n.shape, bool)

    def candidates(self, state, logits, num_beams: int, scores=None, *, min_depth: int = 0,
                   max_depth: int | None = None) -> Candidates:
        return _candidates(self, state, logits, num_beams)

    def after_nodes(self, state: HistoryState, tokens):
        w = tokens.shape[1]
        flat = jax.tree.map(lambda x: jnp.repeat(x, w, axis=0), state)
        moved = self.advance(flat, tokens.reshape(-1))
        return jax.tree.map(lambda x: x.reshape((tokens.shape[0], w) + x.shape[1:]), moved).node

    def step_to(self, state, next_nodes):
        return HistoryState.from_node(next_nodes)


jax.tree_util.register_pytree_node(
    LLGuidanceConstraint, lambda c: ((), (c.grammar, c.tokenizer, c.vocab, c.grammar_eos, c.eos_ids,
                                          c.max_new_tokens, c.impl)),
    lambda aux, _: LLGuidanceConstraint(*aux))
