"""DistributedOptimizer checkpoints at bucket-end padding (patches 0014 and 0015) on CPU ranks.

Every case runs the real ``get_megatron_optimizer`` (distributed optimizer over DDP buckets of a
small ``bucket_size``), ``DistributedOptimizer.sharded_state_dict`` and
``megatron.core.dist_checkpointing.save``/``load`` (torch_dist), then ``load_state_dict`` into an
optimizer built from another seed, and compares every local main param, exp_avg, exp_avg_sq and
step bitwise (``tests/scenarios/distopt_checkpoint.py``). Arms, world size 2, one launch per tree:
- fully_reshardable (0014, backport of PR 5077): pristine saves the state of every param past the
  first bucket from padded offsets (wrong values, zero-filled tails, upstream's "padded with
  zeros" warning); the fork restores every tensor.
- dp_reshardable (0015): pristine's plan for a bucket that ends at a 64-aligned offset (the one
  before a shared-embedding param) is rejected on rank 0 only ("Failed to validate global plan
  ... out of bounds chunk"), rank 1 writes its shard and waits (the checkpoint has no metadata);
  a rank that holds only bucket-end padding of the last or a middle bucket fails with "empty
  bucket encountered". The fork saves and restores every tensor.
- Property: seeded random geometries (3-7 params, sizes 1-400, bucket sizes 64-600 or one
  bucket, with or without a shared-embedding split), both sharding types, bf16 and fp32: the fork
  restores every tensor bitwise; at world size 4 a smaller set of geometries.
"""

import random

import pytest

from tests.harness import call
from tests.harness.bases import FORK, PRISTINE, upstream_has

TARGET = 'tests.scenarios.distopt_checkpoint:scenario_round_trips'
FR, DP = 'fully_reshardable', 'dp_reshardable'
STATE_KEYS = ('exp_avg', 'exp_avg_sq', 'param', 'step')

# Counterfactual cases. Geometries at world size 2 (bucket_size in elements, params laid out in
# reverse module order, each param start 64-aligned, bucket ends padded to a multiple of 128):
# MULTI: buckets (unpadded/padded) 264/384, 258/384, 70/128.
MULTI = dict(sizes=[70, 130, 90, 200, 33], bucket_size=150)
# SHARED_END: the 100- and 20-element params end at 148; the bucket ends at 192 (64-aligned start
# of the shared param), padded to 256: rank 1's shard [128, 256) must stop at 192.
SHARED_END = dict(sizes=[256, 20, 100], bucket_size=None, shared=0)
# A 16-element bucket padded to 128: rank 1's half [64, 128) is only padding.
PAD_TAIL = dict(sizes=[16, 300], bucket_size=200)
PAD_MIDDLE = dict(sizes=[300, 16, 300], bucket_size=200, shared=1)

COUNTERFACTUAL = [
    dict(name='fr_multi', sharding=FR, dtype='bf16', **MULTI),
    dict(name='fr_multi_mem_efficient', sharding=FR, dtype='fp32', mem_efficient=True, **MULTI),
    dict(name='dp_shared_end', sharding=DP, dtype='bf16', **SHARED_END),
    dict(name='dp_pad_tail', sharding=DP, dtype='bf16', **PAD_TAIL),
    dict(name='dp_pad_middle', sharding=DP, dtype='bf16', **PAD_MIDDLE),
]

# Upstream's warning text (distrib_optimizer.py, sharded_param_state_fully_reshardable).
ZERO_FILL = (
    "'{}' param range exceeds unpadded buffer by {} elements. It will be padded with zeros which"
    " can lead to data corruption."
)
PLAN_ERROR = (
    'ValueError: Failed to validate global plan: key:optimizer.distributed.dp_group_idx_0'
    '.gbuf_idx_0.dtype_(torch.bfloat16, torch.bfloat16).bucket_idx_0.param has out of bounds '
    'chunk: tensor-size:torch.Size([192]) chunk: ChunkStorageMetadata(offsets=torch.Size([148]), '
    'sizes=torch.Size([108]))'
)


