"""Issue 31's MoE gradient oracle: every gradient of a small MoE GPT in every parallel layout
equals the FP64 gradient of the same model and global batch in one process.

tests/scenarios/moe_oracle.py runs upstream's GPTModel (local spec, 4 local SwiGLU experts top-2,
a shared expert, expert bias, aux + seq aux + global aux losses, z-loss, MTP depth 1 in some
cases) through the real schedule (2 microbatches, uneven valid tokens), megatron DDP (distributed
optimizer on and off) and finalize_model_grads on CPU ranks. The oracle is the same model at
TP = EP = PP = CP = 1 in one process, float64, with the objective of ``objective_weights`` /
``mtp_weight`` (tests/scenarios/moe_oracle.py) and the global aux loss of its definition at any
DP size (docs/moe-gradients.md, section 10: one loss of the global batch per microbatch index m,
f over every DP rank's microbatches 0..m); the bound of
each parameter comes from the same one-process run in float32: 8x its distance from float64 plus
16 float32 eps of the largest element. The MoE metrics that the tracker's ``report()`` logs (as a
library calls it, per layer) are compared the same way. Model variants (``MODEL_CASES``): linear
biases at EP = ETP = 1 (candidate 6) and a dense first layer under PP (candidate 5).

Per tree and base, a case is expected to equal the oracle unless a change of patches/changes.toml
that it exercises is missing from the tree (``_breaks``); a pristine case is expected to fail
(an upstream error, or some parameter beyond its bound) exactly where ``_breaks`` names one.

Global aux: the one-process oracle cannot run upstream's global aux loss (its running counts
would cover the other DP ranks' microbatches one by one), so it runs the model without it and
writes the loss out from the router's scores and routing, with tests/scenarios/global_aux_loss.py's
definition (``_GlobalAux`` in tests/scenarios/moe_oracle.py); every DP rank's microbatch m runs
forward before any of them backward. Without 0053 (``global-aux-loss-definition``) a case misses
it at DP > 1 (the DP ranks' shares averaged; per-token loss with a padding mask at TP x CP = 1 is
right there by accident) and wherever a padding mask makes U_0 and U_1 hold different counts of
valid tokens (f), at DP 1 too.

CP layouts (cp2, cp2ep2, tp2cp2, cp2pp2, cp4): upstream's local DotProductAttention asserts
CP == 1 (CP attention is Transformer Engine's), so these cases run a stand-in core attention
(tests/scenarios/moe_oracle_cp.py: upstream's DotProductAttention over the K and V all-gathered
over the CP group, causal by global position); everything else is upstream's at the case's CP
size (the load-balanced split by get_batch_on_this_cp_rank, RoPE's CP slice, the router's
TP x CP reductions, MTP's roll across CP ranks, DDP over DP x CP, finalize_model_grads, the
schedule). Under the mean loss the oracle is the mean of the CP ranks' own masked means
(``objective_weights``).

Virtual pipeline (tp2pp2vpp2): 4 layers, 2 model chunks of one layer per stage, the interleaved
schedule, one data iterator per chunk; the oracle is the same 4-layer model in one process.
"""

import pytest
import torch

from tests.harness import call
from tests.harness.bases import BASE, FORK, PRISTINE
from tests.harness.bases import change_state as _state
from tests.harness.bases import tree_has_fix as _fixed
from tests.scenarios import moe_oracle as oracle

MOD = 'tests.scenarios.moe_oracle:'
BIAS_RATE = 1e-2  # tests/scenarios/moe_oracle.py's
TREES = (FORK, PRISTINE)


