"""The optional test tiers: the only reasons a test of this suite may skip.

A tier needs something a fresh machine does not have (a Megatron-LM clone, GPUs, podman) or a
base lacks the feature under test. Every skip names its tier as ``[tier NAME]`` at the start of
its reason; tests/conftest.py turns any other skip into a failure and counts skips per tier at the
end of the run. docs/maintaining.md ("Test tiers") lists the same tiers.

pytest is imported only where a test skips: the harness (and so tools/demo.sh, which installs
no test dependencies) imports this module too.
"""

TIERS = {
    'megatron-lm': "upstream's own pretrain_gpt.py and Megatron-LM history: set FORK_MEGATRON_LM "
    'to a Megatron-LM clone (work tree or bare)',
    'dev': 'the dev base: set FORK_TEST_DEV_REPO to a Megatron-LM clone with the pinned commit',
    'no-gtp': 'generalized tensor parallelism, absent on this base (dev, 0.18.2)',
    'nccl': 'checks of the CPU redirect, and worlds larger than the visible GPUs, under '
    'FORK_TEST_BACKEND=nccl',
    'evidence': 'the evidence branch (docs/evidence.md), absent from a single-branch clone: '
    'git fetch origin evidence:evidence',
    'containers': (
        'both Dockerfile targets built on a stand-in base: needs podman, debootstrap, root'
    ),
}


def reason(tier, detail):
    """The skip reason of ``tier`` (one of TIERS), with what is missing in ``detail``."""
    if tier not in TIERS:
        raise KeyError(f'unknown test tier {tier!r}; known: {", ".join(TIERS)}')
    return f'[tier {tier}] {detail}'


def skip(tier, detail):
    """Skip the running test as part of ``tier``."""
    import pytest  # pylint: disable=import-outside-toplevel

    pytest.skip(reason(tier, detail))


def skipif(condition, tier, detail):
    """A skipif mark for ``tier``."""
    import pytest  # pylint: disable=import-outside-toplevel

    return pytest.mark.skipif(condition, reason=reason(tier, detail))


def tier_of(text):
    """The tier a skip reason names, or None when it names none of TIERS."""
    start = text.find('[tier ')
    if start < 0:
        return None
    name = text[start + len('[tier ') :].split(']', 1)[0]
    return name if name in TIERS else None