def property_cases(world_size, count, seed):
    """Seeded random geometries, each with both sharding types (dp_reshardable in bf16 only:
    0.19.2's dp_reshardable load copies into fp32 main params that are autograd views)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        sizes = [rng.randint(1, 400) for _ in range(rng.randint(3, 7))]
        geometry = dict(
            sizes=sizes,
            bucket_size=rng.choice([None, rng.randint(64, 600)]),
            shared=rng.choice([None, rng.randrange(len(sizes))]),
        )
        dtype = rng.choice(['bf16', 'fp32'])
        cases.append(dict(name=f'w{world_size}_{i}_fr', sharding=FR, dtype=dtype, **geometry))
        cases.append(dict(name=f'w{world_size}_{i}_dp', sharding=DP, dtype='bf16', **geometry))
    return cases


PROPERTY_W2 = property_cases(2, 10, seed=5077)
# World size 4: four geometries whose ranks never fall entirely inside the 64-alignment gap
# between two params (that case still fails with "empty bucket encountered" on the fork too).
PROPERTY_W4 = [
    dict(name='w4_multi_fr', sharding=FR, dtype='bf16', **MULTI),
    dict(name='w4_multi_dp', sharding=DP, dtype='bf16', **MULTI),
    dict(name='w4_shared_end_dp', sharding=DP, dtype='bf16', **SHARED_END),
    dict(name='w4_pad_middle_dp', sharding=DP, dtype='bf16', **PAD_MIDDLE),
    dict(
        name='w4_wide_fr', sharding=FR, dtype='fp32', sizes=[1000, 333, 70, 129, 5], bucket_size=300
    ),
    dict(
        name='w4_wide_dp', sharding=DP, dtype='bf16', sizes=[1000, 333, 70, 129, 5], bucket_size=300
    ),
]

CALLS = {
    FORK: call(2, FORK, TARGET, cases=COUNTERFACTUAL + PROPERTY_W2, timeout=240),
    PRISTINE: call(2, PRISTINE, TARGET, cases=COUNTERFACTUAL, timeout=120),
    (FORK, 4): call(4, FORK, TARGET, cases=PROPERTY_W4, timeout=240),
}


def _cases(key):
    """{case name: [per-rank result]} of one call; a rank error fails the test."""
    per_rank = CALLS[key].result()
    out = {}
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, f'{key} rank {rank}: {res["error"]}'
        for case in res['cases']:
            assert 'error' not in case, f'{key} rank {rank} {case["name"]}: {case["error"]}'
            out.setdefault(case['name'], []).append(case)
    return out


def _assert_round_trip(name, per_rank):
    """Saved and loaded without error or warning, every local state tensor bitwise equal."""
    for rank, res in enumerate(per_rank):
        where = f'{name} rank {rank}'
        assert res['save_error'] is None and res['load_error'] is None, (where, res)
        assert res['save_warnings'] == [], (where, res['save_warnings'])
        assert res['mismatches'] == [], (where, res['mismatches'])
        # A rank may hold no param of the buffer at all (only bucket-end padding, world 4).
        params = {key.rsplit('.', 1)[0] for key in res['compared']}
        assert set(res['compared']) == {f'{p}.{k}' for p in params for k in STATE_KEYS}, where
    assert any(res['compared'] for res in per_rank), name


def _buckets(res):
    """[(padded, unpadded)] of the one grad buffer."""
    (buffer,) = res['geometry']
    return [tuple(b) for b in buffer]


@pytest.mark.parametrize('name', [c['name'] for c in COUNTERFACTUAL])
def test_fork_round_trip(name):
    _assert_round_trip(name, _cases(FORK)[name])


def test_geometries():
    """The counterfactual geometries are what the comments above say (at world size 2)."""
    cases = _cases(FORK)
    assert _buckets(cases['fr_multi'][0]) == [(384, 264), (384, 258), (128, 70)]
    assert _buckets(cases['dp_shared_end'][0]) == [(256, 192), (256, 256)]
    assert _buckets(cases['dp_pad_tail'][0]) == [(384, 300), (128, 16)]
    assert _buckets(cases['dp_pad_middle'][0]) == [(384, 300), (128, 16), (384, 300)]


def test_pristine_fully_reshardable_saves_shifted_state():
    """Pristine restores bucket 0 exactly and every param of buckets 1 and 2 wrongly."""
    cases = _cases(PRISTINE)
    if upstream_has('distopt-fully-reshardable-bucket-padding'):
        for name in ('fr_multi', 'fr_multi_mem_efficient'):
            _assert_round_trip(name, cases[name])
        return
    warnings = [ZERO_FILL.format('p.1', 50)] * 3 + [ZERO_FILL.format('p.0', 70)] * 3
    for name in ('fr_multi', 'fr_multi_mem_efficient'):
        per_rank = cases[name]
        # The warnings come from the ranks that build the model-space state on save: both with
        # the all-gather, rank 0 only with the memory-efficient gather.
        assert per_rank[0]['save_warnings'] == warnings
        assert per_rank[1]['save_warnings'] == ([] if name.endswith('efficient') else warnings)
        for rank, res in enumerate(per_rank):
            assert res['save_error'] is None and res['load_error'] is None
            wrong = {m['key'] for m in res['mismatches']}
            compared = set(res['compared'])
            assert wrong == {
                k for k in compared if not k.startswith('opt0.bucket0.') and not k.endswith('.step')
            }, (name, rank, sorted(wrong))
            assert wrong  # every param past the first bucket that this rank holds part of
            assert all(m['differ'] == m['numel'] for m in res['mismatches'])
        # The last param's tail is zero-filled (rank 1 holds the tail of bucket 2's param).
        zeros = {m['key']: m['loaded_zeros'] for m in per_rank[1]['mismatches']}
        assert zeros['opt0.bucket2.param0.exp_avg'] == zeros['opt0.bucket2.param0.param'] == 6


def test_pristine_dp_reshardable_plan_rejected_at_bucket_end():
    """Rank 0 (the coordinator) rejects the plan; rank 1 wrote its shard and is left waiting (the
    scenario answers its collectives); the checkpoint has rank 1's data but no metadata."""
    per_rank = _cases(PRISTINE)['dp_shared_end']
    assert per_rank[0]['save_error'].startswith(PLAN_ERROR), per_rank[0]['save_error']
    assert (
        per_rank[1]['save_error'] == 'CheckpointException: CheckpointException ranks:dict_keys([])'
    )
    for res in per_rank:
        assert '__1_0.distcp' in res['files'] and '.metadata' not in res['files'], res['files']


