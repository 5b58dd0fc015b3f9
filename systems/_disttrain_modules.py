"""Build one module of the MLLM (or one backbone stage) with its own process groups."""
from __future__ import annotations

from workloads.init import canonical_init_
from workloads.model import Backbone, ImageEncoder, ImageGenerator, module_config


def build_module(name: str, workload, mp, pg, dtype, seed: int, device):
    """(module, its TransformerConfig) for `name` on this rank; weights are the canonical
    ones every other system starts from (same global parameter names)."""
    shape = getattr(workload, name)
    tp_rank = pg.tp.rank()
    if name == "backbone":
        pp_rank = pg.pp.rank()
        config = module_config(shape, tp_size=mp.tp, pp_size=mp.pp, gated=True, dtype=dtype,
                               num_query_groups=shape.num_query_groups)
        module = Backbone(workload, config, pg, pre_process=pp_rank == 0, post_process=pp_rank == mp.pp - 1)
        layers = module.decoder.layers
        offset = layers[0].layer_number - 1 if len(layers) else 0
        canonical_init_(module, prefix="backbone", seed=seed, tp_rank=tp_rank, tp_size=mp.tp,
                        layer_offset=offset, gated=True)
    else:
        config = module_config(shape, tp_size=mp.tp, gated=False, dtype=dtype)
        module = (ImageEncoder if name == "encoder" else ImageGenerator)(workload, config, pg)
        canonical_init_(module, prefix=name, seed=seed, tp_rank=tp_rank, tp_size=mp.tp)
    return module.to(device), config