AUX_TP = 'moe-aux-loss-tp-scaling'  # 0030 (candidate 2)
SEQ_BSZ = 'moe-seq-aux-loss-per-token-bsz'  # 0031 (candidate 3, releases)
BIAS_PAD = 'moe-expert-bias-padding-broadcast'  # 0032 (candidate 4)
VALID_COUNT = 'moe-aux-loss-valid-token-count'  # 0034 (candidate 1)
SEQ_COUNT = 'moe-seq-aux-loss-token-count'  # 0035 (candidate 3, dev)
MTP_DP = 'mtp-per-token-loss-dp-counts'  # 0019
MTP_MICROBATCHES = 'mtp-per-token-loss-microbatch-counts'  # 0043 (candidate 8)
SP_ROLL = 'mtp-padding-mask-sequence-parallel-roll'  # 0044 (found by this oracle)
MLP_BIAS = 'moe-expert-bias-out-of-place'  # 0033 (candidate 6)
METRICS_PP = 'moe-metrics-pp-names'  # 0036 (candidate 5)
Z_METRIC = 'moe-z-loss-metric-tp-average'  # 0046 (found by this oracle's metrics)
Z_VALID = 'moe-z-loss-valid-token-mean'  # 0047 (found by this oracle's metrics)
GLOBAL_AUX = 'global-aux-loss-definition'  # 0053 (issue 39 item 3)

# name: (world, layout). Every layout of world 2 and 4 that the local spec runs without CP; the
# dense DP size is what TP x PP leaves (dp2ep2: dense DP 4, expert DP 2; ep4: expert DP 1).
LAYOUTS = {
    'dp2': (2, {}),
    'tp2': (2, {'tp': 2}),
    'ep2': (2, {'ep': 2}),
    'pp2': (2, {'pp': 2}),
    'tp2ep2': (4, {'tp': 2, 'ep': 2}),
    'tp2pp2': (4, {'tp': 2, 'pp': 2}),
    'ep2pp2': (4, {'ep': 2, 'pp': 2}),
    'tp2ep2etp1': (4, {'tp': 2, 'ep': 2, 'etp': 1}),
    'dp2ep2': (4, {'ep': 2}),
    'ep4': (4, {'ep': 4}),
    # CP (attention: tests/scenarios/moe_oracle_cp.py's stand-in; cp2ep2: dense DP 2).
    'cp2': (2, {'cp': 2}),
    'cp2ep2': (4, {'cp': 2, 'ep': 2}),
    'tp2cp2': (4, {'tp': 2, 'cp': 2}),
    'cp2pp2': (4, {'cp': 2, 'pp': 2}),
    'cp4': (4, {'cp': 4}),
    # Virtual pipeline: 2 model chunks per stage, one layer each (4 layers; the interleaved
    # schedule): with TP 2 (sequence parallel) stage 0's second chunk and stage 1's first are
    # neither the first nor the last stage, and route their chunk of the padding mask too (0048).
    'tp2pp2vpp2': (4, {'tp': 2, 'pp': 2, 'vpp': 2}),
}
# Per layout: (per-token loss, padding mask, distributed optimizer, MTP); together they turn each
# of the four on and off. Only the first two discriminate a candidate: the pristine arm runs
# those (PRISTINE_VARIANTS).
VARIANTS = {
    'pt1-pad1-do1': (True, True, True, False),
    'pt1-pad0-do0': (True, False, False, False),
    'pt0-pad1-do0': (False, True, False, False),
    'pt0-pad0-do1-mtp': (False, False, True, True),
    'pt1-pad1-do0-mtp': (True, True, False, True),
    'pt0-pad1-do0-mtp': (False, True, False, True),
    'pt1-pad0-do0-mtp': (True, False, False, True),
}
PRISTINE_VARIANTS = ('pt1-pad1-do1', 'pt1-pad0-do0', 'pt0-pad1-do0-mtp')
# The CP layouts run these only (the file's time): per-token + mask + distopt, mean loss +
# mask, per-token + MTP (MTP's roll crosses the CP ranks). Mean loss with MTP is not covered
# under CP: each CP rank's MTP term is its own mean, and the reference attaches one scale per
# microbatch to the model's MTP loss.
CP_ALL = ('pt1-pad1-do1', 'pt0-pad1-do0', 'pt1-pad0-do0-mtp')
CP_VARIANTS = {
    'cp2': CP_ALL,
    # + MTP with a mask: the padding mask rolled across CP ranks.
    'tp2cp2': CP_ALL + ('pt1-pad1-do0-mtp',),
    'cp2ep2': ('pt1-pad1-do1', 'pt0-pad1-do0'),
    'cp2pp2': ('pt1-pad1-do1', 'pt1-pad0-do0-mtp'),
    'cp4': ('pt0-pad1-do0',),
}
# The virtual-pipeline layout runs this only (the file's time): per-token + mask + distopt.
VPP_VARIANTS = {'tp2pp2vpp2': ('pt1-pad1-do1',)}
# The mean-loss MTP case with a padding mask pins 0044 (the MTP layer rolls the padding mask of
# its sequence-parallel chunk): it runs where TP > 1 only.
TP_ONLY_VARIANTS = ('pt0-pad1-do0-mtp',)


