"""`CodeSandbox`: write a Python function, run the visible tests, submit against hidden tests.

Tasks are small programming problems generated from templates with parameters (`_FAMILIES`: sum
of the elements divisible by k, clamp, run-length encoding, FizzBuzz variants, Caesar shifts,
rotations, digit sums in base b, ...; `_OOD_FAMILIES`: problems with two functions or many edge
cases: encode/decode pairs, bracket matching, interval merging, RPN evaluation, matrices). Each
problem has a reference solution (trusted code, run in this process once to compute the expected
outputs), two visible tests and several hidden ones. A problem's splits are fixed by a hash of its
id: `train` and `test` share the base families but never a problem; `ood` uses its own families.

Episode: the policy's files live in memory (`_files`, the state `snapshot` copies); the tools are

  write_file(path, content)   a file of the episode (not the visible tests file: NOT_ALLOWED),
  read_file(path)             a file of the episode (the hidden tests are never among them),
  run_tests()                 the visible tests on the current files, a short report,
  submit()                    the hidden tests on solution.py alone; ends the episode.

Running code: each run materialises the files into a fresh directory under the episode's temporary
directory (`tempfile.mkdtemp`, created on the first run, removed by `close`) and starts
`python -I -c RUNNER` there, with `preexec_fn` setting RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
RLIMIT_NPROC and RLIMIT_CORE=0, entering a new network namespace (`unshare(CLONE_NEWNET)` through
libc) where the OS allows (`network_isolated` says whether it did; probed once per interpreter)
and, when this process is root, dropping to the user `nobody` (root ignores RLIMIT_NPROC, so
without that a fork bomb would not be contained). RLIMIT_NPROC counts all tasks of that user, so
the limit is the user's task count at spawn plus `max_processes` (concurrent sandboxes share it).
`nobody` cannot execute an interpreter under a private folder (here /root/.pyenv), so the default
interpreter is then the first of /usr/bin/python3, ... it can (`_interpreter`). A wall-clock
timeout kills the whole process group (`start_new_session`) and waits for it to be gone. stdout
and stderr go to files, so RLIMIT_FSIZE bounds them too.

On the machine this was written on (root, Linux, Python 3.11), unshare(CLONE_NEWNET) works, so
runs see only a loopback interface; a run takes 50-100 ms (interpreter start-up dominates).

Grading does not trust the program: the runner reads a random nonce and the test inputs from stdin
(before the policy's code is imported), calls the functions and prints one line, the nonce and the
JSON return values; this process compares them with the expected outputs, which never leave it.
Exiting early (`sys.exit`, `os._exit`), printing "OK", editing the visible tests or monkeypatching
the runner yields no result line or wrong values, hence no success. The hidden tests never exist
in the episode directory: submit copies only solution.py into a fresh directory.

Failures: a program that loops forever, exhausts memory or forks without end is the POLICY's
failure (the report says "timed out" etc.; run_tests goes on, submit fails). A sandbox that cannot
start (temporary directory or process creation fails, e.g. a missing `python_executable`) is an
ENVIRONMENT error (`StepResult(env_error=True)`).

Caveats: `preexec_fn` runs between fork and exec of a possibly multi-threaded process; it only calls
setrlimit, unshare and setuid (no imports, no locks taken in Python code). Hash randomisation of
the sandboxed interpreter is on (`-I` ignores PYTHONHASHSEED), so a program that prints the order
of a set of strings may differ between runs; grading compares values, not text. A process that
calls `setsid` leaves the process group and survives the wall-clock kill until its CPU limit.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import pwd
import random
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Callable

from longhorizon.envs.host import (HostEnvironment, Observation, StepResult, invalid_action,
                                   parse_call, tool)
from longhorizon.envs.types import ErrorCode

__all__ = ["CodeSandbox", "problem_suite", "run_reference"]

SOLUTION = "solution.py"
VISIBLE_TESTS = "test_visible.py"
_MAX_FILE_BYTES = 64_000
_MAX_FILES = 16
_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_CLONE_NEWNET = 0x40000000

# ------------------------------------------------------------------------------------- problems
# A family: name -> (parameter grid, builder). A builder returns (description, reference source,
# random-case generator `rng -> [(function, args), ...]`, fixed edge cases).
Case = tuple[str, list]


def _ints(r: random.Random, lo: int = -20, hi: int = 20, n: int = 10) -> list[int]:
  return [r.randint(lo, hi) for _ in range(r.randint(1, n))]


def _word(r: random.Random, alphabet: str = "abc", n: int = 10) -> str:
  return "".join(r.choice(alphabet) for _ in range(r.randint(1, n)))


def _sum_div(k: int):
  return (f"Write `sum_divisible(xs)`: the sum of the elements of the integer list xs that are "
          f"divisible by {k} (0 when there are none).",
          f"def sum_divisible(xs):\n  return sum(x for x in xs if x % {k} == 0)\n",
          lambda r: [("sum_divisible", [_ints(r)])],
          [("sum_divisible", [[]]), ("sum_divisible", [[-k, k, 0, k + 1]])])


def _count_above(t: int):
  return (f"Write `count_above(xs)`: how many elements of the integer list xs are greater than "
          f"{t}.",
          f"def count_above(xs):\n  return sum(1 for x in xs if x > {t})\n",
          lambda r: [("count_above", [_ints(r, -10, 10)])],
          [("count_above", [[]]), ("count_above", [[t, t + 1, t - 1]])])


def _clamp(lo: int, hi: int):
  return (f"Write `clamp_all(xs)`: a new list with every element of xs clamped to [{lo}, {hi}].",
          f"def clamp_all(xs):\n  return [min(max(x, {lo}), {hi}) for x in xs]\n",
          lambda r: [("clamp_all", [_ints(r, lo - 10, hi + 10)])],
          [("clamp_all", [[]]), ("clamp_all", [[lo, hi, lo - 1, hi + 1]])])


_RLE_FORMATS = {
    "char_count": ("each run as the character followed by its length (\"aaab\" -> \"a3b1\")",
                   "out += ch + str(n)"),
    "count_char": ("each run as its length followed by the character (\"aaab\" -> \"3a1b\")",
                   "out += str(n) + ch"),
    "omit_ones": ("each run as the character followed by its length, the length omitted when it "
                  "is 1 (\"aaab\" -> \"a3b\")", "out += ch + (str(n) if n > 1 else '')"),
    "brackets": ("each run as [character length] (\"aaab\" -> \"[a 3][b 1]\")",
                 "out += '[' + ch + ' ' + str(n) + ']'"),
}


def _rle(fmt: str):
  text, emit = _RLE_FORMATS[fmt]
  ref = ("def rle(s):\n  out = ''\n  i = 0\n  while i < len(s):\n    ch, n = s[i], 1\n"
         "    while i + n < len(s) and s[i + n] == ch:\n      n += 1\n"
         f"    {emit}\n    i += n\n  return out\n")
  return (f"Write `rle(s)`: the run-length encoding of the string s, {text}; \"\" -> \"\".", ref,
          lambda r: [("rle", [_word(r, "ab" if r.random() < 0.5 else "xyz", 14)])],
          [("rle", [""]), ("rle", ["a"]), ("rle", ["aaaaaaaaaaaa"])])


def _fizz(a: int, b: int, wa: str, wb: str):
  ref = (f"def fizz(n):\n  out = []\n  for i in range(1, n + 1):\n    s = ''\n"
         f"    if i % {a} == 0:\n      s += '{wa}'\n    if i % {b} == 0:\n      s += '{wb}'\n"
         f"    out.append(s or str(i))\n  return out\n")
  return (f"Write `fizz(n)`: the list of strings for i = 1..n: \"{wa}\" when i is divisible by "
          f"{a}, \"{wb}\" when divisible by {b}, \"{wa}{wb}\" when by both, else str(i).", ref,
          lambda r: [("fizz", [r.randint(1, 30)])], [("fizz", [0]), ("fizz", [a * b])])


def _caesar(k: int):
  ref = ("def shift(s):\n  return ''.join(chr((ord(c) - 97 + %d) %% 26 + 97) if 'a' <= c <= 'z' "
         "else c for c in s)\n" % k)
  return (f"Write `shift(s)`: s with every lowercase letter a-z shifted {k} places forward in "
          f"the alphabet (wrapping z -> a); other characters unchanged.", ref,
          lambda r: [("shift", [_word(r, "abcxyz .Q", 12)])], [("shift", [""]), ("shift", ["z"])])


def _rotate(direction: str, k: int):
  body = f"xs[{k} % len(xs):] + xs[:{k} % len(xs)]" if direction == "left" else \
      f"xs[-({k} % len(xs)):] + xs[:-({k} % len(xs))] if {k} % len(xs) else list(xs)"
  ref = f"def rotate(xs):\n  if not xs:\n    return []\n  return {body}\n"
  return (f"Write `rotate(xs)`: the list xs rotated {direction} by {k} positions (k modulo the "
          f"length; [] -> []).", ref, lambda r: [("rotate", [_ints(r, 0, 9, 8)])],
          [("rotate", [[]]), ("rotate", [[1]]), ("rotate", [list(range(k))])])


def _seq(a: int, b: int, m: int):
  ref = (f"def seq(n):\n  x, y = {a}, {b}\n  for _ in range(n):\n    x, y = y, (x + y) % {m}\n"
         f"  return x\n")
  return (f"Write `seq(n)`: the n-th term (n >= 0) of the sequence s(0) = {a}, s(1) = {b}, "
          f"s(n) = (s(n-1) + s(n-2)) mod {m}.", ref, lambda r: [("seq", [r.randint(0, 40)])],
          [("seq", [0]), ("seq", [1]), ("seq", [2])])


def _digit_sum(base: int):
  ref = (f"def digit_sum(n):\n  total = 0\n  while n:\n    total += n % {base}\n"
         f"    n //= {base}\n  return total\n")
  return (f"Write `digit_sum(n)`: the sum of the digits of the non-negative integer n written in "
          f"base {base}.", ref, lambda r: [("digit_sum", [r.randint(0, 10**6)])],
          [("digit_sum", [0]), ("digit_sum", [base - 1]), ("digit_sum", [base])])


def _count_sub(sub: str):
  ref = (f"def count_sub(s):\n  return sum(1 for i in range(len(s)) if s.startswith({sub!r}, i))\n")
  return (f"Write `count_sub(s)`: how many times \"{sub}\" occurs in the string s, overlapping "
          f"occurrences included.", ref, lambda r: [("count_sub", [_word(r, "abc", 16)])],
          [("count_sub", [""]), ("count_sub", [sub * 3])])


_STRING_OPS = {
    **{f"strip_{c}": (f"s without any \"{c}\" character", f"s.replace({c!r}, '')")
       for c in "aeiou"},
    "upper_first": ("s with characters alternately upper and lower case, starting with upper at "
                    "index 0", "''.join(c.upper() if i % 2 == 0 else c.lower() "
                    "for i, c in enumerate(s))"),
    "lower_first": ("s with characters alternately lower and upper case, starting with lower at "
                    "index 0", "''.join(c.lower() if i % 2 == 0 else c.upper() "
                    "for i, c in enumerate(s))"),
    "reverse_words": ("the words of s (split on single spaces) in reverse order, joined with "
                      "single spaces", "' '.join(s.split(' ')[::-1])"),
    "reverse_each": ("each word of s (split on single spaces) reversed, order kept, joined with "
                     "single spaces", "' '.join(w[::-1] for w in s.split(' '))"),
}


def _string_op(op: str):
  text, expr = _STRING_OPS[op]
  return (f"Write `transform(s)`: {text}.", f"def transform(s):\n  return {expr}\n",
          lambda r: [("transform", [" ".join(_word(r, "aeioubcdXY", 5)
                                             for _ in range(r.randint(1, 4)))])],
          [("transform", [""]), ("transform", ["a"])])


def _prefix(kind: str):
  if kind == "max":
    text, ref = ("the running maximum of xs (element i is max(xs[:i+1]))",
                 "def prefix(xs):\n  out = []\n  for x in xs:\n"
                 "    out.append(x if not out else max(out[-1], x))\n  return out\n")
  else:
    c = int(kind)
    text, ref = (f"the prefix sums of xs times {c} (element i is {c} * sum(xs[:i+1]))",
                 f"def prefix(xs):\n  out, s = [], 0\n  for x in xs:\n    s += x\n"
                 f"    out.append({c} * s)\n  return out\n")
  return (f"Write `prefix(xs)`: {text}; [] -> [].", ref, lambda r: [("prefix", [_ints(r)])],
          [("prefix", [[]]), ("prefix", [[-1, -2]])])


def _keep_first(k: int):
  ref = (f"def keep_first(xs):\n  seen, out = {{}}, []\n  for x in xs:\n"
         f"    seen[x] = seen.get(x, 0) + 1\n    if seen[x] <= {k}:\n      out.append(x)\n"
         f"  return out\n")
  return (f"Write `keep_first(xs)`: xs keeping only the first {k} occurrence(s) of each value, "
          f"order preserved.", ref, lambda r: [("keep_first", [_ints(r, 0, 4, 12)])],
          [("keep_first", [[]]), ("keep_first", [[7] * (k + 2)])])


def _chunk(n: int):
  ref = f"def chunk(xs):\n  return [xs[i:i + {n}] for i in range(0, len(xs), {n})]\n"
  return (f"Write `chunk(xs)`: xs split into consecutive lists of {n} elements (the last may be "
          f"shorter); [] -> [].", ref, lambda r: [("chunk", [_ints(r, 0, 9, 11)])],
          [("chunk", [[]]), ("chunk", [list(range(n))])])


_FAMILIES: dict[str, tuple[list[tuple], Callable]] = {
    "sum_div": ([(k,) for k in range(2, 10)], _sum_div),
    "count_above": ([(t,) for t in range(-2, 8)], _count_above),
    "clamp": ([(0, 5), (0, 10), (-3, 3), (1, 9), (-10, 10), (2, 4), (-5, 0), (10, 20)], _clamp),
    "rle": ([(f,) for f in _RLE_FORMATS], _rle),
    "fizz": ([(3, 5, "Fizz", "Buzz"), (2, 7, "Foo", "Bar"), (3, 4, "Ping", "Pong"),
              (4, 6, "Tic", "Tac"), (5, 7, "Zig", "Zag"), (2, 3, "Hop", "Skip"),
              (3, 7, "Red", "Blue"), (4, 5, "Up", "Down")], _fizz),
    "caesar": ([(k,) for k in range(1, 11)], _caesar),
    "rotate": ([(d, k) for d in ("left", "right") for k in range(1, 6)], _rotate),
    "seq": ([(0, 1, 10), (1, 1, 7), (2, 1, 100), (3, 5, 11), (1, 4, 13), (0, 2, 9), (5, 5, 17),
             (1, 3, 1000)], _seq),
    "digit_sum": ([(b,) for b in range(2, 11)], _digit_sum),
    "count_sub": ([(s,) for s in ("aa", "ab", "aba", "bb", "abc", "ba")], _count_sub),
    "string_op": ([(op,) for op in _STRING_OPS], _string_op),
    "prefix": ([("max",), ("1",), ("2",), ("3",), ("-1",)], _prefix),
    "keep_first": ([(k,) for k in range(1, 5)], _keep_first),
    "chunk": ([(n,) for n in range(2, 6)], _chunk),
}


# ------------------------------------------------------------------------- ood (harder) problems
def _rle_pair(sep: str):
  ref = ("def encode(s):\n  out, i = [], 0\n  while i < len(s):\n    ch, n = s[i], 1\n"
         "    while i + n < len(s) and s[i + n] == ch:\n      n += 1\n"
         f"    out.append(ch + str(n))\n    i += n\n  return {sep!r}.join(out)\n\n"
         f"def decode(t):\n  if not t:\n    return ''\n"
         f"  return ''.join(p[0] * int(p[1:]) for p in t.split({sep!r}))\n")
  words = lambda r: _word(r, "abz", 18)
  return (f"Write two functions. `encode(s)`: the runs of the string s (letters only) as "
          f"character + length, runs joined by \"{sep}\" (\"aaab\" -> \"a3{sep}b1\", "
          f"\"\" -> \"\"). "
          f"`decode(t)`: the inverse, decode(encode(s)) == s.", ref,
          lambda r: [("encode", [words(r)]), ("decode", [_run_ref(ref, "encode", [words(r)])])],
          [("encode", [""]), ("decode", [""]), ("encode", ["a" * 12]),
           ("decode", [f"a1{sep}b12"])])


def _caesar_pair(k: int):
  ref = ("def encrypt(s):\n  return ''.join(chr((ord(c) - 97 + %d) %% 26 + 97) if 'a' <= c <= 'z' "
         "else c for c in s)\n\ndef decrypt(s):\n"
         "  return ''.join(chr((ord(c) - 97 - %d) %% 26 + 97)"
         " if 'a' <= c <= 'z' else c for c in s)\n" % (k, k))
  return (f"Write two functions: `encrypt(s)` shifts every lowercase letter a-z of s {k} places "
          f"forward (wrapping), other characters unchanged; `decrypt(s)` undoes it.", ref,
          lambda r: [("encrypt", [_word(r, "abmnyz !A", 14)]),
                     ("decrypt", [_word(r, "abmnyz !A", 14)])],
          [("encrypt", [""]), ("decrypt", [""]), ("encrypt", ["z"]), ("decrypt", ["a"])])


def _brackets(pairs: str):
  opens, closes = pairs[0::2], pairs[1::2]
  ref = (f"def balanced(s):\n  stack = []\n  for c in s:\n    if c in {opens!r}:\n"
         f"      stack.append({closes!r}[{opens!r}.index(c)])\n    elif c in {closes!r}:\n"
         f"      if not stack or stack.pop() != c:\n        return False\n"
         f"  return not stack\n")
  shown = " ".join(pairs[i:i + 2] for i in range(0, len(pairs), 2))
  return (f"Write `balanced(s)`: True when the brackets {shown} in s are balanced and properly "
          f"nested (other characters ignored), else False.", ref,
          lambda r: [("balanced", [_word(r, pairs + "x", 12)])],
          [("balanced", [""]), ("balanced", [pairs[0]]), ("balanced", [pairs[1]]),
           ("balanced", [pairs[1] + pairs[0]]), ("balanced", [pairs]),
           ("balanced", [pairs[0] * 5 + pairs[1] * 5])])


def _merge(touching: bool):
  cond = "a <= out[-1][1] + 1" if touching else "a <= out[-1][1]"
  ref = ("def merge(intervals):\n  out = []\n  for a, b in sorted(intervals):\n"
         f"    if out and {cond}:\n      out[-1][1] = max(out[-1][1], b)\n"
         "    else:\n      out.append([a, b])\n  return out\n")
  extra = " or adjacent (the next starts right after the previous ends)" if touching else ""
  gen = lambda r: [("merge", [[sorted([r.randint(0, 30), r.randint(0, 30)])
                               for _ in range(r.randint(0, 7))]])]
  return (f"Write `merge(intervals)`: intervals is a list of [a, b] integer pairs (a <= b, closed, "
          f"any order); return the sorted list of [a, b] after merging overlapping ones{extra}.",
          ref, gen, [("merge", [[]]), ("merge", [[[1, 2], [3, 4]]]), ("merge", [[[5, 5]]]),
                     ("merge", [[[1, 10], [2, 3], [4, 12]]])])


def _stats(kind: str):
  if kind == "median_mode":
    ref = ("def median(xs):\n  s = sorted(xs)\n  n = len(s)\n"
           "  return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n\n"
           "def mode(xs):\n  counts = {}\n  for x in xs:\n    counts[x] = counts.get(x, 0) + 1\n"
           "  best = max(counts.values())\n  return min(x for x in counts if counts[x] == best)\n")
    text = ("`median(xs)` (the middle element of the sorted list, or the mean of the two middle "
            "ones for an even length) and `mode(xs)` (the most frequent value, the smallest on a "
            "tie); xs is a non-empty integer list")
    gen = lambda r: [("median", [_ints(r, 0, 9)]), ("mode", [_ints(r, 0, 5)])]
    edges = [("median", [[4]]), ("median", [[1, 2]]), ("mode", [[3, 1, 3, 1]]),
             ("mode", [[-1]])]
  else:
    ref = ("def spread(xs):\n  return max(xs) - min(xs) if xs else 0\n\n"
           "def second_largest(xs):\n  u = sorted(set(xs))\n"
           "  return u[-2] if len(u) > 1 else None\n")
    text = ("`spread(xs)` (max minus min of the integer list, 0 for []) and "
            "`second_largest(xs)` (the second largest distinct value, None when there is none)")
    gen = lambda r: [("spread", [_ints(r)]), ("second_largest", [_ints(r, 0, 6)])]
    edges = [("spread", [[]]), ("spread", [[5]]), ("second_largest", [[]]),
             ("second_largest", [[2, 2]]), ("second_largest", [[3, 3, 1]])]
  return f"Write two functions: {text}.", ref, gen, edges


def _matrix(kind: str):
  grid = lambda r, rows, cols: [[r.randint(0, 9) for _ in range(cols)] for _ in range(rows)]
  if kind == "transpose_spiral":
    ref = ("def transpose(m):\n  return [list(row) for row in zip(*m)]\n\n"
           "def spiral(m):\n  m = [list(row) for row in m]\n  out = []\n  while m:\n"
           "    out += m.pop(0)\n    m = [list(row) for row in zip(*m)][::-1]\n  return out\n")
    text = ("`transpose(m)` (rows become columns; m is a list of equal-length lists, [] -> []) and "
            "`spiral(m)` (the elements in clockwise spiral order from the top-left corner)")
    gen = lambda r: [("transpose", [grid(r, r.randint(1, 4), r.randint(1, 4))]),
                     ("spiral", [grid(r, r.randint(1, 4), r.randint(1, 4))])]
    edges = [("transpose", [[]]), ("spiral", [[]]), ("spiral", [[[1]]]),
             ("spiral", [[[1, 2, 3]]]), ("spiral", [[[1], [2], [3]]])]
  else:
    clockwise = kind == "rotate_cw"
    body = ("[list(row) for row in zip(*m[::-1])]" if clockwise
            else "[list(row) for row in zip(*m)][::-1]")
    ref = (f"def rotate90(m):\n  return {body}\n\n"
           "def flip(m):\n  return [list(row[::-1]) for row in m]\n")
    text = (f"`rotate90(m)` (the matrix m, a list of equal-length lists, rotated 90 degrees "
            f"{'clockwise' if clockwise else 'counter-clockwise'}; [] -> []) and `flip(m)` (each "
            f"row reversed)")
    gen = lambda r: [("rotate90", [grid(r, r.randint(1, 4), r.randint(1, 4))]),
                     ("flip", [grid(r, r.randint(1, 3), r.randint(1, 3))])]
    edges = [("rotate90", [[]]), ("rotate90", [[[1, 2]]]), ("flip", [[]]),
             ("rotate90", [[[1], [2]]])]
  return f"Write two functions: {text}.", ref, gen, edges


def _rpn(ops: str):
  ref = ("def evaluate(tokens):\n  stack = []\n  for t in tokens:\n"
         f"    if t in {list(ops)!r}:\n      b, a = stack.pop(), stack.pop()\n"
         "      if t == '+':\n        stack.append(a + b)\n      elif t == '-':\n"
         "        stack.append(a - b)\n      elif t == '*':\n        stack.append(a * b)\n"
         "      else:\n        q = abs(a) // abs(b)\n"
         "        stack.append(q if (a >= 0) == (b > 0) else -q)\n"
         "    else:\n      stack.append(int(t))\n  return stack[-1]\n")

  def gen(r: random.Random) -> list[Case]:
    tokens = [str(r.randint(1, 9))]
    for _ in range(r.randint(1, 5)):
      tokens.append(str(r.randint(1, 9)))
      tokens.append(r.choice(ops))
    return [("evaluate", [tokens])]

  div = " '/' divides integers truncating toward zero (-7 / 2 = -3)." if "/" in ops else ""
  return (f"Write `evaluate(tokens)`: the value of a reverse-Polish expression given as a list of "
          f"string tokens: integers (possibly negative, like \"-3\") and the operators "
          f"{' '.join(ops)}.{div}", ref, gen,
          [("evaluate", [["5"]]), ("evaluate", [["-3"]]), ("evaluate", [["2", "3", "-"]]),
           ("evaluate", [["-7", "2", ops[-1]]])])


_OOD_FAMILIES: dict[str, tuple[list[tuple], Callable]] = {
    "rle_pair": ([(",",), (";",), ("|",)], _rle_pair),
    "caesar_pair": ([(3,), (7,), (11,), (13,)], _caesar_pair),
    "brackets": ([("()",), ("()[]",), ("()[]{}",), ("<>()",)], _brackets),
    "merge": ([(False,), (True,)], _merge),
    "stats": ([("median_mode",), ("spread_second",)], _stats),
    "matrix": ([("transpose_spiral",), ("rotate_cw",), ("rotate_ccw",)], _matrix),
    "rpn": ([("+-*",), ("+-*/",)], _rpn),
}


@functools.lru_cache(maxsize=512)
def _namespace(reference: str) -> dict:
  namespace: dict = {}
  exec(compile(reference, "<reference>", "exec"), namespace)  # trusted: our own templates
  return namespace


def _run_ref(reference: str, function: str, args: list) -> Any:
  return json.loads(json.dumps(_namespace(reference)[function](*json.loads(json.dumps(args)))))


def run_reference(task: dict, function: str, args: list) -> Any:
  """The reference solution's value on `args`, as JSON values (lists for tuples)."""
  return _run_ref(task["reference"], function, args)


