"""The job side of `bench sweep --launcher slurm` (bench.run.slurm submits): what one SLURM job
runs on each of its nodes. Node 0 runs the run exactly as a local sweep does (bench.run.runner);
the other nodes join its torchrun rendezvous (`follow`)."""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path

from bench.config import RunConfig
from bench.run import progress, runner, supervise

FOLLOW_GRACE_S = 30.0        # a follower's torchrun still up this long after node 0 finished is ended


def master_port(job_id: str) -> int:
    """The same port on every node of a job without talking: from the job id (20000-39999)."""
    digits = re.sub(r"\D", "", job_id)
    return 20000 + int(digits or 0) % 20000


def rendezvous(count: int, hosts: list[str], node: int, job_id: str, work: Path) -> runner.Nodes:
    """This node's part of a run across `count` nodes: node 0 of SLURM_JOB_NODELIST is the master."""
    if len(hosts) != count:
        raise RuntimeError(f"the job has {len(hosts)} nodes ({','.join(hosts)}), the run needs {count}")
    return runner.Nodes(count=count, rank=node, master_addr=hosts[0], master_port=master_port(job_id), work=work)


def job_nodes(spec) -> runner.Nodes | None:
    """This node's rendezvous of a multi-node job (`spec`: a bench.run.slurm.JobSpec), None on one node."""
    if spec.resources.nodes == 1:
        return None
    import submitit
    env = submitit.JobEnvironment()
    return rendezvous(spec.resources.nodes, list(env.hostnames), env.node, env.job_id,
                      env.paths.folder / f"{env.job_id}_work")


def run_job(spec) -> dict:
    """The job function (on every node): node 0 runs the run as a local sweep would; the others follow.
    Returns the outcome the submitting process prints (node 0's is the run's)."""
    nodes = job_nodes(spec)
    if nodes is not None and nodes.rank != 0:
        return follow(spec.cfg, nodes, spec.results)
    try:
        record = runner.run(spec.cfg, spec.layout, spec.results, spec.wandb_mode, quiet=True,
                            repeat=spec.repeat, nodes=nodes)
    except KeyboardInterrupt:         # scancel (SIGTERM): the runner recorded the run 'interrupted'
        return {"status": "interrupted", "reason": "job cancelled", "run_id": None}
    finally:
        if nodes is not None:       # also when the run failed before it made `work`: followers stop waiting
            nodes.work.mkdir(parents=True, exist_ok=True)
            (nodes.work / "finished").touch()
    return {"status": record["status"], "reason": record["reason"], "run_id": record["run_id"]}


def follow(cfg: RunConfig, nodes: runner.Nodes, results: Path) -> dict:
    """A node other than 0: once node 0 wrote launch.json, torchrun this node's ranks into the same
    rendezvous; end them if they outlive node 0's run by FOLLOW_GRACE_S; leave node 0 what this
    node's torchrun said of its ranks' ends (bench.run.supervise.node_summary)."""
    import psutil
    finished = nodes.work / "finished"
    deadline = time.time() + cfg.timeout_s
    while not nodes.launch_file.exists():
        if finished.exists() or time.time() > deadline:
            return {"node": nodes.rank, "status": "not started", "reason": "node 0 never started the run"}
        time.sleep(1)
    launch = json.loads(nodes.launch_file.read_text())
    cmd = runner.torchrun_command(cfg, nodes.work / "config.json", Path(launch["dataset"]), nodes.work / "result.json",
                                  nodes.master_port, nodes.work, nodes)
    env = runner.launch_env(cfg, dict(launch["env"]) | {runner.RUN_ID_ENV: launch["run_id"]})
    log = results.parent / "logs" / f"{launch['run_id']}.node{nodes.rank}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out, runner.sigterm_interrupts():
        proc = subprocess.Popen(cmd, cwd=runner.REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            seen = None
            while proc.poll() is None:
                if finished.exists():
                    seen = seen or time.time()
                    if time.time() - seen > FOLLOW_GRACE_S:
                        break
                time.sleep(1)
        except KeyboardInterrupt:         # scancel: node 0 records the run; end this node's ranks
            pass
        finally:
            if proc.poll() is None:
                procs = _tree(psutil, proc.pid)
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                psutil.wait_procs(procs, timeout=10)
            proc.wait()
            lines = log.read_text(errors="replace").splitlines()
            progress.write_node_summary(nodes.work / "progress", nodes.rank, supervise.node_summary(lines))
    return {"node": nodes.rank, "status": "exited", "reason": f"torchrun exit code {proc.returncode}", "log": str(log)}


def _tree(psutil, pid: int) -> list:
    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]
    except psutil.Error:
        return []
