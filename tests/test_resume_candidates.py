"""Issue 30, candidates 1-6: what pristine upstream does on resume (CPU ranks, gloo).

Every case goes through the real save/load path (``tests/scenarios/resume_candidates.py``):
``get_megatron_optimizer`` with the distributed optimizer, ``sharded_state_dict``,
``dist_checkpointing.save``/``load``, ``load_state_dict`` and, for candidates 1-2, the
``OptimizerParamScheduler``'s ``state_dict``/``load_state_dict`` in ``load_checkpoint``'s order.
The expectations are today's pristine behaviour per base; every comparison is against the other
arm of the same run (the run that never stopped, or a run built with the resume arguments from the
start), never a number measured once.
"""

from tests.harness import call
from tests.harness.bases import BASE, PRISTINE

SCHED = 'tests.scenarios.resume_candidates:scenario_scheduler'
ROUND = 'tests.scenarios.resume_candidates:scenario_round_trips'
DP, FR, FS = 'dp_reshardable', 'fully_reshardable', 'fully_sharded_model_space'

# Where upstream already has the fix (the base contains the upstream commit).
FIXED = {
    # 232c478d43 (PR 5213): override mode restores the per-group max_lr/min_lr/start_wd/end_wd.
    'override-scheduler': BASE == 'dev',
    # 27e312ca10 (PR 4705): every ParamGroupOverride key identifies a param group on load.
    'group-identifier': BASE == '0.19.2',
    # ceaa6c5d7e (PR 5835): group-order map rebuilt for mixed fp32/16-bit groups; load copies
    # under no_grad.
    'mixed-dtype': BASE == 'dev',
}

# Three plain params; p.1 gets a per-module override in the group-collision cases.
SMALL = dict(sizes=[40, 24, 8], bucket_size=None, dtype='bf16', steps=3)
P1 = '*.p.1'

SCHED_CASES = [
    # 1: a new --lr with --override-opt-param-scheduler on resume.
    dict(name='c1_override_new_lr', sharding=DP, resume_lr=5e-3, override_flag=True, **SMALL),
    # 1: the same with a per-module LR override whose value changes on resume.
    dict(
        name='c1_override_new_group_lr',
        sharding=DP,
        resume_lr=5e-3,
        override_flag=True,
        overrides=[(P1, {'max_lr': 2e-2, 'min_lr': 2e-3})],
        resume_overrides=[(P1, {'max_lr': 4e-3, 'min_lr': 4e-4})],
        **SMALL,
    ),
    # 2: groups that differ only in max_lr/min_lr (resume with unchanged arguments).
    dict(
        name='c2_group_lr',
        sharding=DP,
        overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        resume_overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        **SMALL,
    ),
    dict(
        name='c2_group_lr_fr',
        sharding=FR,
        overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        resume_overrides=[(P1, {'max_lr': 3e-2, 'min_lr': 3e-3})],
        **SMALL,
    ),
    # 2: groups that differ only in start_wd/end_wd.
    dict(
        name='c2_group_wd',
        sharding=DP,
        overrides=[(P1, {'start_wd': 0.1, 'end_wd': 0.1})],
        resume_overrides=[(P1, {'start_wd': 0.1, 'end_wd': 0.1})],
        **SMALL,
    ),
]

# 3: one fp32 param between two bf16 params, all in one param group (the bf16 buffer comes
# first, so the group-order map built over the buffers disagrees with the installed order
# [fp32 shards, fp32 copies of bf16 shards]).
MIXED = dict(sizes=[150, 100, 90], dtypes=['bf16', 'fp32', 'bf16'], dtype='bf16', bucket_size=None)
# Buffer order: bf16 [p.2 at 0, p.0 at 64] (128), fp32 [p.1] (128): at world 2 each rank holds
# 64 elements of one bf16 param and 64 of the fp32 one.
SAME_SIZE = dict(sizes=[64, 128, 64], dtypes=['bf16', 'fp32', 'bf16'], dtype='bf16',
                 bucket_size=None, steps=2)
# 6: one large param and five small ones: rank 0's shard lies inside the large one (1 entry),
# the last rank's shard spans the small ones.
UNEVEN = dict(sizes=[3, 5, 7, 2, 9, 1000], dtype='bf16', bucket_size=None)
TORCH = dict(sizes=[70, 130, 90], dtype='bf16', bucket_size=None, steps=3)

ROUND_W2 = [
    dict(name='c3_mixed_dp', sharding=DP, steps=2, **MIXED),
    dict(name='c3_mixed_fs', sharding=FS, steps=2, **MIXED),
    # 3, silent: every rank's pieces of the fp32 param and of its bf16 param have one size, so the
    # stale map swaps their state without a size error.
    dict(name='c3_same_size_dp', sharding=DP, check_content=True, **SAME_SIZE),
    dict(name='c3_same_size_fr', sharding=FR, check_content=True, **SAME_SIZE),
    dict(name='c3_fp32_dp', sharding=DP, steps=2, sizes=[150, 100, 90], dtype='fp32',
         bucket_size=None),
    # 5: the FusedAdam layout (control) and torch's Adam/AdamW, fresh and stepped loads.
    dict(name='c5_fused_dp_fresh', sharding=DP, adam='fused', check_content=True, **TORCH),
    dict(name='c5_fused_fr_fresh', sharding=FR, adam='fused', check_content=True, **TORCH),
    dict(name='c5_adam_dp_fresh', sharding=DP, adam='torch', **TORCH),
    dict(name='c5_adam_fr_fresh', sharding=FR, adam='torch', **TORCH),
    dict(name='c5_adam_dp_stepped', sharding=DP, adam='torch', load_steps=1, **TORCH),
    dict(name='c5_adamw_dp_stepped', sharding=DP, adam='torch_w', load_steps=1, **TORCH),
    dict(name='c5_adam_fr_stepped', sharding=FR, adam='torch', load_steps=1, **TORCH),
    dict(name='c5_adamw_fr_stepped', sharding=FR, adam='torch_w', load_steps=1, **TORCH),
    # 6: uneven params, dp_reshardable, one optimizer and a chained (dense + expert) one.
    dict(name='c6_uneven_dp', sharding=DP, steps=2, **UNEVEN),
    dict(name='c6_uneven_dp_torch', sharding=DP, steps=2, adam='torch', load_steps=1, **UNEVEN),
    dict(name='c6_uneven_chained', sharding=DP, steps=2, sizes=[3, 5, 7, 2, 9, 1000, 6, 700],
         expert=[6, 7], dtype='bf16', bucket_size=None),
    # 3, last (a failing save may leave the world less tidy): fully_reshardable.
    dict(name='c3_mixed_fr', sharding=FR, steps=2, **MIXED),
]

ROUND_W4 = [
    # 4: params [1, 64] in buffer order: 1 element at 0, the next param starts at 64 (aligned);
    # the 128-element bucket gives each of 4 ranks 32 elements: rank 1's [32, 64) is all gap.
    dict(name='c4_gap_dp', sharding=DP, steps=2, sizes=[64, 1], dtype='bf16', bucket_size=None),
    dict(name='c4_gap_fr', sharding=FR, steps=2, sizes=[64, 1], dtype='bf16', bucket_size=None),
    dict(name='c6_uneven_dp_w4', sharding=DP, steps=2, **UNEVEN),
]

CALLS = {
    'sched': call(2, PRISTINE, SCHED, cases=SCHED_CASES, timeout=240),
    'w2': call(2, PRISTINE, ROUND, cases=ROUND_W2, timeout=300),
    'w4': call(4, PRISTINE, ROUND, cases=ROUND_W4, timeout=240),
}