def _problem(family: str, params: tuple, ood: bool) -> dict:
  builder = (_OOD_FAMILIES if ood else _FAMILIES)[family][1]
  description, reference, generate, edges = builder(*params)
  problem_id = f"{family}:" + ",".join(str(p) for p in params)
  rng = random.Random(zlib.crc32(problem_id.encode()))
  visible = [c for _ in range(2) for c in generate(rng)][:2]
  randoms = [c for _ in range(12 if ood else 6) for c in generate(rng)]
  hidden = list(edges) + randoms
  cases = lambda cs: [[fn, args, _run_ref(reference, fn, args)] for fn, args in cs]
  functions = sorted({fn for fn, _ in [*visible, *hidden]})
  return {"id": problem_id, "family": family, "difficulty": 2 if ood else 1,
          "description": description, "functions": functions, "reference": reference,
          "visible": cases(visible), "hidden": cases(hidden)}


@functools.lru_cache(maxsize=4)
def _suite(split: str) -> tuple[str, ...]:
  if split not in ("train", "test", "ood"):
    raise ValueError(f"split must be 'train', 'test' or 'ood', got {split!r}.")
  families = _OOD_FAMILIES if split == "ood" else _FAMILIES
  out = []
  for family, (grid, _) in families.items():
    for params in grid:
      problem = _problem(family, params, split == "ood")
      in_test = zlib.crc32(problem["id"].encode()) % 4 == 0
      if split == "ood" or in_test == (split == "test"):
        out.append(json.dumps({**problem, "split": split}))
  return tuple(out)


