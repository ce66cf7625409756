"""Run Python scripts as fresh processes that skip the frameworks' import time.

The docs' pages and the examples are each run as a script in a process of its own, as a user
runs them. Importing jax and torch takes seconds per process, about as long as most of those
scripts run, so this server imports them once and forks a child per script: each child starts
from a process that has imported the frameworks but never used them (no JAX backend, no torch
thread pool), and runs its script as ``python script args...`` would, in its own directory,
with its output in its own files.

    python tests/_forkserver.py JOBS_DIR

``JOBS_DIR/jobs.json`` lists ``{"name", "argv", "cwd"}``; at most one child per core runs at a
time, each writing ``JOBS_DIR/<name>.out`` and ``.err``; as each child ends the server prints
``<name> <exit code>`` on its own line.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

# What most scripts import. Keras is not here: it picks its backend from the environment when it
# is first imported, which a script may set before importing it.
PRELOAD = ("numpy", "jax", "jax.numpy", "torch", "equinox", "activity")


def _run_child(job: dict, jobs_dir: Path) -> None:
    """In the forked child: become ``python argv...`` in ``cwd``; never returns."""
    code = 1
    try:
        os.chdir(job["cwd"])
        for fd, suffix in ((1, "out"), (2, "err")):
            sys.stdout.flush(), sys.stderr.flush()
            target = os.open(jobs_dir / f"{job['name']}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = list(job["argv"])
        script = Path(sys.argv[0]).resolve()
        sys.path[0] = str(script.parent)  # as `python script` sets it
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit code says it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(jobs_dir: Path) -> None:
    jobs = json.loads((jobs_dir / "jobs.json").read_text())
    for name in PRELOAD:
        importlib.import_module(name)
    pending, running = list(jobs), {}
    width = os.cpu_count() or 1
    while pending or running:
        while pending and len(running) < width:
            job = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _run_child(job, jobs_dir)
            running[pid] = job
        pid, status = os.wait()
        print(running.pop(pid)["name"], os.waitstatus_to_exitcode(status), flush=True)


class ForkServer:
    """Starts the server on ``jobs`` (``name -> (argv, cwd)``) and hands out each job's result,
    waiting for it: ``server.result(name)`` is ``(exit code, stdout, stderr)``."""

    def __init__(self, jobs: dict, jobs_dir: Path, env: dict | None = None) -> None:
        import subprocess
        import threading

        self._dir = jobs_dir
        self._stems = {name: f"job{i}" for i, name in enumerate(jobs)}  # a page's name has slashes
        listed = [
            {"name": self._stems[name], "argv": [str(a) for a in argv], "cwd": str(cwd)} for name, (argv, cwd) in jobs.items()
        ]
        (jobs_dir / "jobs.json").write_text(json.dumps(listed))
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(jobs_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )
        self._codes: dict[str, int] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self._process.stdout:
            stem, code = line.rsplit(maxsplit=1)
            with self._changed:
                self._codes[stem] = int(code)
                self._changed.notify_all()
        with self._changed:
            self._codes[""] = self._process.wait()  # the server itself ended
            self._changed.notify_all()

    def result(self, name: str, timeout: float = 300) -> tuple[int, str, str]:
        stem = self._stems[name]
        with self._changed:
            self._changed.wait_for(lambda: stem in self._codes or "" in self._codes, timeout)
        if stem not in self._codes:
            ended = "" in self._codes
            raise RuntimeError(
                f"{name} did not finish: "
                + (f"the fork server ended first:\n{self._process.stderr.read()[-5000:]}" if ended else f"still running after {timeout} s")
            )
        read = lambda suffix: (self._dir / f"{stem}.{suffix}").read_text()  # noqa: E731
        return self._codes[stem], read("out"), read("err")

    def close(self) -> None:
        """Stops the server and any child still running (they share its process group)."""
        import signal

        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.communicate()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
