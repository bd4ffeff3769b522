"""Issue 38 / change ``moe-routed-token-count-dynamic``: a MoE layer runs its bias-dropout-add
eagerly on small inputs; a dense layer keeps the compiled fused function.

A MoE step waits on the host, and the compiled ``bias_dropout_add_fused_train`` (a dynamo entry
and AOTAutograd's wrapper, forward and backward) costs more host time there than its few eager
operations. Counterfactual, no timing read (tests/scenarios/moe_layer_bda.py): pristine compiles
the fused function in a MoE layer; the fork compiles none below ``SMALL_ELEMENTS`` (far above
these tensors) and compiles it again at a threshold of the residual's own size (the boundary:
``SMALL_ELEMENTS`` elements or more compile). In eval mode the same holds for
``bias_dropout_add_fused_inference``, and in a ``MoETransformerLayer`` (the layer class of the
partial CUDA graphs). A dense layer compiles it on the fork, also the dense layer
of a MoE model (``moe_layer_freq``: the config has experts, the layer's spec has none). The
layer's output and input grad equal the eager layer's either way. A getter other than upstream's
(a spec's own module) is left as built. Where ``jit_fuser`` is not ``torch.compile``
(``--disable-jit-fuser``) or torch lacks ``set_stance``, the change steps aside: the weighted
SwiGLU functions are decorated as on pristine and a MoE layer keeps upstream's getter.
"""

import pytest

from tests.harness import call
from tests.harness.bases import FORK, PRISTINE, tree_has_fix

MOD = 'tests.scenarios.moe_layer_bda:scenario_bda_graphs'
REGION = 'tests.scenarios.moe_layer_bda:scenario_bda_in_compiled_region'
OTHER = 'tests.scenarios.moe_layer_bda:scenario_other_bda_getter'
JIT_OFF = 'tests.scenarios.moe_layer_bda:scenario_jit_fuser_off'
CHANGE = 'moe-routed-token-count-dynamic'
RESIDUAL = 6 * 1 * 8  # elements of the scenario's residual ([sequence, batch, hidden])
CASES = {
    'pristine-moe': call(1, PRISTINE, MOD, experts=4),
    'fork-moe': call(1, FORK, MOD, experts=4),
    'fork-moe-at-threshold': call(1, FORK, MOD, experts=4, small=RESIDUAL),
    'fork-dense': call(1, FORK, MOD, experts=0),
    'fork-dense-layer-of-moe-model': call(1, FORK, MOD, experts=4, dense_layer=True),
    'pristine-moe-layer-class': call(1, PRISTINE, MOD, experts=4, moe_layer_class=True),
    'fork-moe-layer-class': call(1, FORK, MOD, experts=4, moe_layer_class=True),
    'pristine-moe-eval': call(1, PRISTINE, MOD, experts=4, training=False),
    'fork-moe-eval': call(1, FORK, MOD, experts=4, training=False),
    'pristine-region': call(1, PRISTINE, REGION, small=64),
    'fork-region': call(1, FORK, REGION, small=64),
    'pristine-other-getter': call(1, PRISTINE, OTHER),
    'fork-other-getter': call(1, FORK, OTHER),
    'pristine-jit-off': call(1, PRISTINE, JIT_OFF, off='jit'),
    'fork-jit-off': call(1, FORK, JIT_OFF, off='jit'),
    'pristine-no-set-stance': call(1, PRISTINE, JIT_OFF, off='set_stance'),
    'fork-no-set-stance': call(1, FORK, JIT_OFF, off='set_stance'),
}


def _result(case):
    [res] = CASES[case].result()
    assert 'error' not in res, res['error']
    return res


@pytest.mark.parametrize(
    'case',
    [
        'pristine-moe',
        'pristine-moe-layer-class',
        'pristine-moe-eval',
        'fork-moe-at-threshold',
        'fork-dense',
        'fork-dense-layer-of-moe-model',
    ],
)
def test_compiled_where_upstream_compiles(case):
    if case.startswith('fork') and not tree_has_fix(FORK, CHANGE):
        pytest.skip(f'{CHANGE} is not in the fork tree')
    res = _result(case)
    assert res['graphs'] >= 1, res
    assert res['diff'] < 1e-5, res
    assert res['same_function'], res


@pytest.mark.parametrize('case', ['fork-moe', 'fork-moe-layer-class', 'fork-moe-eval'])
def test_fork_moe_layer_runs_bda_eagerly(case):
    if not tree_has_fix(FORK, CHANGE):
        pytest.skip(f'{CHANGE} is not in the fork tree')
    res = _result(case)
    assert res['small_elements'] == 1 << 24, res
    assert res['graphs'] == 0, res
    assert res['diff'] < 1e-5, res
    assert res['same_function'], res  # not a new function per layer call (the hot path)


@pytest.mark.parametrize('case', ['pristine-region', 'fork-region'])
def test_one_graph_when_the_layer_is_compiled_whole(case):
    # Inside a compiled region the getter's function calls the fused function at every size,
    # as pristine's does: no guard on the residual's size, so one graph over sizes on both sides
    # of the threshold (testing the size before is_compiling() compiled a second graph).
    if case.startswith('fork') and not tree_has_fix(FORK, CHANGE):
        pytest.skip(f'{CHANGE} is not in the fork tree')
    res = _result(case)
    assert res['frames'] == 1, res
    assert res['diff'] == 0.0, res


@pytest.mark.parametrize('case', ['pristine-other-getter', 'fork-other-getter'])
def test_other_bda_getter_left_as_built(case):
    # Only upstream's get_bias_dropout_add is wrapped: a spec's own module stays what it is.
    if case.startswith('fork') and not tree_has_fix(FORK, CHANGE):
        pytest.skip(f'{CHANGE} is not in the fork tree')
    assert _result(case)['kept']


@pytest.mark.parametrize(
    'case', ['pristine-jit-off', 'fork-jit-off', 'pristine-no-set-stance', 'fork-no-set-stance']
)
def test_jit_fuser_off_leaves_upstream_decoration(case):
    # Where jit_fuser is a no-op (--disable-jit-fuser) the weighted SwiGLU functions are the plain
    # functions and a MoE layer keeps get_bias_dropout_add, as on pristine; in a torch without
    # set_stance the functions are torch.compile's, unwrapped.
    if case.startswith('fork') and not tree_has_fix(FORK, CHANGE):
        pytest.skip(f'{CHANGE} is not in the fork tree')
    res = _result(case)
    kind = 'plain' if case.endswith('jit-off') else 'compiled'
    assert res['kinds'] == {'weighted_swiglu': kind, 'weighted_swiglu_back': kind}, res
    assert res['upstream_getter'] or not case.endswith('jit-off'), res