def problem_suite(split: str) -> list[dict]:
  """Every generated problem of `split` (train and test partition the base families' problems)."""
  return [json.loads(p) for p in _suite(split)]


# ------------------------------------------------------------------------------------ the runner
# Runs in the sandbox: reads the nonce and the cases before importing the policy's code, then
# prints one line `nonce + JSON` with [["ok", value] | ["error", message], ...] per case.
_RUNNER = r"""
import json, os, sys
_nonce = sys.stdin.readline().strip()
_cases = json.loads(sys.stdin.readline())
sys.stdin.close()
_dumps, _write, _flush = json.dumps, sys.__stdout__.write, sys.__stdout__.flush
sys.path.insert(0, os.getcwd())
_results = []
try:
  import solution as _solution
  _load_error = None
except BaseException as e:
  _load_error = "error importing solution.py: %s: %s" % (type(e).__name__, str(e)[:200])
for _fn, _args in _cases:
  if _load_error is not None:
    _results.append(["error", _load_error])
    continue
  try:
    _value = getattr(_solution, _fn)(*_args)
    _dumps(_value)
    _results.append(["ok", _value])
  except BaseException as e:
    _results.append(["error", "%s: %s" % (type(e).__name__, str(e)[:200])])
try:
  _line = _dumps(_results)
except BaseException as e:
  _line = _dumps([["error", "unserialisable result"]] * len(_cases))
_write("\n" + _nonce + _line + "\n")
_flush()
"""


