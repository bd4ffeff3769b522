"""Issue 31 (MoE gradients), candidates 1-8: pristine upstream against an FP64 oracle, and the fork.

Router gradients (candidates 1-3): upstream's ``TopKRouter`` in megatron DDP on 2 CPU ranks at
TP 2 (sequence parallel), one forward over a seeded global batch, a zero main loss (only the aux
losses reach the router weight), the aux-loss scale the schedule sets and the real
``finalize_model_grads`` (tests/scenarios/moe_candidates.py). The oracle is the same router in
float64 in one process (TP 1, whole batch, mean loss): the gradient of the aux objective, which
upstream names as the target of the per-token path. The bound comes from the same run: a few
times the distance of that one-process run in float32 from float64.

Candidate 4 compares the expert-bias token counts with those of the same router over the valid
tokens only; candidate 5 runs the metrics tracker's ``report`` on PP = 2 where one stage has no
MoE layer (the PP group's timeout is 5 s, so the hang becomes an error); candidate 6 trains the
MoE layer with biases at EP = ETP = 1 (float32, and float64 in the same process as the oracle;
both against the layer written out in float64 without megatron code). The z-loss over a step
whose second microbatch is padding only (0047's count clamp) runs in the TP 2 router call.
"""

import math

import pytest
import torch

from tests.harness import call, tiers
from tests.harness.bases import BASE, FORK, PRISTINE
from tests.harness.bases import change_state as _state
from tests.harness.bases import tree_has_fix as _fixed
from tests.scenarios.moe_candidates import METRICS_PP_RECORDS

MOD = 'tests.scenarios.moe_candidates:'
TREES = (FORK, PRISTINE)
SEQ, BSZ = 8, 2


AUX_TP = 'moe-aux-loss-tp-scaling'  # 0030, backport of PR 5047
SEQ_BSZ = 'moe-seq-aux-loss-per-token-bsz'  # 0031, backport of PR 5798
BIAS_PAD = 'moe-expert-bias-padding-broadcast'  # 0032, backport of PR 6114
MLP_BIAS = 'moe-expert-bias-out-of-place'  # 0033
VALID_COUNT = 'moe-aux-loss-valid-token-count'  # 0034
SEQ_COUNT = 'moe-seq-aux-loss-token-count'  # 0035 (dev)
METRICS_PP = 'moe-metrics-pp-names'  # 0036
MTP_COUNTS = 'mtp-per-token-loss-microbatch-counts'  # 0043
OBJECTIVES = ('tokens', 'per_microbatch', 'reference')  # tests/scenarios/moe_candidates.py

LOSSES = ('aux_loss', 'seq_aux_loss', 'global_aux_loss', 'z')
CASES = [
    dict(
        name=f'{loss}-pt{int(pt)}-pad{int(pad)}',
        tp=2,
        loss=loss,
        per_token=pt,
        pad=pad,
        seq=SEQ,
        bsz=BSZ,
    )
    for loss in LOSSES
    for pt in (False, True)
    for pad in (False, True)
]
# z-loss over a step whose second microbatch is padding only (no TP rank holds a valid token),
# mean and per-token loss: run in the TP 2 call only; its reference is the padded case's.
PAD_ALL_CASES = [
    dict(name=f'z-pt{int(pt)}-padall', tp=2, loss='z', per_token=pt, pad='all', seq=SEQ, bsz=BSZ)
    for pt in (False, True)
]
# The replica's valid tokens in the padded batch (tests/scenarios/moe_candidates.py's mask).
VALID = SEQ * BSZ - SEQ // 4 - 1
BIAS_CASES = [
    dict(name='tokens_ne_experts', seq=8, bsz=2),
    dict(name='tokens_eq_experts', seq=2, bsz=2),
]

