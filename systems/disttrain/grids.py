"""Per-module process groups on megatron-core's HyperCommGrid.

Group creation is collective over the whole world, so every rank builds every module's grid
and creates its groups in the same order, members or not (../shared/notes/bridge.md).
"""
from __future__ import annotations

import torch.distributed as dist


def build_grid(tp: int, pp: int, dp: int, rank_offset: int, cp: int = 1):
    """cp: the module's context-parallel size (the plan's ModulePlan.cp; measured plans keep 1,
    systems.disttrain.plan.CP_MEASURED, so the expert groups below may alias the CP ones)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid([tp, cp, pp, dp], ["tp", "cp", "pp", "dp"], rank_offset=rank_offset)
    groups = {name: grid.create_pg(dims) for name, dims in (
        ("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"), ("dp_cp", ["cp", "dp"]),
        ("mp", ["tp", "pp"]), ("tp_cp", ["tp", "cp"]), ("tp_dp_cp", ["tp", "cp", "dp"]),
        ("module", ["tp", "cp", "pp", "dp"]))}
    member = rank_offset <= dist.get_rank() < rank_offset + tp * cp * pp * dp
    pg = ProcessGroupCollection()
    if member:
        module_group = groups.pop("module")
        for name, group in groups.items():
            setattr(pg, name, group)
        # No experts: the expert groups coincide with the dense ones (cp is a singleton).
        pg.expt_dp, pg.intra_dp_cp, pg.expt_tp, pg.ep, pg.tp_ep_pp = pg.dp, pg.dp_cp, pg.tp, pg.cp, pg.mp
        pg.tp_ep = pg.tp
        pg.embd = pg.pos_embd = pg.inter_dist_opt = None
        # One distributed-optimizer instance per module: its gradient norm sums over all the
        # module's ranks (megatron's grad_stats_parallel_group), not its DP group alone.
        pg.intra_dist_opt = module_group
    return grid, pg, member