@pytest.mark.parametrize('name', ['dp_pad_tail', 'dp_pad_middle'])
def test_pristine_dp_reshardable_padding_only_shard(name):
    per_rank = _cases(PRISTINE)[name]
    assert per_rank[0]['save_error'] is None
    assert per_rank[1]['save_error'] == 'AssertionError: empty bucket encountered'
    assert per_rank[0]['files'] == per_rank[1]['files'] == []  # save never started


def test_property_world2():
    """Every random geometry round-trips bitwise, with both sharding types."""
    cases = _cases(FORK)
    for case in PROPERTY_W2:
        _assert_round_trip(case['name'], cases[case['name']])
    # The draws cover several buckets with end padding, ranks whose last shard ends before the
    # bucket's padded end, and ranks that hold only padding of some bucket.
    local = [(p, u, p // 2) for case in PROPERTY_W2 for p, u in _buckets(cases[case['name']][0])]
    assert sum(len(_buckets(cases[c['name']][0])) > 1 for c in PROPERTY_W2) >= 4
    assert any(u <= p - half for p, u, half in local)
    assert any(half < u < p for p, u, half in local)


def test_property_world4():
    cases = _cases((FORK, 4))
    for case in PROPERTY_W4:
        _assert_round_trip(case['name'], cases[case['name']])