# Candidate 7 needs generalized TP (0.19.2 only): (GTP, EGTP) at TP = ETP = EP = 1.
HAS_GTP = _state('expert-gtp-grad-sync') is not None
GTP_LAYOUTS = [(1, 2), (2, 1), (2, 2), (1, 1)]
EXPERT_GTP_MEAN = 'expert-gtp-mean-loss-scaling'  # 0037 (0.19.2)
# (average_in_collective, (TP, ETP, GTP, EGTP)): on where upstream refuses it (GTP or EGTP > 1)
# and where it runs, one layout with dense params (TP = ETP) and one with expert buffers
# (ETP != TP), each also off (the reference of the same run).
GTP_AVG_REFUSED_LAYOUTS = [(1, 1, 1, 2), (1, 1, 2, 1), (1, 1, 2, 2)]
GTP_AVG_RUN_LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1)]
GTP_AVG_CASES = [(True, lay) for lay in GTP_AVG_REFUSED_LAYOUTS + GTP_AVG_RUN_LAYOUTS] + [
    (False, lay) for lay in GTP_AVG_RUN_LAYOUTS
]

CALLS = {}
for _tree in TREES:
    # One world of 2 ranks per tree; the references and the TP 1 cases run on each rank alone.
    CALLS[_tree, 'ref'] = call(2, _tree, MOD + 'scenario_router_grads', cases=CASES, reference=True)
    CALLS[_tree, 'bias'] = call(2, _tree, MOD + 'scenario_expert_bias_counts', cases=BIAS_CASES)
    CALLS[_tree, 'mlp'] = call(2, _tree, MOD + 'scenario_moe_bias_grads')
    CALLS[_tree, 'tp2'] = call(2, _tree, MOD + 'scenario_router_grads', cases=CASES + PAD_ALL_CASES)
    CALLS[_tree, 'mtp'] = call(2, _tree, MOD + 'scenario_mtp_microbatches')
    for _gtp, _egtp in GTP_LAYOUTS if HAS_GTP else ():
        CALLS[_tree, 'gtp', _gtp, _egtp] = call(
            2,
            _tree,
            'tests.scenarios.expert_gtp_grads:scenario_expert_gtp_sync',
            tp=1,
            etp=1,
            gtp=_gtp,
            egtp=_egtp,
            per_token=False,
        )
    # average_in_collective on (0037 corrects the other branch only), and TP 2 / ETP 1 off.
    for _avg, (_tp, _etp, _gtp, _egtp) in GTP_AVG_CASES if HAS_GTP else ():
        CALLS[_tree, 'gtp-avg', _avg, _tp, _etp, _gtp, _egtp] = call(
            2,
            _tree,
            'tests.scenarios.expert_gtp_grads:scenario_expert_gtp_sync',
            reuse=True,
            tp=_tp,
            etp=_etp,
            gtp=_gtp,
            egtp=_egtp,
            per_token=False,
            **({'average_in_collective': True} if _avg else {}),
        )
    # The failing report last: its PP group stays broken for the rest of the world.
    CALLS[_tree, 'pp-force'] = call(2, _tree, MOD + 'scenario_metrics_pp', force_initialize=True)
    CALLS[_tree, 'pp'] = call(2, _tree, MOD + 'scenario_metrics_pp')
    # PP 4, MoE layers on stages 2 and 3 only (world 4: it shares the suite's world of 4 ranks).
    # Pristine's report waits out the PP group's timeout: 1 s there (the suite's time).
    CALLS[_tree, 'pp4-force'] = call(
        4, _tree, MOD + 'scenario_metrics_pp', force_initialize=True, layout='pp4-late'
    )
    CALLS[_tree, 'pp4'] = call(
        4,
        _tree,
        MOD + 'scenario_metrics_pp',
        layout='pp4-late',
        **({'timeout_s': 1} if _tree == PRISTINE else {}),
    )


def _result(tree, key, rank=0):
    res = CALLS[(tree, *key) if isinstance(key, tuple) else (tree, key)].result()[rank]
    assert 'error' not in res, (tree, key, res)
    return res