@functools.lru_cache(maxsize=1)
def _libc_unshare():
  try:
    return ctypes.CDLL(None, use_errno=True).unshare
  except (OSError, AttributeError):
    return None


@functools.lru_cache(maxsize=8)
def _probe_network_isolation(executable: str) -> bool:
  """Whether a child can enter a fresh network namespace (only loopback) on this machine."""
  unshare = _libc_unshare()
  if unshare is None:
    return False

  def enter():
    if unshare(_CLONE_NEWNET) != 0:
      raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")

  try:
    code = "import socket; print(len(socket.if_nameindex()))"
    out = subprocess.run([executable, "-I", "-c", code], preexec_fn=enter, capture_output=True,
                         timeout=20, text=True)
  except (OSError, subprocess.SubprocessError):
    return False
  return out.returncode == 0 and out.stdout.strip() == "1"


def _reachable_by_others(path: str) -> bool:
  """Whether a user other than the owner can execute `path` (every folder above searchable)."""
  path = os.path.realpath(path)
  try:
    if not os.stat(path).st_mode & 0o001:
      return False
    folder = os.path.dirname(path)
    while folder not in ("/", ""):
      if not os.stat(folder).st_mode & 0o001:
        return False
      folder = os.path.dirname(folder)
  except OSError:
    return False
  return True


