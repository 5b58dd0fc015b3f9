"""The whole MLLM, or one pipeline stage of it, under a single monolithic layout.

Stage 0 holds the encoder and the start of the backbone, the last stage the end of the
backbone and the generator (Megatron-LM's placement for multimodal models). With one stage
it is the whole model, which is what DeepSpeed and the single-process reference train.
With virtual pipeline stages (interleaved 1F1B) a rank holds `vpp_size` such stages, chunk
`vp_stage` being virtual stage vp_stage x pp_size + pp_rank of pp_size x vpp_size.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from workloads.init import canonical_init_
from workloads.model import Backbone, ImageEncoder, ImageGenerator, module_config


class MLLMStage(MegatronModule):
    def __init__(self, workload, *, tp_size: int, pp_size: int, pp_rank: int, pg, dtype: torch.dtype, seed: int,
                 sequence_parallel: bool = False, vpp_size: int = 1, vp_stage: int | None = None,
                 attention: str = "local"):
        b = workload.backbone
        config = module_config(b, tp_size=tp_size, pp_size=pp_size, gated=True, dtype=dtype,
                               num_query_groups=b.num_query_groups)
        if sequence_parallel or vpp_size > 1:
            # Sequence parallelism in the backbone only (see systems/megatron/layout.py).
            config = dataclasses.replace(config, sequence_parallel=sequence_parallel,
                                         virtual_pipeline_model_parallel_size=vpp_size if vpp_size > 1 else None)
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder   # what megatron's schedules expect
        self.share_embeddings_and_output_weights = False  # untied, as in Llama 3
        v = vp_stage or 0
        self.pre_process = pp_rank == 0 and v == 0
        self.post_process = pp_rank == pp_size - 1 and v == vpp_size - 1
        tp_rank = pg.tp.rank() if pg.tp is not None else 0
        init = dict(seed=seed, tp_rank=tp_rank, tp_size=tp_size)
        if self.pre_process:
            self.encoder = ImageEncoder(workload, module_config(workload.encoder, tp_size=tp_size, gated=False,
                                                                dtype=dtype), pg, attention)
            canonical_init_(self.encoder, prefix="encoder", **init)
        self.backbone = Backbone(workload, config, pg, pre_process=self.pre_process, post_process=self.post_process,
                                 vp_stage=vp_stage, attention=attention)
        offset = self.backbone.decoder.layers[0].layer_number - 1 if len(self.backbone.decoder.layers) else 0
        canonical_init_(self.backbone, prefix="backbone", layer_offset=offset, gated=True, **init)
        if self.post_process:
            self.generator = ImageGenerator(workload, module_config(workload.generator, tp_size=tp_size,
                                                                    gated=False, dtype=dtype), pg, attention)
            canonical_init_(self.generator, prefix="generator", **init)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.backbone.set_input_tensor(input_tensor)

    def forward(self, mb):
        canvas = self.encoder(mb) if self.pre_process else None
        out = self.backbone(mb, canvas)
        if not self.post_process:
            return out
        lm_loss, cond = out
        return lm_loss, self.generator(mb, cond)
