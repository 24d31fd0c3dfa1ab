"""Start, watch and stop the demo's child processes (syncer, islands, baseline).

Every child runs in its own session (process group) with its output in a log file, and on Linux asks the kernel
to send it SIGTERM if the demo dies without cleaning up. ``Supervisor.stop_all`` ends each group with SIGTERM,
then SIGKILL after a grace period; it runs on normal exit, on an error and on Ctrl-C (``with Supervisor(...)``).
A child that exits with a non-zero status makes ``check()`` raise ``ChildFailed`` carrying the most useful part
of its log (the first rank's traceback when torchrun reports one, else the tail).
"""
import ctypes
import os
import re
import signal
import subprocess
import sys
import time

__all__ = ["ChildFailed", "Child", "Supervisor", "error_excerpt"]


class ChildFailed(RuntimeError):
    def __init__(self, name, returncode, log_path, excerpt):
        self.name, self.returncode, self.log_path, self.excerpt = name, returncode, log_path, excerpt
        how = f"exit status {returncode}" if returncode >= 0 else f"signal {signal.Signals(-returncode).name}"
        cause = _cause(excerpt)
        super().__init__(f"{name} failed ({how}){': ' + cause if cause else ''}\nlog: {log_path}\n{excerpt}")


_EXC_LINE = re.compile(r"^(?:\[rank\d+\]\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed)[\w]*: .+)$")


def _cause(excerpt):
    """The last 'SomeError: message' line of a traceback excerpt (what to show first)."""
    for ln in reversed(excerpt.splitlines()):
        m = _EXC_LINE.match(ln.strip())
        if m:
            return m.group(1)
    return None


def _parent_death_signal():
    """preexec_fn: SIGTERM this child when the demo process dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank(\d+)\]:\s?")


def error_excerpt(text, max_lines=30):
    """The part of a log that says why a process failed.

    torchrun prints each rank's traceback with a ``[rankN]:`` prefix and then its own ``ChildFailedError``
    summary; the rank's traceback is what the user needs. Otherwise: the last Python traceback, else the tail.
    """
    lines = text.splitlines()
    ranked = {}
    for ln in lines:
        m = _RANK_PREFIX.match(ln)
        if m:
            ranked.setdefault(int(m.group(1)), []).append(ln[m.end():])
    for r in sorted(ranked):
        body = ranked[r]
        starts = [i for i, ln in enumerate(body) if ln.startswith("Traceback (most recent call last)")]
        if starts:
            tb = body[starts[0]:]
            if len(tb) > max_lines:
                tb = tb[:3] + ["  ..."] + tb[-(max_lines - 4):]
            return "\n".join(f"[rank{r}] {ln}" for ln in tb)
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if starts:
        tb = lines[starts[-1]:]
        # stop at torchrun's own launcher traceback when the workers' one was not prefixed
        return "\n".join(tb[-max_lines:])
    return "\n".join(lines[-max_lines:])


class Child:
    def __init__(self, name, argv, env, cwd, log_path, expect_exit=True):
        self.name, self.argv, self.log_path, self.expect_exit = name, list(argv), log_path, expect_exit
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self._log = open(log_path, "wb")
        self._log.write(("$ " + " ".join(argv) + "\n").encode())
        self._log.flush()
        self.started = time.time()
        self.retired = False   # killed on purpose (the demo's --kill): its exit status is not a failure
        self.popen = subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_parent_death_signal if sys.platform.startswith("linux") else None)
        self.ended = None

    @property
    def pid(self):
        return self.popen.pid

    def poll(self):
        rc = self.popen.poll()
        if rc is not None and self.ended is None:
            self.ended = time.time()
        return rc

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def excerpt(self):
        return error_excerpt(self.log_text())

    def signal_group(self, sig):
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def close_log(self):
        try:
            self._log.close()
        except OSError:
            pass


class Supervisor:
    """Owns every child the demo starts; use as a context manager so they are always stopped."""

    def __init__(self, log_dir, grace_s=10.0):
        self.log_dir, self.grace_s = log_dir, grace_s
        self.children = []

    def start(self, name, argv, env=None, cwd=None, expect_exit=True):
        c = Child(name, argv, env if env is not None else dict(os.environ), cwd,
                  os.path.join(self.log_dir, f"{name}.log"), expect_exit)
        self.children.append(c)
        return c

    def retire(self, child):
        """`child` is about to be killed on purpose: its exit no longer counts as a failure."""
        child.retired = True

    def check(self):
        """Raise ChildFailed for the first child (not retired) that exited with a non-zero status."""
        for c in list(self.children):
            if c.retired:
                continue
            rc = c.poll()
            if rc not in (None, 0):
                raise ChildFailed(c.name, rc, c.log_path, c.excerpt())

    def wait(self, children, timeout_s, tick=None, tick_every_s=2.0):
        """Wait until every child in `children` (a list, or a function returning the current list: a relaunched
        child replaces a killed one) exited 0, calling tick() periodically; ChildFailed if any supervised child
        fails meanwhile, TimeoutError after timeout_s."""
        deadline = time.time() + timeout_s
        next_tick = 0.0
        current = children if callable(children) else (lambda: children)
        while True:
            self.check()
            children = current()
            if all(c.poll() == 0 for c in children):
                if tick:
                    tick()
                return
            now = time.time()
            if tick and now >= next_tick:
                tick()
                next_tick = now + tick_every_s
            if now > deadline:
                late = [c.name for c in children if c.poll() is None]
                raise TimeoutError(f"{', '.join(late)} still running after {timeout_s:.0f}s")
            time.sleep(0.2)

    def stop_all(self):
        alive = [c for c in self.children if c.poll() is None]
        signalled = list(alive)
        for c in alive:
            c.signal_group(signal.SIGTERM)
        deadline = time.time() + self.grace_s
        while alive and time.time() < deadline:
            alive = [c for c in alive if c.poll() is None]
            time.sleep(0.1)
        for c in alive:
            c.signal_group(signal.SIGKILL)
        for c in self.children:
            try:
                c.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if c in signalled:  # workers of a torchrun stopped mid-run may linger in its group
                c.signal_group(signal.SIGKILL)
            c.close_log()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()
        return False
