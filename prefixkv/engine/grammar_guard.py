"""Grammars compiled first in warm child processes, so a crash or a runaway costs one request.

llguidance compiles in native code: a grammar that overflows its stack is a SIGSEGV, which no
``try`` catches, and a huge one can run for many seconds. :class:`GrammarGuard` keeps a few
child processes (this file run by path: stdlib and llguidance only, no torch) that each hold
the model's tokenizer. :meth:`GrammarGuard.check` sends a grammar to an idle child, which builds
the matcher and its first token mask on a thread with a *smaller* stack
(:data:`CHILD_STACK_BYTES`) than any thread of the server has; the server compiles a grammar
only after a child did. A child that dies or runs past the time budget is replaced and that
request alone gets a ``ValueError`` ("grammar could not be compiled: ...").

Wire: length-prefixed JSON frames on the child's stdin / a private copy of its stdout (the
child's fd 1 points at stderr, so nothing native can corrupt a frame). A child exits when its
stdin closes, so the server dying never leaves children behind.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

CHILD_STACK_BYTES = 2 * 1024 * 1024
"""The child's compile thread's stack: no bigger than the smallest thread stack the server
runs grammars on (glibc's default, even with an unlimited ``ulimit -s``), so what compiles in a
child cannot overflow in the server."""

COMPILE_TIMEOUT_S = 5.0
"""How long one grammar may take to compile (matcher and first mask) in a child."""

STARTUP_TIMEOUT_S = 120.0
"""How long a new child may take to load llguidance and the tokenizer."""

_HEADER = struct.Struct("<I")


class CompileError(ValueError):
    """A grammar the compiler refused, crashed on or ran too long on (one clean line)."""


def clean_error(message: str) -> str:
    """The first line of a compiler error: no Rust panic backtrace reaches a client."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line.removeprefix("panic: ")[:500]


class _Child:
    """One compiler child process and its pipes; used by one caller at a time."""

    def __init__(self, setup: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.ready = False
        self._send(setup)

    def _send(self, payload: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        self.proc.stdin.flush()

    def ask(self, grammar: str, timeout_s: float) -> str | None:
        """The child's verdict on ``grammar`` (``None``: it compiles; else the error);
        ``TimeoutError`` / ``EOFError`` when it ran too long or died."""
        if not self.ready:
            try:
                _read_frame(self.proc, time.monotonic() + STARTUP_TIMEOUT_S)
            except (EOFError, TimeoutError):  # it never started: not the grammar's fault
                raise BrokenPipeError from None
            self.ready = True
        self._send(json.dumps({"grammar": grammar}).encode())
        reply = _read_frame(self.proc, time.monotonic() + timeout_s)
        error = json.loads(reply).get("error")
        return None if error is None else str(error)

    def kill(self) -> None:
        """End the child now (it may be running away)."""
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _read_frame(proc: subprocess.Popen[bytes], deadline: float) -> bytes:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    need = _HEADER.size
    header_done = False
    while True:
        while len(data) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, need - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        if header_done:
            return data
        (need,) = _HEADER.unpack(data)
        data, header_done = b"", True


class GrammarGuard:
    """A pool of warm compiler children for one tokenizer; thread safe.

    Args:
        tokenizer_json: the Hugging Face ``tokenizers`` JSON the children build llguidance's
            tokenizer from (as :class:`~prefixkv.engine.structured_output.GrammarCompiler`).
        vocab_size: the model's vocabulary (logits width).
        eos_token_ids: the ids that end a sequence.
        workers: how many children (and so how many grammars compile at once).
        timeout_s: the budget of one compile.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], *,
                 workers: int = 2, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._setup = json.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size,
                                  "eos": eos_token_ids}).encode()
        self.timeout_s = timeout_s
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._children: list[_Child] = []  # every live child, for the finalizer
        for _ in range(workers):  # they load while the server goes on: warm by the first use
            self._idle.put(self._spawn())
        weakref.finalize(self, _kill_all, self._children)

    def _spawn(self) -> _Child:
        child = _Child(self._setup)
        self._children.append(child)
        return child

    def _replace(self, child: _Child) -> _Child:
        child.kill()
        self._children.remove(child)
        return self._spawn()

    def check(self, grammar: str) -> None:
        """Compile ``grammar`` in a child; :class:`CompileError` (a ``ValueError``, one clean
        line) if it is invalid, crashes the compiler or takes longer than ``timeout_s``."""
        child = self._idle.get()
        try:
            for attempt in (1, 2):
                try:
                    error = child.ask(grammar, self.timeout_s)
                    break
                except BrokenPipeError:  # it died before it had the grammar: not this one's fault
                    child = self._replace(child)
                    if attempt == 2:
                        raise CompileError("grammar could not be compiled: no compiler process") from None
                except TimeoutError:
                    child = self._replace(child)
                    raise CompileError(f"grammar could not be compiled within {self.timeout_s:g} s "
                                       "(simplify the schema or grammar)") from None
                except EOFError:
                    code = child.proc.wait()
                    child = self._replace(child)
                    how = (signal.Signals(-code).name if code < 0 and -code in signal.valid_signals()
                           else f"exit {code}")
                    raise CompileError("grammar could not be compiled: the compiler crashed on it "
                                       f"({how}; it is probably nested too deeply)") from None
        finally:
            self._idle.put(child)
        if error is not None:
            raise CompileError(f"invalid grammar: {clean_error(error)}")

    def close(self) -> None:
        """End every child (they also end when the server does)."""
        _kill_all(self._children)


def _kill_all(children: list[_Child]) -> None:
    for child in list(children):
        child.kill()
    children.clear()


# ---------------------------------------------------------------- the child (run by path)
def _child_main() -> None:
    import llguidance

    wire_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # native prints go to stderr, never into a frame
    wire_in = sys.stdin.buffer

    def read() -> Any:
        head = wire_in.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return None
        return json.loads(wire_in.read(_HEADER.unpack(head)[0]))

    def write(obj: dict[str, Any]) -> None:
        payload = json.dumps(obj).encode()
        wire_out.write(_HEADER.pack(len(payload)) + payload)
        wire_out.flush()

    setup = read()
    if setup is None:
        return
    tok = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"],
                                 eos_token=setup["eos"] or None)
    write({"ready": True})
    threading.stack_size(CHILD_STACK_BYTES)
    while (msg := read()) is not None:
        verdict: dict[str, Any] = {"error": None}

        def compile_one(grammar: str = msg["grammar"], verdict: dict[str, Any] = verdict) -> None:
            try:
                matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
                if not matcher.is_error():
                    matcher.compute_bitmask()
                if matcher.is_error():
                    verdict["error"] = matcher.get_error()
            except BaseException as exc:  # noqa: BLE001 - a panic is a BaseException in pyo3
                verdict["error"] = str(exc) or type(exc).__name__

        worker = threading.Thread(target=compile_one)
        worker.start()
        worker.join()
        write(verdict)


if __name__ == "__main__":
    _child_main()
