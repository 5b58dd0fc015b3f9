"""The one fault-injection hook, `--set fault=KIND@RANK:STEP` (bench.config.FaultSpec), applied
in the worker at the start of a step on one rank, the same way whatever system runs.

Off unless the config names a fault. The failure tests (tests/test_faults.py) use it to check
that every kind of failure ends the run in seconds with a record that names the rank:
  kill  the rank sends itself SIGKILL (a crash the process cannot report: the OOM killer);
  stop  the rank sends itself SIGSTOP (a hang: alive, holding its peers in a collective);
  exit  the rank calls sys.exit(3) (a Python-level failure with an exit code);
  nan   the rank's microbatches of that step carry NaN in every float input (image patches,
        latents, noise, loss mask), so the loss computed from them is non-finite.
"""
from __future__ import annotations

import os
import signal
import sys

from bench.config import FaultSpec

EXIT_CODE = 3


class Injector:
    """Built once per rank from the config; `before_step` is called at the top of every step."""

    def __init__(self, spec: str, rank: int):
        fault = FaultSpec.parse(spec)
        self.fault = fault if fault is not None and fault.rank == rank else None

    def before_step(self, step: int) -> None:
        f = self.fault
        if f is None or f.step != step or f.kind == "nan":
            return
        print(f"[bench] fault injected: {f.kind} on rank {f.rank} at step {step}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)      # resumes only if someone sends SIGCONT
        elif f.kind == "exit":
            sys.exit(EXIT_CODE)

    def wrap(self, source):
        """The data source the system sees: the same one unless this rank poisons a step."""
        return _PoisonedSource(source, self.fault.step) if self.fault and self.fault.kind == "nan" else source


class _PoisonedSource:
    """Delegates to the real source; the microbatches of one step come back with NaN inputs."""

    def __init__(self, source, step: int):
        self._source, self._step = source, step

    def __getattr__(self, name):
        return getattr(self._source, name)

    def microbatches(self, step: int, *args, **kwargs):
        out = self._source.microbatches(step, *args, **kwargs)
        if step == self._step:
            print(f"[bench] fault injected: nan inputs at step {step}", file=sys.stderr, flush=True)
            for mb in out:
                _poison(mb)
        return out


def _poison(mb) -> None:
    """Out of place: a microbatch may share memory with a cache or a received buffer."""
    nan = float("nan")
    mb.loss_mask = mb.loss_mask * nan
    for g in mb.image_groups:
        g.patches = g.patches * nan
    for g in mb.latent_groups:
        g.latents, g.noise = g.latents * nan, g.noise * nan
