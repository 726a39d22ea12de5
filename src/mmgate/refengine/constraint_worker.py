"""The constraint compiler's child process: one xgrammar compiler, one constraint at a time.

Stage: engine, outside the serving process.  The reference engine compiles every
structured-output constraint here, never in its own process (:mod:`.constraint_pool`
starts, feeds, times and kills these children), because a constraint can crash xgrammar
(a JSON schema ``pattern`` nesting 50,000 groups overflows its C stack: SIGSEGV), take
minutes (an enum of 100,000 values: 167 s) or gigabytes (1,024 choices of 10 KB: 2.9 GB
and still compiling after 8 min).  A crash kills this child only; the serving process
answers the request and starts another child.

Protocol, over one socket given as a file descriptor (``multiprocessing.connection``
length-prefixed messages):
  1. in: ``{"memory_bytes": N}`` (JSON), then the serialized ``xgr.TokenizerInfo``
     (``TokenizerInfo.serialize_json``: the engine's vocabulary, built once in the serving
     process, which needs it anyway to deserialize what comes back);
  2. the child caps its address space at its size now plus ``memory_bytes``
     (``RLIMIT_AS``, after its imports: importing xgrammar, which imports torch, maps
     3.3 GB of address space), writes no core files, and answers ``R``;
  3. per constraint, in: ``{"kind", "value"}`` (a :class:`~mmgate.types.ConstraintKind`
     value and the constraint's text); out: ``G`` + ``CompiledGrammar.serialize_json()``,
     or ``E`` + ``{"error": <exception type>, "memory": <the compile ran out of memory>}``.
The child exits when the socket closes (the serving process stopped it), and is killed when the
thread that started it ends (``PR_SET_PDEATHSIG``: the serving process died, even mid-compile).

:func:`compile_constraint` mirrors vLLM's xgrammar backend
(``vllm/v1/structured_output/backend_xgrammar.py`` ``XgrammarBackend.compile_grammar``,
v0.11): ``json`` -> ``compile_json_schema``, ``regex`` -> ``compile_regex``, ``grammar``
(EBNF / GBNF) -> ``compile_grammar``, ``choice`` -> an EBNF alternation
(``GrammarConfig.choice_as_grammar``), ``structural_tag`` -> ``compile_structural_tag``
(vLLM's ``{"structures", "triggers"}`` shape).  Two deliberate differences:
``json_object`` is the schema ``{"type": "object"}`` (vLLM compiles xgrammar's built-in
JSON grammar, which also takes arrays and scalars; OpenAI's ``json_object`` promises an
object), and JSON schemas are compiled with ``any_whitespace=False`` (vLLM's
``--structured-outputs-config.disable_any_whitespace``), so a model with random weights
cannot fill its output with whitespace and a bounded schema ends in a bounded number of
tokens.

The child imports xgrammar (which itself imports torch and transformers: about 2 s and
370 MB of private memory, measured) and nothing of the engine's model code.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

from mmgate.types import ConstraintKind

#: ``json_object``: any JSON object (``strict_mode=False``: any properties)
ANY_OBJECT = '{"type": "object"}'
#: message tags: the child is ready, a compiled grammar, a refusal
READY, GRAMMAR, ERROR = b"R", b"G", b"E"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``.

    Mirrors vLLM ``GrammarConfig.choice_as_grammar`` (``escape_ebnf_string``:
    backslashes and double quotes escaped).  ``["a", "b\\"c"]`` -> ``root ::= "a" | "b\\"c"``.
    """
    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace('"', '\\"')

    return "root ::= " + " | ".join(f'"{escape(c)}"' for c in choices)


def compile_constraint(compiler: xgr.GrammarCompiler, kind: ConstraintKind, value: str) -> xgr.CompiledGrammar:
    """Compile one constraint (``json`` -> ``compile_json_schema``, ``regex`` -> ``compile_regex``,
    ``grammar`` -> ``compile_grammar``, ``choice`` (a JSON list) -> an EBNF alternation,
    ``structural_tag`` (vLLM's ``{"structures", "triggers"}``) -> ``compile_structural_tag``).

    Raises:
        RuntimeError / ValueError / TypeError / KeyError: xgrammar refuses the constraint, or a
            structural tag is not of vLLM's shape (the child answers any exception as a refusal).
    """
    if kind is ConstraintKind.JSON_SCHEMA:
        return compiler.compile_json_schema(value, any_whitespace=False)
    if kind is ConstraintKind.JSON_OBJECT:
        return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if kind is ConstraintKind.REGEX:
        return compiler.compile_regex(value)
    if kind is ConstraintKind.GRAMMAR:
        return compiler.compile_grammar(value)
    if kind is ConstraintKind.CHOICE:
        return compiler.compile_grammar(choice_grammar(json.loads(value)))
    tag: Any = json.loads(value)
    if not isinstance(tag, dict) or "structures" not in tag or "triggers" not in tag:
        raise ValueError("structural_tag must be an object with structures and triggers")
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, list(tag["triggers"]))


def _address_space_bytes() -> int:
    """This process's mapped address space now (``VmSize`` of ``/proc/self/status``, Linux)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def _cap_memory(extra_bytes: int) -> None:
    """Let the address space grow by ``extra_bytes`` at most (``RLIMIT_AS``): a compile past it
    gets ``std::bad_alloc`` (xgrammar raises ``RuntimeError``) instead of the machine's memory.
    No core files either (``RLIMIT_CORE`` 0): a crashing constraint, sent again and again, must not
    fill the disk with them."""
    limit = _address_space_bytes() + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _answer(compiler: xgr.GrammarCompiler, job: dict[str, str]) -> bytes:
    try:
        compiled = compile_constraint(compiler, ConstraintKind(job["kind"]), job["value"])
        return GRAMMAR + compiled.serialize_json().encode()
    except Exception as exc:  # noqa: BLE001 - whatever the compile raises is the constraint's refusal
        memory = isinstance(exc, MemoryError) or "bad_alloc" in str(exc)
        return ERROR + json.dumps({"error": type(exc).__name__, "memory": memory}).encode()


def serve(conn: Connection) -> None:
    """Set up from the first two messages, then answer one message per constraint until EOF."""
    setup = json.loads(conn.recv_bytes())
    info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the engine caches
    _cap_memory(int(setup["memory_bytes"]))
    conn.send_bytes(READY)
    while True:
        try:
            job = json.loads(conn.recv_bytes())
        except EOFError:
            return
        conn.send_bytes(_answer(compiler, job))


def _die_with_parent(parent: int) -> None:
    """SIGKILL this child when the thread that started it ends (``prctl(PR_SET_PDEATHSIG)``, Linux);
    exit now if that parent is already gone.  Ctrl-C at a terminal is the serving process's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str]) -> int:
    """``constraint_worker FD PARENT_PID``: serve on the inherited socket ``FD``."""
    _die_with_parent(int(argv[1]))
    serve(Connection(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