# Model variants on some layouts (name suffix: keyword of the case): linear biases in every
# linear layer (candidate 6: the MoE layer at EP = ETP = 1 adds its bias in place on a view) and
# a dense first layer (candidate 5: under PP its stage records no MoE metric; world 2 only).
MODEL_VARIANTS = {'lbias': 'linear_bias', 'dense1': 'dense_first'}
MODEL_CASES = {
    FORK: [
        ('dp2', 'pt1-pad1-do1', 'lbias'),
        ('pp2', 'pt0-pad0-do1-mtp', 'lbias'),
        ('ep2', 'pt1-pad1-do1', 'lbias'),
        ('tp2ep2etp1', 'pt1-pad0-do0', 'lbias'),
        ('pp2', 'pt0-pad1-do0', 'dense1'),
        ('dp2', 'pt0-pad0-do1-mtp', 'dense1'),
    ],
    # Only where every rank raises at the same point, or the PP report times out (its own group):
    # a rank that raises alone leaves its peers waiting until the world's budget.
    PRISTINE: [('dp2', 'pt1-pad0-do0', 'lbias'), ('pp2', 'pt1-pad0-do0', 'dense1')],
}
# Candidate 8 on pristine (no 0043): per-token MTP in a world-2 and a world-4 layout.
PRISTINE_MTP_CASES = [('dp2', 'pt1-pad1-do0-mtp'), ('ep2pp2', 'pt1-pad1-do0-mtp')]


def _case(layout_name, variant, bias=True, model=None):
    world, layout = LAYOUTS[layout_name]
    per_token, pad, distopt, mtp = VARIANTS[variant]
    tp, pp, cp = layout.get('tp', 1), layout.get('pp', 1), layout.get('cp', 1)
    dp = world // (tp * pp * cp)
    suffix = ('' if bias else '-nobias') + (f'-{model}' if model else '')
    return dict(
        name=f'{layout_name}-{variant}{suffix}',
        world=world,
        layout=layout,
        layers=pp * layout.get('vpp', 1) if 'vpp' in layout else oracle.LAYERS,
        dp=dp,
        cp=cp,
        lb=['aux_loss', 'seq_aux_loss', 'global_aux_loss'],
        z=True,
        mtp=mtp,
        per_token=per_token,
        pad=pad,
        distopt=distopt,
        bias=bias,
        # What MTP's roll of the padding mask puts in the last position: dev fills a padding
        # flag (multi_token_prediction.py's fill per field), the releases' roll_tensor fills 0.
        mtp_last_padded=BASE == 'dev',
        linear_bias=model == 'lbias',
        dense_first=model == 'dense1',
    )


# Where pristine lacks candidate 4's fix, the expert bias with a padding mask raises in the
# forward (a rank that raises leaves its pipeline and TP peers waiting): the pristine cases with
# a padding mask run without the expert bias there, and the error itself on DP 2 (every rank
# raises at the same point).
BIAS_PAD_BROKEN = not _fixed(PRISTINE, BIAS_PAD)
# TP x PP with a padding mask: without 0048 GPTModel scatters the padding mask to the
# sequence-parallel chunks only on the first stage; later stages route their chunk with the
# whole mask and raise (`The size of tensor a (8) must match the size of tensor b (16) at
# non-singleton dimension 0`) while their peers wait: run only where the tree has 0048 (with
# virtual pipeline chunks too: there a chunk can be neither the first stage nor the last).
TP_PP_MASK = 'gpt-padding-mask-sequence-parallel-every-stage'  # 0048 (found by this oracle)


def _variants(layout_name, variants, tree):
    lay = LAYOUTS[layout_name][1]
    tp, pp, cp = lay.get('tp', 1), lay.get('pp', 1), lay.get('cp', 1)
    mask_hangs = tp > 1 and pp > 1 and not _fixed(tree, TP_PP_MASK)
    if 'vpp' in lay:
        variants = [v for v in variants if v in VPP_VARIANTS[layout_name]]
    return [
        v
        for v in variants
        if (v in CP_VARIANTS[layout_name] if cp > 1 else v != 'pt1-pad0-do0-mtp')
        and not (VARIANTS[v][1] and mask_hangs)
        and not (v in TP_ONLY_VARIANTS and tp == 1)
    ]


def _chunk_roll_differs(case):
    """True when the MTP layer's roll of its own sequence-parallel chunk of the padding mask
    (0044's bug) reads another flag than the roll of the whole sequence somewhere in the case's
    global batch: at the last position of a chunk, the chunk's roll puts the fill (padded on dev,
    valid on the releases) where the sequence's roll puts the next chunk's first flag."""
    tp = case['layout'].get('tp', 1)
    starts = [k * oracle.SEQ // tp for k in range(1, tp)]
    for index in range(case['dp'] * oracle.NUM_MICROBATCHES):
        _, _, mask = oracle.microbatch(index)
        if starts and bool(((mask[:, starts] == 0) != case['mtp_last_padded']).any()):
            return True
    return False


CASES = {FORK: [], PRISTINE: []}
for _lay in LAYOUTS:
    CASES[FORK] += [_case(_lay, _var) for _var in _variants(_lay, VARIANTS, FORK)]
    for _var in _variants(_lay, PRISTINE_VARIANTS, PRISTINE):
        CASES[PRISTINE].append(_case(_lay, _var, bias=not (BIAS_PAD_BROKEN and VARIANTS[_var][1])))
for _tree in TREES:
    CASES[_tree] += [_case(*_args, model=_model) for *_args, _model in MODEL_CASES[_tree]]
for _lay, _var in PRISTINE_MTP_CASES:
    CASES[PRISTINE].append(_case(_lay, _var, bias=not (BIAS_PAD_BROKEN and VARIANTS[_var][1])))
if BIAS_PAD_BROKEN:
    CASES[PRISTINE].append(_case('dp2', 'pt1-pad1-do1'))


def _ref_key(case):
    """The reference depends on the model and the global batch, not on the layout (under the
    mean loss, on the CP size: each CP rank's mean weighs its own tokens)."""
    keep = ('dp', 'lb', 'z', 'mtp', 'per_token', 'pad', 'bias', 'mtp_last_padded')
    keep += ('linear_bias', 'dense_first')
    cp = '' if case['per_token'] or case['cp'] == 1 else f"-cp={case['cp']}"
    layers = '' if case['layers'] == oracle.LAYERS else f"-layers={case['layers']}"
    return '-'.join(f'{k}={case[k]}' for k in keep) + cp + layers


def _uneven_microbatches(case):
    """True when U_0, U_1, ... (every DP rank's m-th microbatch) hold different counts of valid
    tokens: upstream's global aux f (the mean count so far over the current microbatch's
    tokens) then misses the definition's (the counts so far over their tokens)."""
    mbs = oracle.NUM_MICROBATCHES
    counts = {
        sum(float(oracle.microbatch(r * mbs + m)[2].sum()) for r in range(case['dp']))
        for m in range(mbs)
    }
    return len(counts) > 1


def _breaks(tree, case):
    """The candidates of issue 31 (and earlier MoE changes) that ``case`` exercises and ``tree``
    lacks the fix of, from the change records."""
    # Candidates 1 and 2 are TP x CP factors (the router reduces over TP x CP).
    tp = case['layout'].get('tp', 1) * case['cp']
    ep, pp = case['layout'].get('ep', 1), case['layout'].get('pp', 1)
    out = []
    etp = case['layout'].get('etp', case['layout'].get('tp', 1))
    if case['linear_bias'] and ep == 1 and etp == 1:
        if not _fixed(tree, MLP_BIAS):
            out.append('6 MoE linear biases at EP = ETP = 1')
    if case['dense_first'] and pp > 1 and not _fixed(tree, METRICS_PP):
        out.append('5 metrics under PP with a stage without MoE layers')
    if case['z'] and tp > 1 and not _fixed(tree, Z_METRIC):
        out.append('0046 the logged z-loss is the TP rank\'s own')
    if case['z'] and case['pad'] and tp > 1 and not _fixed(tree, Z_VALID):
        out.append('0047 z-loss: the mean of the TP ranks\' means')
    if case['pad'] and case['bias'] and not _fixed(tree, BIAS_PAD):
        out.append('4 expert-bias counts with a padding mask')
    if case['per_token']:
        if tp > 1 and not _fixed(tree, AUX_TP):
            out.append('2 aux/z per-token without TP')
        if not (_fixed(tree, SEQ_BSZ) or _fixed(tree, SEQ_COUNT)):
            out.append('3 seq aux per-token count')
        if case['pad'] and tp > 1 and not _fixed(tree, VALID_COUNT):
            if BASE != 'dev' or 'global_aux_loss' in case['lb']:
                out.append('1 counts overwritten by the TP reduce')
        if case['mtp'] and not _fixed(tree, MTP_MICROBATCHES):
            out.append('8 MTP per-token over microbatches')
        if case['mtp'] and case['dp'] > 1 and not _fixed(tree, MTP_DP):
            out.append('0019 MTP per-token over DP')
    if 'global_aux_loss' in case['lb'] and not _fixed(tree, GLOBAL_AUX):
        if case['pad'] and _uneven_microbatches(case):
            out.append('0053 (a) global aux: f of microbatches with uneven valid tokens')
        # Per-token with a padding mask at TP x CP = 1 the rank's share is weighted right by
        # accident (the in-place TP reduce of candidate 1 hands it the global count).
        if case['dp'] > 1 and not (case['per_token'] and case['pad'] and tp == 1):
            out.append('0053 (b) global aux at DP > 1: the DP ranks\' shares averaged, not summed')
    sp_roll_broken = _state(SP_ROLL) is not None and not _fixed(tree, SP_ROLL)
    if case['mtp'] and case['pad'] and sp_roll_broken and _chunk_roll_differs(case):
        out.append('0044 MTP rolls the padding mask of its sequence-parallel chunk')
    return out


# The pristine arm runs only the cases that discriminate on this base (a candidate it lacks).
CASES[PRISTINE] = [c for c in CASES[PRISTINE] if _breaks(PRISTINE, c)]

REF_CASES = {}
for _c in CASES[FORK] + CASES[PRISTINE]:
    REF_CASES.setdefault(_ref_key(_c), dict(_c, name=_ref_key(_c)))

# Extra seconds on the world's budget (180 s + 60 s a call): dozens of cases a call on a loaded
# 2-core machine.
CALLS = {
    'ref': call(1, FORK, MOD + 'scenario_reference', timeout=240, cases=list(REF_CASES.values()))
}
for _tree in TREES:
    for _world in (2, 4):
        _cases = [c for c in CASES[_tree] if c['world'] == _world]
        if _cases:
            CALLS[_tree, _world] = call(
                _world, _tree, MOD + 'scenario_parallel', timeout=360, cases=_cases
            )


_REFS = {}


def _reference(case):
    key = _ref_key(case)
    if key not in _REFS:
        res = {c['name']: c for c in CALLS['ref'].result()[0]['cases']}[key]
        assert 'error' not in res, res
        r64 = oracle.assemble(res['ref64'])
        r32 = oracle.assemble(res['ref64'], res['ref32_flat'])
        _REFS[key] = (r64, r32, res)
    return _REFS[key]


EPS = torch.finfo(torch.float32).eps


def _compare(tree, case):
    """('error', message) or ('grads', {(key, offset): (err, bound, got.ref / ref.ref)}) of
    every parameter region beyond its bound, over all ranks; plus the expert-bias update."""
    per_rank = CALLS[tree, case['world']].result()
    r64, r32, ref = _reference(case)
    wrong = {}
    for rank, res in enumerate(per_rank):
        assert 'error' not in res, (tree, rank, res)
        got = {c['name']: c for c in res['cases']}[case['name']]
        if 'error' in got:
            return 'error', got['error']
        for key, _gshape, off, shape, _rep, vals in got['grads']:
            err, bound = oracle.region_error(r64, r32, key, off, shape, vals)
            if err > bound:
                want = r64[key][oracle.region(off, shape)].reshape(shape)
                value = torch.tensor(vals, dtype=torch.float64).reshape(shape)
                ratio = float((value * want).sum() / (want * want).sum().clamp(min=1e-300))
                wrong[key, tuple(off[: len(off) - len(shape) + 1])] = (err, bound, ratio)
        _compare_metrics(got['metrics'], ref, wrong)
        # The tokens per expert the update all-reduced: the one-process run's, exactly.
        for router, total in got['counts'].items():
            want = torch.tensor(ref['counts'][router], dtype=torch.float64)
            total = torch.tensor(total, dtype=torch.float64)
            if not torch.equal(total, want):
                wrong['tokens_per_expert', router] = (float((total - want).abs().max()), 0.0, 0.0)
        # The expert-bias update: rate * sign(mean - count) of each router's tokens per expert
        # over the whole step (the one-process run's counts), on every rank that holds a router.
        for router, bias in got['bias'].items():
            before = torch.tensor(ref['bias0'][router], dtype=torch.float64)
            counts = torch.tensor(ref['counts'][router], dtype=torch.float64)
            want = BIAS_RATE * torch.sign(counts.mean() - counts)
            delta = torch.tensor(bias, dtype=torch.float64) - before
            err = float((delta - want).abs().max())
            if err > 4 * EPS * (1 + float(before.abs().max())):
                wrong['expert_bias', router] = (err, 0.0, (delta / BIAS_RATE).tolist())
    return 'grads', wrong


def _compare_metrics(got, ref, wrong):
    """The MoE metrics the tracker logs (the mean over layers and each layer's value) against
    the one-process run's; bound as for a gradient (the float32-vs-float64 distance)."""
    if 'error' in got:
        wrong['metrics', 'report'] = (got['error'], 0.0, 0.0)
        return
    if set(got) != set(ref['metrics64']):
        wrong['metrics', 'names'] = (sorted(set(got) ^ set(ref['metrics64'])), 0.0, 0.0)
        return
    for name, want in ref['metrics64'].items():
        bound = 8 * abs(ref['metrics32'][name] - want) + 16 * EPS * abs(want)
        if abs(got[name] - want) > bound:
            wrong['metrics', name] = (abs(got[name] - want), bound, got[name] / want if want else 0)


def _selected(tree, world):
    return [c for c in CASES[tree] if c['world'] == world]


@pytest.mark.parametrize('world', (2, 4))
@pytest.mark.parametrize('tree', TREES)
def test_oracle(tree, world):
    """Each case equals the oracle where the tree has every fix it exercises, and fails (an
    upstream error, or a parameter beyond its bound) where it lacks one."""
    unexpected = {}
    for case in _selected(tree, world):
        breaks = _breaks(tree, case)
        kind, detail = _compare(tree, case)
        ok = kind == 'grads' and not detail
        if ok == bool(breaks):
            summary = detail if kind == 'error' else sorted(detail.items())[:4]
            unexpected[case['name']] = (breaks, kind, summary)
    assert not unexpected, (tree, BASE, unexpected)
