"""Where the compiled MoE step loses to eager (issue 38): one process, the arms interleaved.

    PYTHONPATH=TREE python3 tools/maint/moe_step_bench.py [--experts 8] [--rounds 12]

Builds upstream's ``GPTModel`` with the local spec (the shape of ``tools/maint/gpu_moe_speed.sh``:
8 layers, hidden 1024, 16 heads, sequence 2048, micro-batch 1, bf16, SwiGLU, no linear biases;
``--experts 0`` is the dense control) on one GPU and times forward and backward of a step (no
optimizer: it is the same in every arm), synchronized at both ends. The arms differ only in which
``jit_fuser`` functions run compiled, switched between steps inside the one process, so the
machine's drift reaches every arm alike:

- ``compiled``: as the tree ships;
- ``eager``: every compiled function replaced by the Python function under it (no dynamo entry,
  as under ``TORCHDYNAMO_DISABLE=1``);
- ``act-eager``: only the experts' weighted activations (forward and backward) eager;
- ``bda-eager``: only ``bias_dropout_add_fused_train`` eager;
- ``rest-eager``: all but the experts' weighted activations eager;
- ``act-nested-eager``: the activations and the compiled functions they call (``swiglu``,
  ``swiglu_back``) eager: the activations as the ``eager`` arm runs them;
- ``actfwd-eager`` / ``actbwd-eager``: only the activations' forward / backward functions eager;
- ``only:NAME+NAME`` / ``except:NAME+NAME``: only those eager / all but those eager;
- ``small:N``: the fork's ``routed_token_fuser.SMALL_ELEMENTS`` set to N for the step (``small:0``:
  the experts' forward activations compiled at every size);
- ``noguard``: as ``compiled``, under ``set_stance(skip_guard_eval_unsafe=True)`` (what dynamo's
  guard checks cost per call; not a mode to ship).

Every compiled function that megatron's modules and classes hold is replaced by a switch between
the two (every arm pays the switch).

After ``--settle`` compiled and eager steps, ``--rounds`` rounds run ``--per`` steps of each arm
in turn; each arm prints the median and quartiles of its step times, and the graphs dynamo
compiled after the settling steps (0 is the claim of change 0049 for the fork).
"""

import argparse
import contextlib
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

_EAGER = set()  # names of the compiled functions that run eagerly in the current arm
_SWITCHED = {}  # id of a compiled function -> (its name, its switch)
_CALLS = {}  # name of a compiled function -> calls through its switch


def _is_compiled(obj):
    """Whether ``obj`` is a ``jit_fuser`` (``torch.compile``) function, or the fork's
    ``routed_token_fuser`` wrapper of one."""
    if not callable(obj) or not hasattr(obj, '__wrapped__'):
        return False
    code = getattr(obj, '__code__', None)
    return hasattr(obj, '_torchdynamo_orig_callable') or (
        code is not None and code.co_filename.endswith('routed_token_fuser.py')
    )


def _switch(obj, name):
    """A function that calls ``obj`` (compiled) or the Python function under it (eager, with no
    dynamo entry at all, as ``TORCHDYNAMO_DISABLE=1`` runs it) as ``_EAGER`` says."""
    if id(obj) not in _SWITCHED:
        import inspect

        eager = inspect.unwrap(obj)

        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                # Traced inside another compiled function (weighted_swiglu calls swiglu): the
                # graph inlines the compiled function, as in the shipped tree. Counting or
                # reading _EAGER here would put guards on them: a recompile per call up to the
                # limit, then the caller runs eagerly in every arm.
                return obj(*args, **kwargs)
            _CALLS[name] = _CALLS.get(name, 0) + 1
            return (eager if name in _EAGER else obj)(*args, **kwargs)

        _SWITCHED[id(obj)] = (name, call)
    return _SWITCHED[id(obj)][1]


def _switch_all():
    """Put a switch in place of every compiled function that megatron's modules and classes hold;
    returns their names."""
    import sys

    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith('megatron.') or module is None:
            continue
        for attr, obj in list(vars(module).items()):
            if _is_compiled(obj):
                setattr(module, attr, _switch(obj, attr))
            elif isinstance(obj, type) and obj.__module__ == mod_name:
                for key, member in list(vars(obj).items()):
                    if _is_compiled(member):
                        setattr(obj, key, _switch(member, f'{obj.__name__}.{key}'))
    return sorted({name for name, _ in _SWITCHED.values()})


def _model(experts):
    import torch.nn.functional as F

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if experts:
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=2,
            moe_token_dispatcher_type=os.environ.get('MOE_DISPATCHER', 'allgather'),
        )
    config = TransformerConfig(
        num_layers=8,
        hidden_size=1024,
        num_attention_heads=16,
        ffn_hidden_size=4096,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,  # as pretrain_gpt.py (--no-bias-dropout-fusion not given)
        bf16=True,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=32000, max_sequence_length=2048)
    return Float16Module(config, model.cuda())  # as megatron.training wraps it


