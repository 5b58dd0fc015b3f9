"""Let megatron-core 0.16.1 run on the CPU with gloo.

megatron-core assumes CUDA in a few places (facts measured in ../shared/notes/cpu-backends.md):
hard-coded `device="cuda"` and `.cuda()` calls, `param.type() == 'torch.cuda.FloatTensor'`
checks in the optimizers, `torch.cuda.*` calls for streams, RNG and memory, and a CUDA RNG
state in the tensor-parallel RNG tracker. Everything that covers those lives here and is
installed only when the run's device is the CPU; on GPUs nothing here is touched.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU and reports CPU tensors as CUDA types."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return args[0].type().replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            args = (args[0], _to_cpu_device(args[1]) if not isinstance(args[1], torch.dtype) else args[1], *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return None


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.Stream = _CpuStream
    cuda.current_stream = lambda *a, **k: _CpuStream()
    cuda.default_stream = lambda *a, **k: _CpuStream()
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: None


def _patch_rng_tracker() -> None:
    """The TP RNG tracker forks CUDA generators; fork the CPU generator instead.

    Each named state (e.g. the model-parallel dropout RNG) keeps its own CPU generator state,
    swapped in for the `fork()` block and saved back after, as the CUDA version does.
    """
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            if name in self.states_:
                raise Exception(f"cpu rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cpu rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.get_cuda_rng_tracker = lambda *a, **k: mrandom._CUDA_RNG_STATE_TRACKER


def _patch_bridge_subgroups() -> None:
    """megatron's BridgeCommunicator creates its broadcast subgroups with backend='nccl'
    hard-coded; on the CPU they must use the default (gloo) backend."""
    import torch.distributed as dist
    original = dist.new_subgroups_by_enumeration

    def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None, pg_options=None):
        if backend == "nccl":
            backend = None
        return original(ranks_per_subgroup_list, timeout=timeout, backend=backend, pg_options=pg_options)

    dist.new_subgroups_by_enumeration = new_subgroups_by_enumeration


def install() -> CudaToCpuMode:
    """Patch torch.cuda and megatron for the CPU and enter the device-rewriting mode."""
    global _installed, _mode
    if _installed:
        return _mode
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_bridge_subgroups()
    _mode = CudaToCpuMode()
    _mode.__enter__()
    _installed = True
    return _mode


def import_deepspeed(device: torch.device):
    """`import deepspeed`; on the CPU without the shared-memory all-reduce op its CPU backend
    compiles (g++, ~40 s) when it first wraps the process group: only inference uses it."""
    import deepspeed
    if device.type == "cpu":
        import sys
        import deepspeed.comm.torch  # noqa: F401
        # sys.modules: `deepspeed.comm.torch` as an attribute is the torch package.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed
