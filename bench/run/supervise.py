"""Supervising one torchrun launch from outside: its output, its progress, its processes.

torchrun's elastic agent ends the group when a rank exits, but not when one hangs (a stopped
or deadlocked rank holds its peers in a collective until some timeout, and megatron-core's
groups may wait far longer than timeout_s), and its summary often names as root cause the
rank that merely saw its peer go ("Connection closed by peer"). So `Launch`:
  - has torchrun tee every rank's output with a `[rankN]:` prefix and keeps each rank's last
    lines;
  - ends the run when no rank has made progress (bench.run.progress) for timeout_s, or when
    `abort` reports a failure outside torchrun (a preprocessing worker died), and then kills
    every process of the run: torchrun, the ranks, anything they started;
  - says why a run failed: which rank, killed by which signal or exited with which code, at
    which step, with its last lines (`Failure`); on several nodes, with what the other nodes'
    torchruns said (`node_summary`), since a rank that dies on node 1 shows on node 0 only as
    its peers' closed connections.
"""
from __future__ import annotations

import collections
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from bench.run import progress

PREFIX_TEMPLATE = "[rank${rank}]:"        # torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")
# torchrun's failure summary (torch.distributed.elastic.multiprocessing.errors), one block per rank.
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
# Errors a rank prints because a peer failed, not because it did.
CONSEQUENCES = ("ChildFailedError", "Connection closed by peer", "Connection reset by peer", "Timed out",
                "timed out", "stopped answering")
POLL_S = 0.5
# How long node 0 waits for the other nodes' summaries of a failed run: their torchruns end
# within seconds of node 0's when a rank died; one whose ranks hang leaves none in time.
FOLLOWERS_WAIT_S = 30.0
TAIL = 20                  # lines of the failing rank kept in the record
REASON_LINES = 3           # of which the one-line reason quotes the last few
# The phase a rank is in after its last heartbeat named the phase it finished (bench.run.worker).
_NEXT_PHASE = {"imports": "process-group start-up", "init_process_group": "the peak FLOP/s measurement",
               "peak_flops": "set-up", "setup": "set-up", "steps": "the end-of-run measurement",
               "final_peak_flops": "teardown", "teardown": "the final barrier"}


def torchrun_options(log_dir: Path) -> list[str]:
    """Each rank's output into its own file under log_dir, teed to torchrun's own output."""
    return [f"--log-dir={log_dir}", "--tee=3"]


@dataclass(frozen=True)
class Failure:
    reason: str          # one line for the record's `reason`
    details: dict        # the record's metrics["failure"]: kind, rank, exit_code, signal, step, log_tail


@dataclass(frozen=True)
class Outcome:
    rc: int                                  # torchrun's exit status; 124 when the supervisor ended the run
    failure: Failure | None                  # None when rc == 0
    wall_s: float
    interrupted: BaseException | None = None  # Ctrl-C or SIGTERM: the caller records, then re-raises