def _router(tree):
    """{case: (grad of TP rank 0, oracle float64, bound)} from this tree's own runs."""
    ref = {c['name']: c for c in _result(tree, 'ref')['cases']}
    out = {}
    for rank in (0, 1):
        for c in _result(tree, 'tp2', rank)['cases']:
            if c['name'] not in ref:  # PAD_ALL_CASES: test_z_loss_padding_only_microbatch
                continue
            assert 'error' not in c and 'error' not in ref[c['name']], (tree, c, ref[c['name']])
            r64 = torch.tensor(ref[c['name']]['ref64'], dtype=torch.float64)
            r32 = torch.tensor(ref[c['name']]['ref32'], dtype=torch.float64)
            eps = torch.finfo(torch.float32).eps
            bound = 8 * float((r32 - r64).abs().max()) + 16 * eps * float(r64.abs().max())
            got = torch.tensor(c['grad'], dtype=torch.float64)
            if rank == 1:  # the grad after finalize is the same on every TP rank
                assert torch.equal(got, out[c['name']][0]), (tree, c['name'])
            out[c['name']] = (got, r64, bound)
    return out


def _factor(got, ref, bound, factor):
    """got equals factor * ref within factor * bound (and not ref itself where factor != 1)."""
    err = float((got - factor * ref).abs().max())
    ok = err <= max(factor, 1.0) * bound
    if factor != 1:
        ok = ok and float((got - ref).abs().max()) > 100 * bound
    return ok, err