def _graphs():
    from torch._dynamo.utils import counters

    return counters['stats']['unique_graphs']


def main():
    """Parse the arguments, settle, run the interleaved rounds, print a line per arm."""
    parser = argparse.ArgumentParser()
    parser.add_argument('--experts', type=int, default=8)
    parser.add_argument('--rounds', type=int, default=12)
    parser.add_argument('--per', type=int, default=3)
    parser.add_argument('--settle', type=int, default=12)
    parser.add_argument('--profile', type=int, default=0, help='then profile N steps per arm')
    parser.add_argument('--arms', default='compiled,eager,act-eager,bda-eager,rest-eager')
    parser.add_argument(
        '--gc-off',
        action='store_true',
        help='no automatic garbage collection in the timed rounds (one gc.collect() after each '
        'round, untimed): is the spread of the step times the collector?',
    )
    args = parser.parse_args()

    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', '29533')
    dist.init_process_group('nccl', rank=0, world_size=1)
    torch.cuda.set_device(0)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    model = _model(args.experts)
    names = _switch_all()
    print('switched:', ' '.join(names))
    act = {n for n in names if n.startswith('weighted_')}
    arms = {
        'compiled': set(),
        'eager': set(names),
        'act-eager': act,
        'bda-eager': {n for n in names if n.startswith('bias_dropout_add')},
        'rest-eager': set(names) - act,
        # The weighted SwiGLU functions call swiglu / swiglu_back (compiled too): eager alone
        # they leave those compiled, one more dynamo entry per call than the compiled arm.
        'act-nested-eager': act | ({'swiglu', 'swiglu_back'} & set(names)),
        'actfwd-eager': {n for n in act if not n.endswith('_back')},
        'actbwd-eager': {n for n in act if n.endswith('_back')},
        'noguard': set(),
    }
    gen = torch.Generator().manual_seed(1234)
    positions = torch.arange(2048, device='cuda').unsqueeze(0)

    try:
        from megatron.core.fusions import routed_token_fuser as rtf
    except ImportError:  # pristine
        rtf = None
    small = getattr(rtf, 'SMALL_ELEMENTS', None)

    def step(arm):
        _EAGER.clear()
        # small:N: the fork's routed_token_fuser with SMALL_ELEMENTS = N (small:0: every call of
        # 2 or more tokens compiled, as before change 0049 ran small forward calls eagerly)
        if small is not None:
            rtf.SMALL_ELEMENTS = int(arm[6:]) if arm.startswith('small:') else small
        if arm.startswith('small:'):
            pass
        elif arm.startswith('only:'):  # only:NAME+NAME eager
            _EAGER.update(arm[5:].split('+'))
        elif arm.startswith('except:'):  # all eager but NAME+NAME
            _EAGER.update(arms['eager'] - set(arm[7:].split('+')))
        else:
            _EAGER.update(arms[arm])
        tokens = torch.randint(32000, (1, 2048), generator=gen).cuda()
        labels = torch.randint(32000, (1, 2048), generator=gen).cuda()
        stance = (
            torch.compiler.set_stance('default', skip_guard_eval_unsafe=True)
            if arm == 'noguard'
            else contextlib.nullcontext()
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        with stance:
            loss = model(tokens, positions, None, labels=labels)
            loss.float().mean().backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    names = args.arms.split(',')
    for _ in range(args.settle):
        for arm in names:
            step(arm)
    settled = _graphs()
    _CALLS.clear()
    step(names[0])
    print('calls per step:', ', '.join(f'{k} {v}' for k, v in sorted(_CALLS.items())))
    times = {arm: [] for arm in names}
    if args.gc_off:
        gc.collect()
        gc.disable()
    for _ in range(args.rounds):
        for arm in names:
            for _ in range(args.per):
                times[arm].append(step(arm))
        if args.gc_off:
            gc.collect()
    gc.enable()
    ref = statistics.median(times[names[0]])
    # A busy host only adds time, so the lower quartile shows an arm's own cost with less of it.
    ref_low = statistics.quantiles(times[names[0]], n=4)[0]
    for arm in names:
        q = statistics.quantiles(times[arm], n=4)
        median = statistics.median(times[arm])
        print(
            f'experts {args.experts} {arm:10s} median {median * 1e3:7.2f} ms'
            f' (quartiles {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}), {median / ref:.3f} of {names[0]}'
            f' ({q[0] / ref_low:.3f} at the lower quartile)'
        )
    print(f'graphs compiled after settling: {_graphs() - settled}')
    for arm in names[: 2 if args.profile else 0]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile):
                step(arm)
        print(f'== profile {arm} ({args.profile} steps), by self CPU time')
        table = prof.key_averages().table(
            sort_by='self_cpu_time_total', row_limit=30, max_name_column_width=60
        )
        print(table)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