@functools.lru_cache(maxsize=2)
def _interpreter(other_user: bool) -> str:
  """The default interpreter: this one, unless another user cannot execute it."""
  if not other_user:
    return sys.executable
  for candidate in (sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3",
                    "/bin/python3", "/usr/local/bin/python3"):
    if candidate and _reachable_by_others(candidate):
      return os.path.realpath(candidate)
  raise OSError(f"no Python interpreter the sandbox user can execute ({sys.executable} is not); "
                f"pass python_executable= or sandbox_user=None.")


def _await_group_exit(pgid: int, deadline: float) -> None:
  """Waits (until `deadline`) for the killed group's processes to be gone, so that they no longer
  count against RLIMIT_NPROC of the next run."""
  while time.monotonic() < deadline:
    try:
      os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
      return
    time.sleep(0.01)


def _tasks_of(uid: int) -> int:
  """Tasks (threads included, as RLIMIT_NPROC counts them) of user `uid` now."""
  count = 0
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        if os.stat(f"/proc/{pid}").st_uid == uid:
          count += len(os.listdir(f"/proc/{pid}/task"))
      except OSError:
        continue
  return count


class _Run:
  """What one sandboxed run gave: per-case results, or why there are none."""

  def __init__(self, results: list | None = None, timed_out: bool = False, exit_code: int = 0,
               stderr: str = "", start_error: str = "", seconds: float = 0.0, pid: int = 0):
    self.results, self.timed_out, self.exit_code = results, timed_out, exit_code
    self.pid = pid  # the runner's pid, which is also its session and process-group id (0: none)
    self.stderr, self.start_error, self.seconds = stderr, start_error, seconds