class Launch:
    """One torchrun process tree, watched until it ends; `run()` returns how it ended."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path, log_path: Path, progress_dir: Path,
                 timeout_s: float, quiet: bool, abort: Callable[[], str | None] = lambda: None, nproc: int = 0,
                 followers: int = 0):
        """followers: how many other nodes run torchruns of this run (bench.run.slurm_job.follow)."""
        self.cmd, self.env, self.cwd, self.log_path = cmd, env, cwd, log_path
        self.dir, self.timeout_s, self.quiet, self.abort, self.nproc = progress_dir, timeout_s, quiet, abort, nproc
        self.followers = followers
        self.lines: collections.deque[str] = collections.deque(maxlen=300)
        self.rank_lines: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL * 2))
        self.ranks: dict[int, psutil.Process] = {}     # rank -> its process, from its heartbeats
        self.stopped: set[int] = set()                 # ranks ever seen in state 'stopped'

    def run(self) -> Outcome:
        start, t0 = time.time(), time.perf_counter()
        ended, interrupted = None, None
        with open(self.log_path, "w") as log:
            proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
            reader = threading.Thread(target=self._read, args=(proc, log), daemon=True)
            reader.start()
            try:
                while ended is None:
                    try:
                        proc.wait(timeout=POLL_S)
                        break
                    except subprocess.TimeoutExpired:
                        ended = self._check(start)
            except BaseException as e:          # KeyboardInterrupt: Ctrl-C, or SIGTERM turned into one
                interrupted = e
                ended = self._interrupted(e)
            finally:
                self._kill(proc)
                reader.join(timeout=10)
        wall = time.perf_counter() - t0
        if ended is not None:
            return Outcome(124, ended, wall, interrupted)
        try:
            failure = None if proc.returncode == 0 else self._explain(proc.returncode)
        except KeyboardInterrupt as e:      # while waiting for the other nodes' summaries
            return Outcome(124, self._interrupted(e), wall, e)
        return Outcome(proc.returncode, failure, wall)

    # ---- while it runs ---------------------------------------------------------------------
    def _read(self, proc, log) -> None:
        for line in proc.stdout:
            log.write(line)
            text = line.rstrip("\n")
            self.lines.append(text)
            rank, body = _split_prefix(text)
            if rank is not None:
                self.rank_lines[rank].append(body)
            if body.startswith("[bench]") and not self.quiet:
                print(body, flush=True)

    def _check(self, start: float) -> Failure | None:
        beats = progress.read_beats(self.dir)
        for rank, beat in beats.items():
            # Another node's pid may name an unrelated process here, which _kill would then kill.
            if rank not in self.ranks and beat.get("host") == socket.gethostname():
                try:
                    p = psutil.Process(beat["pid"])
                    if any("bench.run.worker" in part for part in p.cmdline()):   # not a reused pid
                        self.ranks[rank] = p
                except psutil.Error:
                    pass
        idle = time.time() - max(start, progress.last_progress(self.dir, beats))
        if idle > 2 * POLL_S:           # process states are read only once the run has been still a while
            for rank, p in self.ranks.items():
                try:
                    if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                        self.stopped.add(rank)
                except psutil.Error:
                    pass
        outside = self.abort()
        if outside:
            return self._failure("outside", None, beats, reason=f"{outside}; run ended {_where(beats.get(0))}")
        if idle > self.timeout_s:
            return self._stalled(beats, idle)
        return None

    def _kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the whole tree (a stopped process too); this host's ranks whose torchrun is already gone
        are found through their heartbeats."""
        procs = list(self.ranks.values())
        if proc.poll() is None:     # not yet reaped, so its pid cannot name another process
            try:
                root = psutil.Process(proc.pid)
                procs = [*root.children(recursive=True), *procs]
                root.kill()
            except psutil.Error:
                pass
        for p in procs:
            try:
                p.kill()            # psutil checks the pid still names the same process
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        proc.wait()

    # ---- why it ended ----------------------------------------------------------------------
    def _stalled(self, beats: dict, idle: float) -> Failure:
        quiet = f"no progress for {idle:.0f} s (timeout_s={self.timeout_s:g}); run ended"
        if self.stopped:
            return self._failure("stopped", min(self.stopped), beats,
                                 how="stopped (process state 'stopped', e.g. SIGSTOP)", after=quiet)
        # Across nodes, NCCL ranks hang on a peer that died on another node where gloo's saw
        # the connection close: that node's summary names it.
        died = self._own_failures(self._follower_exits(wait=False))
        if died:
            rank = self._culprit(died, None)
            return self._ended(rank, died[rank], beats, after=quiet)
        if not beats:
            return self._failure("stalled", None, beats, reason=f"no rank reported progress: {quiet}")
        # No rank is stopped: name one that never reported, else the one that moved last longest
        # ago, and say where each is.
        silent = [r for r in range(self.nproc) if r not in beats]
        rank = silent[0] if silent else min(beats, key=lambda r: beats[r]["time"])
        where = ", ".join(f"rank {r} {_where(b)}" for r, b in sorted(beats.items()))
        return self._failure("stalled", rank, beats, how="stalled", after=f"{quiet} ({where})")

    def _interrupted(self, e: BaseException) -> Failure:
        beats = progress.read_beats(self.dir)
        what = str(e) or type(e).__name__
        return self._failure("interrupted", None, beats, reason=f"interrupted ({what}) {_where(beats.get(0))}")

    def _explain(self, rc: int) -> Failure:
        beats = progress.read_beats(self.dir)
        outside = self.abort()
        if outside:
            return self._failure("outside", None, beats, reason=f"{outside}; run ended {_where(beats.get(0))}")
        note = progress.read_failure(self.dir)
        if note and note.get("kind") == "nonfinite_loss":
            ranks = note.get("ranks") or []
            reason = (f"non-finite loss ({note.get('loss')}) at step {note['step']}"
                      + (f" (computed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
                         if ranks else "") + "; every rank stopped")
            return self._failure("nonfinite_loss", None, beats, reason=reason,
                                 extra={"step": note["step"], "ranks": ranks, "loss": note.get("loss")})
        text = "\n".join(self.lines)
        exits = _exit_codes(text)
        root = _FAILURE.findall(text.split("Root Cause")[-1]) if "Root Cause" in text else []
        for r, code in self._follower_exits(wait=True).items():
            exits.setdefault(r, code)
        rank = self._culprit(exits, int(root[0][0]) if root else None)
        if rank is None:
            return self._failure("launch", None, beats, reason=f"exit code {rc}: {_telling_line(list(self.lines))}")
        if rank in self.stopped:
            return self._failure("stopped", rank, beats, how="stopped (process state 'stopped', e.g. SIGSTOP)")
        return self._ended(rank, exits.get(rank), beats)

    def _ended(self, rank: int, code: int | None, beats: dict, after: str = "") -> Failure:
        if code is not None and code < 0:
            name = _signal_name(-code)
            return self._failure("signal", rank, beats, how=f"killed by {name}", after=after,
                                 extra={"exit_code": code, "signal": name})
        return self._failure("exit", rank, beats, how=f"exited with code {code}", after=after,
                             extra={"exit_code": code})

    def _follower_exits(self, wait: bool) -> dict[int, int]:
        """The other nodes' ranks' exit codes from their summaries (their last lines join
        rank_lines); `wait`: up to FOLLOWERS_WAIT_S for every follower's."""
        summaries = progress.read_node_summaries(self.dir) if self.followers else {}
        deadline = time.time() + FOLLOWERS_WAIT_S
        while wait and len(summaries) < self.followers and time.time() < deadline:
            time.sleep(POLL_S)
            summaries = progress.read_node_summaries(self.dir)
        exits = {}
        for summary in summaries.values():
            exits.update({int(r): int(code) for r, code in summary["exits"].items()})
            for r, lines in summary["lines"].items():
                self.rank_lines[int(r)].extend(lines)
        return exits

    def _culprit(self, exits: dict[int, int], root: int | None) -> int | None:
        """The rank that failed first in fact. One seen stopped; else, of the ranks that neither
        got the agent's teardown SIGTERM nor printed a reaction to a peer's failure, one killed
        by a signal, else torchrun's root cause, else the lowest; else torchrun's pick."""
        if self.stopped:
            return min(self.stopped)
        own = list(self._own_failures(exits))
        signalled = [r for r in own if exits[r] < 0]
        if signalled:
            return min(signalled)
        if own:
            return root if root in own else min(own)
        return root if root is not None else min(exits, default=None)

    def _own_failures(self, exits: dict[int, int]) -> dict[int, int]:
        """The ranks that neither got the agent's teardown SIGTERM nor printed a reaction to a peer's failure."""
        return {r: c for r, c in exits.items() if c != -signal.SIGTERM
                and not any(k in line for line in self.rank_lines[r] for k in CONSEQUENCES)}

    def _failure(self, kind: str, rank: int | None, beats: dict, *, how: str = "", after: str = "",
                 reason: str = "", extra: dict | None = None) -> Failure:
        beat = beats.get(rank) if rank is not None else None
        tail = [line for line in self.rank_lines.get(rank, []) if line.strip()][-TAIL:] if rank is not None else []
        if not reason:
            reason = f"rank {rank} {how} {_where(beat)}" + (f": {after}" if after else "")
            if tail:
                reason += "; last lines: " + " | ".join(line.strip() for line in tail[-REASON_LINES:])
        details = {"kind": kind, "rank": rank, "exit_code": None, "signal": None,
                   "step": beat.get("step") if beat else None, "phase": beat.get("phase") if beat else None,
                   "log_tail": tail, "positions": {str(r): _where(b) for r, b in sorted(beats.items())}}
        details.update(extra or {})
        return Failure(" ".join(reason.split())[:600], details)


def _exit_codes(text: str) -> dict[int, int]:
    """rank -> exit code, from torchrun's failure summary in `text`."""
    return {int(r): int(c) for r, c in _FAILURE.findall(text)}


def node_summary(lines: list[str]) -> dict:
    """What a node's torchrun output says of its ranks' ends, for node 0's `Launch` to weigh
    with its own: the exit code of each rank in its failure summary and those ranks' last lines."""
    exits = _exit_codes("\n".join(lines))
    tails: dict[int, collections.deque[str]] = collections.defaultdict(lambda: collections.deque(maxlen=TAIL * 2))
    for line in lines:
        rank, body = _split_prefix(line)
        if rank in exits:
            tails[rank].append(body)
    return {"exits": {str(r): c for r, c in exits.items()}, "lines": {str(r): list(t) for r, t in tails.items()}}


def _split_prefix(text: str) -> tuple[int | None, str]:
    """`[rank1]:[rank1]: Traceback` -> (1, "Traceback"): torchrun's prefix, then torch's own."""
    rank, m = None, _PREFIX.match(text)
    while m:
        rank, text = int(m.group(1)), text[m.end():]
        m = _PREFIX.match(text)
    return rank, text


def _where(beat: dict | None) -> str:
    if not beat:
        return "during start-up"
    if beat.get("phase") == "step":
        return f"at step {beat['step']}"
    return f"during {_NEXT_PHASE.get(beat.get('phase'), beat.get('phase'))}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _telling_line(lines: list[str]) -> str:
    """The most telling line of a failure nothing else explains: the first error that is not
    merely a reaction to another failure, else the last line."""
    errors = []
    for line in lines:
        text = _split_prefix(line)[1].strip()
        if any(k in text for k in ("Error:", "Exception:", "error:")):
            errors.append(text)
    causes = [e for e in errors if not any(c in e for c in CONSEQUENCES)]
    if causes or errors:
        return (causes or errors)[0][:400]
    return (lines[-1] if lines else "no output")[:400]