def _pristine_factor(name):
    """What pristine upstream does, per base (got / oracle) at TP 2 with 13 of 16 tokens valid."""
    loss, pt, pad = name.split('-')
    per_token, padded = pt == 'pt1', pad == 'pad1'
    if not per_token:
        return 1.0
    tp = 2
    if BASE == '0.18.2':
        # No TP x CP factor in the per-token rescale (PR 5047 missing). With padding the count is
        # the TP-reduced one (candidate 1), which happens to supply it for aux and global aux.
        # seq aux also misses its micro-batch size (PR 5798): the count is per sequence.
        if loss == 'z':
            return 1 / tp
        if loss == 'seq_aux_loss':
            return (1.0 if padded else 1 / tp) / BSZ
        return 1.0 if padded else 1 / tp
    if BASE == '0.19.2':
        # PR 5047 multiplies the count by TP x CP, and with padding the count was already reduced
        # over TP x CP in place (candidate 1).
        return tp if padded and loss != 'z' else 1.0
    # dev: aux and seq aux scale by the reduced total_num_tokens, which is per sequence for seq aux
    # (floor of valid / bsz); global aux adds the TP x CP reduction to the overwritten count.
    if loss == 'seq_aux_loss':
        return (VALID // BSZ) / VALID if padded else 1 / BSZ
    if loss == 'global_aux_loss' and padded:
        return tp
    return 1.0


# z-loss with padding under the mean loss: pristine averages each TP rank's mean over its own
# valid tokens, so uneven padding over the TP chunks weights tokens unequally (0047 found by the
# layout oracle; tests/test_moe_oracle.py covers its other cases).
Z_MEAN_PADDED = 'z-pt0-pad1'
Z_VALID = 'moe-z-loss-valid-token-mean'  # 0047


def test_oracle_control():
    """Mean loss without padding: every loss at TP 2 equals the one-process float64 gradient on
    both trees (the harness, the data split and the oracle agree)."""
    for tree in TREES:
        for name, (got, ref, bound) in _router(tree).items():
            if name.split('-')[1:] == ['pt0', 'pad0']:
                assert float(ref.abs().max()) > 1e3 * bound, (tree, name)
                ok, err = _factor(got, ref, bound, 1.0)
                assert ok, (tree, name, err, bound)


@pytest.mark.parametrize('tree', TREES)
def test_router_grads(tree):
    """Candidates 1-3: per case, the router grad is the oracle's times the factor the tree's code
    gives (pristine: per base, the derivation in _pristine_factor; fork: 1 wherever it ships the
    fix)."""
    fork_fixes = {
        'aux': _fixed(tree, AUX_TP),
        'seq': _fixed(tree, SEQ_BSZ) or _fixed(tree, SEQ_COUNT),
        'count': _fixed(tree, VALID_COUNT),
    }
    wrong = {}
    for name, (got, ref, bound) in _router(tree).items():
        if name == Z_MEAN_PADDED:
            ok, err = _factor(got, ref, bound, 1.0)
            if _fixed(tree, Z_VALID):
                assert ok, (tree, name, err, bound)
            else:
                assert not ok and err < 0.1 * float(ref.abs().max()), (tree, name, err)
            continue
        factor = _pristine_factor(name) if tree == PRISTINE else 1.0
        if tree == FORK and not all(fork_fixes.values()):
            factor = None
        if factor is None:
            continue
        ok, err = _factor(got, ref, bound, factor)
        if not ok:
            wrong[name] = (factor, err, bound, float((got @ ref) / (ref @ ref)))
    assert not wrong, (tree, BASE, wrong)
    if tree == PRISTINE:  # the candidates reproduce where the table says
        assert any(_pristine_factor(c['name']) != 1.0 for c in CASES)


@pytest.mark.parametrize('tree', TREES)
def test_z_loss_padding_only_microbatch(tree):
    """A microbatch in which no TP x CP rank holds a valid token (the second of two; TP 2): the
    logged z-loss and the router grad stay finite. That microbatch adds nothing: its logged
    z-loss is 0 and the step's grad is the padded one-microbatch case's (same tree, same call)
    times 1 / 2 under the mean loss (the schedule's 1 / num_microbatches), times 1 under
    per-token loss (its count adds no token); on a tree with 0047 that is the oracle's too.

    Pristine upstream has no such bug (z_loss_func clamps its count at 1): the case guards 0047's
    share num_local / num_tokens over the group, 0 / 0 without its clamp."""
    router = _router(tree)
    for rank in (0, 1):
        got = {c['name']: c for c in _result(tree, 'tp2', rank)['cases']}
        for case in PAD_ALL_CASES:
            res = got[case['name']]
            assert 'error' not in res, (tree, res)
            logged, grad = res['logged'], torch.tensor(res['grad'], dtype=torch.float64)
            assert bool(torch.isfinite(grad).all()), (tree, case['name'], grad)
            assert all(map(math.isfinite, logged)), (tree, case['name'], logged)
            assert len(logged) == 2 and logged[0] > 0 and logged[1] == 0.0, (tree, case, logged)
            pt = case['per_token']
            padded = f"z-pt{int(pt)}-pad1"
            one, ref, bound = router[padded]
            factor = 1.0 if pt else 0.5
            assert float((grad - factor * one).abs().max()) <= bound, (tree, case['name'])
            if _fixed(tree, Z_VALID):
                ok, err = _factor(grad, ref, bound, factor)
                assert ok, (tree, case['name'], err, bound)


# ------------------------------------------------------------------------------------------
# 4: expert-bias token counts with a padding mask.

BROADCAST_ERROR = 'Attempting to broadcast a dimension of length 16 at -1!'


@pytest.mark.parametrize('tree', TREES)
def test_expert_bias_counts(tree):
    cases = {c['name']: c for c in _result(tree, 'bias')['cases']}
    ne, eq = cases['tokens_ne_experts'], cases['tokens_eq_experts']
    assert sum(ne['want']) == VALID * 2 and sum(eq['want']) == 3 * 2  # TOPK per valid token
    if _fixed(tree, BIAS_PAD) or BASE == 'dev':
        assert ne.get('error') is None and ne['got'] == ne['want'], ne
        assert eq.get('error') is None and eq['got'] == eq['want'], eq
    else:
        # 16 tokens x 4 experts & a [16] mask: a shape error; 4 tokens x 4 experts: the mask of
        # token j is applied to expert j, silently.
        assert ne['error'].startswith('RuntimeError: The size of tensor a (4) must match'), ne
        assert 'tensor b (16) at non-singleton dimension 1' in ne['error'], ne
        assert eq.get('error') is None and eq['got'] != eq['want'], eq
        assert sum(eq['got']) == sum(eq['want']), eq  # the same total, other experts


# ------------------------------------------------------------------------------------------
# 5: the metrics tracker's report on PP = 2 where stage 1 has no MoE layer, and on PP = 4 where
# only the last two stages have MoE layers.

PP_TIMEOUT = 'Timed out waiting 5000ms for recv operation to complete'
PP4_TIMEOUT = 'Timed out waiting 1000ms for recv operation to complete'  # pristine's 'pp4'


def _metrics_want(layout):
    """What report() logs per name: the recorded values summed over the stages' layers, over
    the layers (loss scale 1, DP 1). The values are binary fractions: float32 sums them exactly."""
    num_layers, records = METRICS_PP_RECORDS[layout]
    want = {}
    for recs in records:
        for name, _layer, value in recs:
            want[name] = want.get(name, 0.0) + value
    return {name: value / num_layers for name, value in want.items()}


@pytest.mark.parametrize('tree', TREES)
def test_metrics_pp(tree):
    forced = [_result(tree, 'pp-force', r) for r in (0, 1)]
    assert [r['report_error'] for r in forced] == [None, None], forced
    assert forced[0]['log'] == forced[1]['log'] != '', forced
    assert [r['scalars'] for r in forced] == [_metrics_want('pp2')] * 2, forced
    plain = [_result(tree, 'pp', r) for r in (0, 1)]
    if _fixed(tree, METRICS_PP):
        assert [r['report_error'] for r in plain] == [None, None], plain
        assert [r['log'] for r in plain] == [forced[0]['log']] * 2, plain
        assert [r['scalars'] for r in plain] == [_metrics_want('pp2')] * 2, plain
    else:
        # Stage 0 all-reduces its entry over PP, stage 1 has none and skips it: stage 0 waits.
        error = plain[0]['report_error']
        assert error.startswith('RuntimeError: ') and PP_TIMEOUT in error, plain
        assert plain[1] == {'stage': 1, 'report_error': None, 'log': '', 'scalars': {}}, plain


@pytest.mark.same_run_bitwise  # exact sums of recorded values: no kernel rounding in the claim
@pytest.mark.parametrize('tree', TREES)
def test_metrics_pp_late_stages(tree):
    """PP 4 where only stages 2 and 3 hold MoE layers: stage 2 records z_loss then
    load_balancing_loss, stage 3 load_balancing_loss only (METRICS_PP_RECORDS['pp4-late']). Every
    stage logs what force_initialize logs, and each name's value is its own sum: 0036 orders the
    agreed names alike on every stage (not by a stage's own first: that order pairs stage 3's
    load_balancing_loss with the others' z_loss in the PP all-reduce) and takes them from every
    stage (not the last one's only: z_loss would be lost). Pristine: the two MoE stages wait in
    the PP all-reduce that stages 0 and 1 never enter."""
    want = _metrics_want('pp4-late')
    assert sorted(want) == ['load_balancing_loss', 'z_loss'], want
    forced = [_result(tree, 'pp4-force', r) for r in range(4)]
    assert [r['stage'] for r in forced] == [0, 1, 2, 3], forced
    assert [r['report_error'] for r in forced] == [None] * 4, forced
    assert [r['scalars'] for r in forced] == [want] * 4, forced
    assert len({r['log'] for r in forced}) == 1 and forced[0]['log'] != '', forced
    plain = [_result(tree, 'pp4', r) for r in range(4)]
    if _fixed(tree, METRICS_PP):
        assert [r['report_error'] for r in plain] == [None] * 4, plain
        assert [r['scalars'] for r in plain] == [want] * 4, plain
        # The same segments as the forced log (in the agreed order: the first recording stage's).
        segments = sorted(forced[0]['log'].split('|'))
        assert [sorted(r['log'].split('|')) for r in plain] == [segments] * 4, plain
    else:
        for stage in (0, 1):
            assert plain[stage] == {
                'stage': stage,
                'report_error': None,
                'log': '',
                'scalars': {},
            }, plain
        for stage in (2, 3):
            error = plain[stage]['report_error']
            assert error.startswith('RuntimeError: ') and PP4_TIMEOUT in error, plain


# ------------------------------------------------------------------------------------------
# 6: the MoE layer with biases at EP = ETP = 1.

INPLACE_ERROR = (
    'RuntimeError: Output 0 of _ReduceFromModelParallelRegion is a view and is being modified'
    ' inplace.'
)


@pytest.mark.parametrize('tree', TREES)
def test_moe_bias_ep1(tree):
    res = _result(tree, 'mlp')
    if _fixed(tree, MLP_BIAS):
        assert 'train_error' not in res and 'ref_error' not in res, res
        eps = torch.finfo(torch.float32).eps
        for name, ref in res['ref64'].items():
            got = torch.tensor(res['grads'][name], dtype=torch.float64)
            ref = torch.tensor(ref, dtype=torch.float64)
            # float32 of a 2-matmul layer over 16 tokens: a bound in units of float32 eps.
            bound = 256 * eps * max(float(ref.abs().max()), 1.0)
            assert float((got - ref).abs().max()) <= bound, (name, got, ref)
        # Independent of the MLP's bias path: the fc2 bias grads from the router's probabilities.
        assert sorted(res['bias_want']) == sorted(n for n in res['ref64'] if 'fc2.bias' in n)
        for name, want in res['bias_want'].items():
            want = torch.tensor(want, dtype=torch.float64)
            assert float(want.abs().max()) > 0, name
            ref = torch.tensor(res['ref64'][name], dtype=torch.float64)
            assert float((ref - want).abs().max()) <= 1e-12 * float(want.abs().max()), name
        # Independent of the layer's code: the same layer written out in float64 (autograd over
        # plain tensors). The router grads hold a share that comes only through the fc2 bias
        # term (its probabilities times bias . probe), far above the bound: a bias term cut from
        # the router's graph, which both dtypes above would share, fails here.
        term = torch.tensor(res['hand_bias_term']['router.weight'], dtype=torch.float64)
        for name, want in res['hand'].items():
            want = torch.tensor(want, dtype=torch.float64)
            # Upstream takes the top-k softmax in float32 whatever the router dtype.
            bound = 256 * eps * max(float(want.abs().max()), 1.0)
            if name == 'router.weight':
                assert float(term.abs().max()) > 1e3 * bound, (term, bound)
            for key in ('ref64', 'grads'):
                got = torch.tensor(res[key][name], dtype=torch.float64)
                assert float((got - want).abs().max()) <= bound, (key, name, got, want)
    else:
        assert res['train_error'].startswith(INPLACE_ERROR), res
        assert res['ref_error'].startswith(INPLACE_ERROR), res


# ------------------------------------------------------------------------------------------
# 8: MTP under per-token loss over gradient-accumulation microbatches.


@pytest.mark.parametrize('tree', TREES)
def test_mtp_microbatch_counts(tree):
    """Two microbatches with 11 / 9 and 3 / 2 valid main / MTP tokens. Pristine rescales each
    microbatch's MTP loss by its own N / M (0019 sums the counts over DP x CP, not over
    microbatches): the grads equal the float64 objective with per-microbatch ratios, not the
    fork's objective (every MTP token weighted scale / N_step, like a main token) nor the
    per-token mean of the MTP term. The fork (0043) equals its objective and not pristine's."""
    res = _result(tree, 'mtp')
    assert res['counts'] == [[11.0, 9.0], [3.0, 2.0]], res['counts']
    eps = torch.finfo(torch.float32).eps
    fixed = _fixed(tree, MTP_COUNTS)
    for name, got in res['grads'].items():
        got = torch.tensor(got, dtype=torch.float64)
        want = {k: torch.tensor(res[k][name], dtype=torch.float64) for k in OBJECTIVES}
        bound = 64 * eps * max(float(want['tokens'].abs().max()), 1.0)
        match = 'tokens' if fixed else 'per_microbatch'
        assert float((got - want[match]).abs().max()) <= bound, (name, match)
        for other in OBJECTIVES:
            if other != match:
                assert float((got - want[other]).abs().max()) > 100 * bound, (name, other)


# ------------------------------------------------------------------------------------------
# 7: expert grads under the mean loss when expert GTP != GTP (0.19.2).


def _gtp_ratios(res):
    """{param: grad after the sync / the mean over the data shards} of one rank's result."""
    ratios = {}
    for name, got in res['grad_after_sync'].items():
        want = res['correct_grad_after_sync'][name] / res['data_shards']
        if res['gtp_sharded'][name]:
            want *= res['config_egtp']
        assert len(got) == 1, (name, got)
        ratios[name] = got[0] / want
    return ratios


@tiers.skipif(not HAS_GTP, 'no-gtp', f'base {BASE} has no generalized TP')
@pytest.mark.parametrize('tree', TREES)
def test_expert_gtp_mean_loss(tree):
    """tests/scenarios/expert_gtp_grads.py with the mean loss: every rank writes 2 ** rank into
    each main_grad (what GTP's backward leaves: a reduce-scatter mean over the (expert) GTP group
    for a sharded weight, the local grad for a replicated one), then DDP and finalize_model_grads.
    The mean over the D data shards is the sum over the replicas of the shard, times EGTP for a
    GTP-sharded expert weight (its value is already a mean over EGTP shards of data), / D."""
    ratios = {}
    for gtp, egtp in GTP_LAYOUTS:
        for rank in (0, 1):
            res = _result(tree, ('gtp', gtp, egtp), rank)
            for name, ratio in _gtp_ratios(res).items():
                ratios[gtp, egtp, rank, name] = ratio
    if _fixed(tree, EXPERT_GTP_MEAN):
        assert set(ratios.values()) == {1.0}, ratios
        return
    # Pristine 0.19.2 also lacks 0021: where EGTP != GTP its expert params are synced as dense
    # ones, which at GTP 2 / EGTP 1 happens to give the mean and at GTP 1 / EGTP 2 sums each
    # weight shard with the other rank's (0021's bug, 1.5x and 0.75x); the factor GTP / EGTP
    # appears once 0021 puts them in the expert buffers (the mutation of 0037 shows it).
    wrong = {k: r for k, r in ratios.items() if r != 1.0}
    assert wrong == {
        (1, 2, 0, 'fc1.weight'): 1.5,
        (1, 2, 0, 'fc2.weight'): 1.5,
        (1, 2, 1, 'fc1.weight'): 0.75,
        (1, 2, 1, 'fc2.weight'): 0.75,
    }, wrong


GTP_AVG_REFUSED = (
    'AssertionError: GTP requires average_in_collective=False (the default); averaged collectives'
    ' reduce over the GTP-excluded group and would miss the 1/gtp_remat gradient scaling factor.'
)


@tiers.skipif(not HAS_GTP, 'no-gtp', f'base {BASE} has no generalized TP')
@pytest.mark.parametrize('tree', TREES)
def test_expert_gtp_average_in_collective(tree):
    """0037 corrects the expert pre-scale of the average_in_collective=False branch only. That
    is its whole scope because upstream's DDP refuses average_in_collective wherever GTP or
    expert GTP is above 1 (EGTP != GTP implies one of them is): with it on, GTP = EGTP = 1 gives
    the mean over the data shards, the same grads as with it off (TP = ETP = 1: dense buffers;
    TP 2 / ETP 1: expert buffers and their pre-scale edp / dp), and every layout with GTP or
    EGTP = 2 is refused at construction. Upstream's own guard and branch: pristine does the same
    (this case guards 0037's scope, not a bug of pristine)."""
    for layout in GTP_AVG_REFUSED_LAYOUTS:
        per_rank = CALLS[(tree, 'gtp-avg', True, *layout)].result()
        assert [r.get('error') for r in per_rank] == [GTP_AVG_REFUSED] * 2, (layout, per_rank)
    for layout in GTP_AVG_RUN_LAYOUTS:
        for rank in (0, 1):
            on = _result(tree, ('gtp-avg', True, *layout), rank)
            off = _result(tree, ('gtp-avg', False, *layout), rank)
            # (1, 1, 1, 1): dense buffers; TP 2 / ETP 1: expert buffers (the expert pre-scale).
            want_buffer = 'expert' if layout[0] != layout[1] else 'dense'
            assert set(on['buffer'].values()) == {want_buffer}, (layout, on)
            assert set(_gtp_ratios(on).values()) == {1.0}, (layout, rank, on)
            assert on['grad_after_sync'] == off['grad_after_sync'], (layout, rank, on, off)
            assert set(on['correct_grad_after_sync'].values()) == {3.0}, on  # 2 ** 0 + 2 ** 1