# ------------------------------------------------------------------------------ the environment
class CodeSandbox(HostEnvironment):
  """Programming problems solved by writing files and running tests in a sandbox (module doc).

  Parameters: `time_limit_s` (wall clock per run; the CPU limit is its ceiling in seconds),
  `memory_mb` (RLIMIT_AS), `max_processes` (RLIMIT_NPROC headroom above the sandbox user's tasks),
  `file_size_mb` (RLIMIT_FSIZE, also bounds the program's output), `python_executable` (the
  interpreter; None: this one, or when the sandbox user cannot reach it, e.g. under /root, the
  first of /usr/bin/python3, /bin/python3 it can; a missing one makes every run an environment
  error), `sandbox_user` ("auto":
  `nobody` when this process is root, else this user; None: never switch), `tmp_root` (where
  episode directories are made; None: the system's), `style` (the policy's action syntax).
  """

  name = "code_sandbox"
  version = "1"
  milestone_names = ("wrote_solution", "visible_tests_pass", "submitted")
  tools = (
      tool("write_file", "Create or overwrite a file of the episode (solution.py is graded).",
           path="string", content="string"),
      tool("read_file", "Read a file of the episode.", path="string"),
      tool("run_tests", "Run the visible tests on the current files; returns a short report."),
      tool("submit", "Grade solution.py with the hidden tests; ends the episode."),
  )
  default_backend = "thread"

  def __init__(self, time_limit_s: float = 5.0, memory_mb: int = 512, max_processes: int = 32,
               file_size_mb: int = 16, python_executable: str | None = None,
               sandbox_user: str | None = "auto", tmp_root: str | None = None,
               style: str = "tool_call", **reward_kwargs):
    super().__init__(**reward_kwargs)
    if not time_limit_s > 0 or memory_mb < 64 or max_processes < 1 or file_size_mb < 1:
      raise ValueError(f"CodeSandbox: need time_limit_s > 0, memory_mb >= 64, max_processes >= 1 "
                       f"and file_size_mb >= 1; got {time_limit_s}, {memory_mb}, {max_processes}, "
                       f"{file_size_mb}.")
    if style not in ("tool_call", "compact"):
      raise ValueError(f"CodeSandbox: style must be 'tool_call' or 'compact', got {style!r}.")
    self.time_limit_s, self.memory_mb = float(time_limit_s), memory_mb
    self.max_processes, self.file_size_mb = max_processes, file_size_mb
    self.python_executable = python_executable
    self.sandbox_user, self.tmp_root, self.style = sandbox_user, tmp_root, style
    self._dir: str | None = None
    self._task: dict | None = None
    self._files: dict[str, str] = {}
    self._progress: dict = {}
    self._network_isolated: bool | None = None

  # ------------------------------------------------------------------------------ tasks, text
  def tasks(self, split: str, num: int, seed: int) -> list[dict]:
    pool = _suite(split)
    order = list(range(len(pool)))
    random.Random(f"{split}:{seed}").shuffle(order)
    return [json.loads(pool[order[i % len(order)]]) for i in range(num)]

  def system_text(self, style: str) -> str:
    del style
    return ("You are in a Python sandbox. Write the requested function(s) in solution.py with "
            "write_file, check them with run_tests, then submit (hidden tests decide success; "
            "submit ends the episode).")

  def reset(self, task: dict, seed: int) -> Observation:
    missing = [k for k in ("id", "description", "functions", "reference", "visible", "hidden")
               if k not in task]
    if missing:
      raise ValueError(f"CodeSandbox.reset: task is missing {missing}; tasks come from tasks().")
    self._remove_dir()
    self._task, self._seed = task, int(seed)
    stub = "".join(f"def {fn}(*args):\n  raise NotImplementedError\n\n" for fn in task["functions"])
    self._files = {SOLUTION: stub, VISIBLE_TESTS: self._visible_text()}
    self._progress = {"steps": 0, "milestones": [], "tested_version": -1, "version": 0,
                      "done": False}
    examples = "\n".join(f"  {_call_text(fn, args)} == {json.dumps(exp)}"
                         for fn, args, exp in task["visible"])
    return Observation(f"{task['description']}\nFiles: {SOLUTION} (a stub), {VISIBLE_TESTS}.\n"
                       f"Visible tests:\n{examples}",
                       info={"task_id": task["id"], "functions": list(task["functions"])})

  def _visible_text(self) -> str:
    lines = ["# Visible tests (read-only; run them with run_tests).", "from solution import *", ""]
    lines += [f"assert {_call_text(fn, args)} == {exp!r}" for fn, args, exp in
              self._task["visible"]]
    return "\n".join(lines) + "\n"

  @property
  def network_isolated(self) -> bool | None:
    """Whether runs get their own network namespace (None until the first run)."""
    return self._network_isolated

  # ----------------------------------------------------------------------------------- step
  def step(self, action: str) -> StepResult:
    if self._task is None:
      raise RuntimeError("CodeSandbox.step before reset().")
    if self._progress["done"]:
      return StepResult("the episode is over (already submitted).", terminated=True)
    self._progress["steps"] += 1
    style = "compact" if self.style == "compact" and "<tool_call>" not in action else "tool_call"
    call = parse_call(action, self.tools, style)
    if not call.ok:
      return invalid_action(call.error, call.message)
    args = call.arguments
    if call.name == "write_file":
      return self._write(args["path"], args["content"])
    if call.name == "read_file":
      path = args["path"]
      if path not in self._files:
        return invalid_action(ErrorCode.INVALID_ARGUMENT,
                              f"no file {path[:64]!r}; files: {sorted(self._files)}")
      content = self._files[path]
      return StepResult(content if len(content) <= 4000 else content[:4000] + "\n[... truncated]")
    if call.name == "run_tests":
      return self._run_tests()
    return self._submit()

  def _write(self, path: str, content: str) -> StepResult:
    if not _PATH.fullmatch(path) or path in (".", ".."):
      return invalid_action(ErrorCode.INVALID_ARGUMENT,
                            f"path {path[:64]!r} must be a plain file name (letters, digits, "
                            f"_ . -; no folders), like {SOLUTION!r}")
    if path == VISIBLE_TESTS:
      return invalid_action(ErrorCode.NOT_ALLOWED, f"{VISIBLE_TESTS} is read-only")
    size = len(content.encode("utf-8", "surrogatepass"))
    if size > _MAX_FILE_BYTES:
      return invalid_action(ErrorCode.INVALID_ARGUMENT,
                            f"content is {size} bytes; the limit is {_MAX_FILE_BYTES}")
    if path not in self._files and len(self._files) >= _MAX_FILES:
      return invalid_action(ErrorCode.INVALID_ARGUMENT, f"at most {_MAX_FILES} files")
    self._files[path] = content
    self._progress["version"] += 1
    milestones = self._reach("wrote_solution") if path == SOLUTION else ()
    return StepResult(f"wrote {path} ({size} bytes).", milestones=milestones)

  def _reach(self, name: str) -> tuple[str, ...]:
    if name in self._progress["milestones"]:
      return ()
    self._progress["milestones"].append(name)
    return (name,)

  def _run_tests(self) -> StepResult:
    run = self._sandboxed(dict(self._files), self._task["visible"], "work")
    if run.start_error:
      return StepResult(run.start_error, env_error=True, info={"seconds": run.seconds})
    passed, lines = _grade(run, self._task["visible"], show=True)
    total = len(self._task["visible"])
    milestones = ()
    if passed == total:
      self._progress["tested_version"] = self._progress["version"]
      milestones = self._reach("visible_tests_pass")
    report = f"visible tests: {passed}/{total} passed." + "".join("\n" + l for l in lines)
    return StepResult(report[:1500], milestones=milestones,
                      info={"passed": passed, "total": total, "seconds": run.seconds})

  def _submit(self) -> StepResult:
    files = {SOLUTION: self._files.get(SOLUTION, "")}
    run = self._sandboxed(files, self._task["hidden"], "submit")
    if run.start_error:
      return StepResult(run.start_error, env_error=True, info={"seconds": run.seconds})
    passed, lines = _grade(run, self._task["hidden"], show=False)
    total = len(self._task["hidden"])
    self._progress["done"] = True
    success = passed == total
    report = f"submitted: hidden tests {passed}/{total} passed." + "".join(
        "\n" + l for l in lines)
    return StepResult(report[:1500], terminated=True, success=success,
                      milestones=self._reach("submitted"),
                      info={"passed": passed, "total": total, "seconds": run.seconds})

  # ------------------------------------------------------------------------------ the sandbox
  def _episode_dir(self) -> str:
    if self._dir is None:
      self._dir = tempfile.mkdtemp(prefix="code_sandbox_", dir=self.tmp_root)
      os.chmod(self._dir, 0o711)
    return self._dir

  def _identity(self) -> tuple[int, int] | None:
    if self.sandbox_user is None or (self.sandbox_user == "auto" and os.geteuid() != 0):
      return None
    entry = pwd.getpwnam("nobody" if self.sandbox_user == "auto" else self.sandbox_user)
    return entry.pw_uid, entry.pw_gid

  def _sandboxed(self, files: dict[str, str], cases: list, label: str) -> _Run:
    """Runs the runner on `cases` with `files` in a fresh directory (see the module doc)."""
    start = time.monotonic()
    try:
      base = self._episode_dir()
      run_dir = os.path.join(base, label)
      shutil.rmtree(run_dir, ignore_errors=True)
      os.mkdir(run_dir)
      for path, content in files.items():
        with open(os.path.join(run_dir, path), "w", encoding="utf-8", errors="surrogatepass") as f:
          f.write(content)
      identity = self._identity()
      if identity is not None:
        for path in [run_dir, *(os.path.join(run_dir, p) for p in files)]:
          os.chown(path, *identity)
      executable = self.python_executable or _interpreter(identity is not None)
      if self._network_isolated is None:
        self._network_isolated = _probe_network_isolation(executable)
      preexec = self._preexec(identity, self._network_isolated)
      out_path, err_path = os.path.join(base, f".{label}.out"), os.path.join(base, f".{label}.err")
      nonce = secrets.token_hex(16)
      with open(out_path, "wb+") as out, open(err_path, "wb+") as err:
        proc = subprocess.Popen(
            [executable, "-I", "-c", _RUNNER], cwd=run_dir, stdin=subprocess.PIPE,
            stdout=out, stderr=err, preexec_fn=preexec, start_new_session=True, close_fds=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": run_dir})
        payload = (nonce + "\n" + json.dumps([[fn, args] for fn, args, _ in cases]) + "\n").encode()
    except (OSError, subprocess.SubprocessError, KeyError) as e:
      return _Run(start_error=f"sandbox failed to start: {type(e).__name__}: {e}",
                  seconds=time.monotonic() - start)
    timed_out = False
    try:
      proc.communicate(payload, timeout=self.time_limit_s)
    except subprocess.TimeoutExpired:
      timed_out = True
    except (BrokenPipeError, OSError):
      pass  # the program closed stdin early; its exit code and output tell the rest
    finally:
      try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: forked children too
      except (ProcessLookupError, PermissionError):
        pass
      proc.wait()
      _await_group_exit(proc.pid, deadline=time.monotonic() + 2.0)
    seconds = time.monotonic() - start
    with open(out_path, "rb") as f:
      stdout = f.read().decode("utf-8", "replace")
    with open(err_path, "rb") as f:
      f.seek(max(0, os.path.getsize(err_path) - 2000))
      stderr = f.read().decode("utf-8", "replace")
    results = None
    for line in stdout.splitlines():
      if line.startswith(nonce):
        try:
          parsed = json.loads(line[len(nonce):])
        except ValueError:
          continue
        if isinstance(parsed, list) and len(parsed) == len(cases):
          results = parsed
    stderr = stderr.replace(run_dir, ".")  # tracebacks name the (random) directory
    return _Run(results, timed_out, proc.returncode, stderr, seconds=seconds, pid=proc.pid)

  def _preexec(self, identity: tuple[int, int] | None, isolate: bool) -> Callable[[], None]:
    cpu = max(1, int(-(-self.time_limit_s // 1)))
    memory, fsize = self.memory_mb * 2**20, self.file_size_mb * 2**20
    nproc = (_tasks_of(identity[0]) if identity is not None else _tasks_of(os.getuid()))
    nproc += self.max_processes
    unshare = _libc_unshare() if isolate else None

    def preexec() -> None:
      resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
      resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
      resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
      resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
      resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
      if unshare is not None:
        unshare(_CLONE_NEWNET)
      if identity is not None:
        os.setgroups([])
        os.setgid(identity[1])
        os.setuid(identity[0])

    return preexec

  # ----------------------------------------------------------------------- oracle, snapshots
  def oracle(self) -> str | None:
    if self._task is None or self._progress["done"]:
      return None
    if self._files.get(SOLUTION) != self._task["reference"]:
      call = {"name": "write_file",
              "arguments": {"path": SOLUTION, "content": self._task["reference"]}}
    elif self._progress["tested_version"] != self._progress["version"]:
      call = {"name": "run_tests", "arguments": {}}
    else:
      call = {"name": "submit", "arguments": {}}
    return "<tool_call>" + json.dumps(call) + "</tool_call>"

  def snapshot(self) -> dict:
    if self._task is None:
      raise RuntimeError("CodeSandbox.snapshot before reset().")
    return json.loads(json.dumps({"files": self._files, "progress": self._progress}))

  def restore(self, snapshot: dict) -> None:
    if self._task is None:
      raise RuntimeError("CodeSandbox.restore before reset() of the same task and seed.")
    if not isinstance(snapshot, dict) or set(snapshot) != {"files", "progress"}:
      raise ValueError("CodeSandbox.restore: expected a snapshot() dict with 'files' and "
                       "'progress'.")
    snapshot = json.loads(json.dumps(snapshot))
    self._files, self._progress = snapshot["files"], snapshot["progress"]

  def close(self) -> None:
    self._remove_dir()

  def _remove_dir(self) -> None:
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)
      self._dir = None

  def __del__(self):
    try:
      self._remove_dir()
    except Exception:
      pass


def _call_text(fn: str, args: list) -> str:
  return f"{fn}({', '.join(json.dumps(a) for a in args)})"


def _grade(run: _Run, cases: list, show: bool) -> tuple[int, list[str]]:
  """(number of cases whose value equals the expected one, report lines)."""
  if run.results is None:
    if run.timed_out:
      why = "timed out (the time limit was hit: an infinite loop?)"
    elif run.exit_code == -signal.SIGXCPU:  # RLIMIT_CPU, set to the wall limit: whichever fires first
      why = "timed out (the CPU time limit was hit: an infinite loop?)"
    elif run.exit_code is not None and run.exit_code < 0:
      why = f"killed by signal {-run.exit_code} (a CPU, memory or file-size limit?)"
    else:
      why = f"the program exited (code {run.exit_code}) before reporting results"
    tail = run.stderr.strip().splitlines()[-3:]
    return 0, [f"no results: {why}.", *(["stderr: " + " | ".join(tail)[-300:]] if tail else [])]
  passed, lines = 0, []
  for (fn, args, expected), (kind, value) in zip(cases, run.results):
    ok = kind == "ok" and _same(value, expected)
    passed += ok
    if not ok and len(lines) < 4:
      call = _call_text(fn, args) if show else f"a hidden test of {fn}"
      if kind == "ok":
        got = json.dumps(value)
        got = got if len(got) <= 80 else got[:80] + "..."
        lines.append(f"FAIL {call}: got {got}" + (f", expected {json.dumps(expected)}"
                                                   if show else ""))
      else:
        lines.append(f"FAIL {call}: {str(value)[:160]}")
  return passed, lines


def _same(value: Any, expected: Any) -> bool:
  """Equality of JSON values, with bools and numbers kept apart (True is not 1)."""
  if isinstance(expected, bool) or isinstance(value, bool):
    return type(value) is type(expected) and value == expected
  if isinstance(expected, list):
    return (isinstance(value, list) and len(value) == len(expected)
            and all(_same(v, e) for v, e in zip(value, expected)))
  if isinstance(expected, dict):
    return (isinstance(value, dict) and value.keys() == expected.keys()
            and all(_same(value[k], expected[k]) for k in expected))
  if isinstance(expected, (int, float)):
    return isinstance(value, (int, float)) and value == expected
  return value == expected
