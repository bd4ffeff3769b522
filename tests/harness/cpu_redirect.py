"""Minimal redirect of the CUDA-only calls megatron-core makes on its DDP/optimizer/schedule path.

Test-only code: it is installed by tests/harness/worker.py in CPU worlds (gloo) and never ships in
the fork. Every redirected name, and why, is listed in tests/harness/README.md. Any other
``torch.cuda.<name>`` access raises :class:`UncoveredCudaCall` naming the API, so a new CUDA
dependency in the code under test shows up as a loud error instead of silent CPU behaviour.
"""

import contextlib
import os
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_REAL_CUDA = torch.cuda
_REAL_TENSOR_TYPE = torch.Tensor.type
_CPU = torch.device('cpu')


class UncoveredCudaCall(RuntimeError):
    """A torch.cuda API that the CPU redirect does not cover was used."""


class _DummyStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _DummyEvent:
    """Stands in for torch.cuda.Event: recorded work on CPU is already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = _DummyStream()

# name -> replacement. Names mapped to _PASS are forwarded to the real torch.cuda module.
_PASS = object()
COVERED = {
    # Buffers in param_and_grad_buffer.py are allocated with device=torch.cuda.current_device().
    'current_device': lambda: _CPU,
    # Streams/events: 0.19.2+ start_grad_sync calls current_stream() unconditionally.
    'Stream': _DummyStream,
    'Event': _DummyEvent,
    'current_stream': lambda device=None: _DEFAULT_STREAM,
    'default_stream': lambda device=None: _DEFAULT_STREAM,
    'stream': lambda s=None: contextlib.nullcontext(),
    'synchronize': lambda device=None: None,
    # Truthful answers from the real module on a machine without a usable GPU.
    'is_available': lambda: False,
    'device_count': lambda: 0,
    'is_initialized': lambda: False,
    # dev's p2p_communication asks before its pipeline sends/receives; no stream is captured.
    'is_current_stream_capturing': lambda: False,
    # Legacy tensor-type classes used at import time (transformer/module.py) for isinstance checks.
    'FloatTensor': _PASS,
    'HalfTensor': _PASS,
    'BFloat16Tensor': _PASS,
    # Decorators referenced at import time (tensor_parallel/layers.py); no CUDA work on CPU inputs.
    'amp': _PASS,
}


class _DeviceRngStandIn:
    """The one "device" generator of a CPU rank in pretrain mode (see pretrain_mode()).

    On a GPU, "device" kernels (dropout, the router's random logits) draw from the CUDA
    generator, and Megatron's RNG tracker swaps a stream's state into it for the length of a
    ``fork()``. On a CPU rank those kernels draw from torch's CPU generator, so that is the
    generator the tracker's states live in: under ``fork(name)`` a draw comes from the stream
    ``name``, as on a GPU, and a stream that a resume does not restore shows in what is drawn
    under its fork. (Seeding it seeds torch's CPU generator: initialize_megatron seeds both with
    the same number.)
    """

    def __init__(self):
        self.generator = torch.default_generator

    def manual_seed(self, seed):
        self.generator.manual_seed(int(seed))

    def get_rng_state(self, device='cuda'):
        return self.generator.get_state()

    def set_rng_state(self, new_state, device='cuda'):
        self.generator.set_state(new_state)


_DEVICE_RNG = _DeviceRngStandIn()

# Added by pretrain_mode() only (upstream pretrain(): initialize_megatron and the RNG tracker).
PRETRAIN_COVERED = {
    # initialize.py:337 builds the model-parallel groups and :398 seeds the RNG tracker only when
    # device_count() > 0; a CPU rank stands in for one device.
    'device_count': lambda: 1,
    # tensor_parallel/random.py:290-293/477 (model_parallel_cuda_manual_seed, tracker.add).
    'manual_seed': _DEVICE_RNG.manual_seed,
    'manual_seed_all': _DEVICE_RNG.manual_seed,
    'get_rng_state': _DEVICE_RNG.get_rng_state,
    'set_rng_state': _DEVICE_RNG.set_rng_state,
    # initialize.py:499 (_warmup_jit_function, called by pretrain()'s set_jit_fusion_options).
    'empty_cache': lambda: None,
    # training/utils/common_utils.py:287-290 (report_memory, from training_log after the first
    # logged iteration): a CPU rank has no device memory.
    'memory_allocated': lambda device=None: 0,
    'max_memory_allocated': lambda device=None: 0,
    'memory_reserved': lambda device=None: 0,
    'max_memory_reserved': lambda device=None: 0,
    # training/arguments.py (TP or CP > 1: get_device_arch_version() < 10 asks for
    # CUDA_DEVICE_MAX_CONNECTIONS=1, a setting of GPU work queues): a CPU rank stands in for a
    # device without that requirement.
    'get_device_properties': lambda device=None: types.SimpleNamespace(
        major=10, minor=0, name='CPU rank', total_memory=0, multi_processor_count=1
    ),
    # tensor_parallel/random.py:110 (_get_cuda_rng_state reads torch.cuda.random.get_rng_state).
    'random': types.SimpleNamespace(
        get_rng_state=_DEVICE_RNG.get_rng_state,
        set_rng_state=_DEVICE_RNG.set_rng_state,
        manual_seed=_DEVICE_RNG.manual_seed,
    ),
}
_ACTIVE = dict(COVERED)


def _set_device_rng_state(new_state, device=-1, graph_safe=False):
    """tensor_parallel/random.py's ``_set_cuda_rng_state`` on a CPU rank. Upstream's queues the
    set with ``torch.cuda._lazy_call``, which never runs without a CUDA context: a tracker's
    ``fork()`` would then neither swap its stream in nor put the previous state back."""
    _DEVICE_RNG.set_rng_state(new_state)


def patch_tracker_state_setter():
    """Make the RNG tracker's state sets take effect on CPU ranks (idempotent); returns the
    function it replaced (megatron is imported here, not at the redirect's import)."""
    from megatron.core.tensor_parallel import random as tp_random

    replaced = tp_random._set_cuda_rng_state
    tp_random._set_cuda_rng_state = _set_device_rng_state
    return replaced


@contextlib.contextmanager
def pretrain_mode():
    """Extend the redirect with PRETRAIN_COVERED while upstream pretrain() runs (CPU worlds)."""
    from megatron.core.tensor_parallel import random as tp_random

    saved = dict(_ACTIVE)
    _ACTIVE.update(PRETRAIN_COVERED)
    replaced = patch_tracker_state_setter()
    try:
        yield
    finally:
        tp_random._set_cuda_rng_state = replaced
        _ACTIVE.clear()
        _ACTIVE.update(saved)


# Added by megatron_fsdp_mode() only: Megatron-FSDP formats its device as f"cuda:{index}"
# (megatron_fsdp.py), so the current device must be an index; the redirect maps cuda:0 to the CPU.
MEGATRON_FSDP_COVERED = {'current_device': lambda: 0}


@contextlib.contextmanager
def megatron_fsdp_mode():
    """pretrain_mode() plus MEGATRON_FSDP_COVERED, for Megatron-FSDP on CPU ranks. A process
    whose ``FORK_CPU_REDIRECT_MODE`` is ``megatron_fsdp`` (tools/maint/dev_unit_bisect.sh, for an
    upstream-layout test that cannot enter it) is in it from install() on."""
    with pretrain_mode():
        _ACTIVE.update(MEGATRON_FSDP_COVERED)
        yield


# Modules whose torch.cuda accesses are checked: the code under test and the scenarios.
CHECKED_PREFIXES = ('megatron', 'tests')


class _CudaProxy(types.ModuleType):
    """Replaces the ``torch.cuda`` attribute.

    Accesses from megatron.* and tests.* get the redirect for covered names and
    UncoveredCudaCall for everything else; torch's own internals see the real module.
    """

    def __getattr__(self, name):
        caller = sys._getframe(1).f_globals.get('__name__', '')
        if not caller.startswith(CHECKED_PREFIXES) or caller.startswith('tests.harness.launcher'):
            return getattr(_REAL_CUDA, name)
        if name in _ACTIVE:
            value = _ACTIVE[name]
            return getattr(_REAL_CUDA, name) if value is _PASS else value
        if name.startswith('_'):
            # Private torch helpers bound by megatron (tensor_parallel/random.py imports
            # _lazy_call/_lazy_init); they only queue work for a CUDA context that never starts.
            return getattr(_REAL_CUDA, name)
        raise UncoveredCudaCall(
            f"torch.cuda.{name} is not covered by the CPU redirect "
            "(tests/harness/cpu_redirect.py); "
            f"called from {caller}; this code path needs a GPU or the redirect must be extended"
        )


def _is_cuda_device(value):
    if isinstance(value, torch.device):
        return value.type == 'cuda'
    if isinstance(value, str):
        return value == 'cuda' or value.startswith('cuda:')
    return False


def _uneven(args, kwargs):
    """A synchronous all_gather whose receive tensors differ in size (NCCL takes that; upstream
    dev's LayerWiseDistributedOptimizer.allgather_params relies on it; gloo refuses it)."""
    tensor_list = args[0] if args else kwargs.get('tensor_list')
    if kwargs.get('async_op') or not tensor_list:
        return False
    return len({t.numel() for t in tensor_list}) > 1


def _uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
    """all_gather of uneven sizes on gloo: pad every contribution to the largest, then slice."""
    size = max(t.numel() for t in tensor_list)
    padded = torch.zeros(size, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor.reshape(-1)
    gathered = [torch.empty(size, dtype=tensor.dtype) for _ in tensor_list]
    torch.distributed.all_gather(gathered, padded, group=group)
    for out, value in zip(tensor_list, gathered):
        out.copy_(value[: out.numel()].view_as(out))


class _CudaToCpuMode(TorchFunctionMode):
    """Maps device='cuda' (factories, .to) to CPU and makes Tensor.cuda() a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.distributed.all_gather and _uneven(args, kwargs):
            return _uneven_all_gather(*args, **kwargs)
        if 'device' in kwargs and (
            _is_cuda_device(kwargs['device']) or type(kwargs['device']) is int
        ):
            kwargs['device'] = _CPU
        if kwargs.get('pin_memory'):
            # Pinned host memory needs a CUDA driver (RoPE's CP slice asks for it).
            kwargs['pin_memory'] = False
        if func is torch.Tensor.to and args:
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    """Tensor.type(): CPU tensors report torch.cuda.<X>Tensor (distopt and clip_grads check it)."""
    if dtype is None:
        name = _REAL_TENSOR_TYPE(self)
        if (
            self.device.type == 'cpu'
            and name.startswith('torch.')
            and not name.startswith('torch.cuda.')
        ):
            return 'torch.cuda.' + name[len('torch.') :]
        return name
    if isinstance(dtype, str) and dtype.startswith('torch.cuda.'):
        dtype = 'torch.' + dtype[len('torch.cuda.') :]
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


_MODE = None


def install():
    """Install the redirect in this process (idempotent)."""
    global _MODE
    if _MODE is not None:
        return
    proxy = _CudaProxy('torch.cuda')
    proxy.__file__ = getattr(_REAL_CUDA, '__file__', None)
    torch.cuda = proxy
    torch.Tensor.type = _tensor_type
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    if os.environ.get('FORK_CPU_REDIRECT_MODE') == 'megatron_fsdp':
        _ACTIVE.update(PRETRAIN_COVERED)
        _ACTIVE.update(MEGATRON_FSDP_COVERED)


def installed():
    """Whether install() has run in this process."""
    return _MODE is not None
