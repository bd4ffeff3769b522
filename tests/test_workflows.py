"""Static checks of .github/workflows: schema validity and actions pinned by commit SHA.

The GitHub workflow schema is SchemaStore's, vendored under tests/vendor/ (see its README), so
these tests need no network.
"""

import hashlib
import json
import os
import re

import pytest

yaml = pytest.importorskip('yaml')
jsonschema = pytest.importorskip('jsonschema')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = os.path.join(REPO, '.github', 'workflows')
SCHEMA = os.path.join(REPO, 'tests', 'vendor', 'github-workflow.json')
SCHEMA_README = os.path.join(REPO, 'tests', 'vendor', 'README.md')
SHA_PIN = re.compile(r'^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$')


def workflow_files():
    """Every workflow file of the repository."""
    return sorted(
        os.path.join(WORKFLOWS, n) for n in os.listdir(WORKFLOWS) if n.endswith(('.yml', '.yaml'))
    )


def load_workflow(path):
    """Parses a workflow with YAML 1.1 quirks undone: the key `on` must stay a string."""
    with open(path) as fh:
        data = yaml.safe_load(fh)
    if True in data:  # PyYAML reads a bare `on:` key as the boolean True
        data['on'] = data.pop(True)
    return data


def iter_uses(node):
    """Yields every `uses:` value anywhere in a parsed workflow."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == 'uses' and isinstance(value, str):
                yield value
            else:
                yield from iter_uses(value)
    elif isinstance(node, list):
        for item in node:
            yield from iter_uses(item)


@pytest.fixture(scope='module')
def validator():
    with open(SCHEMA) as fh:
        schema = json.load(fh)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_there_are_workflows():
    names = {os.path.basename(p) for p in workflow_files()}
    assert {'lint.yml', 'ci.yml', 'series.yml', 'containers.yml', 'upstream-watch.yml'} <= names


def test_vendored_schema_matches_readme():
    with open(SCHEMA, 'rb') as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    with open(SCHEMA_README) as fh:
        assert digest in fh.read(), 'tests/vendor/README.md must record the schema sha256'


@pytest.mark.parametrize('path', workflow_files(), ids=os.path.basename)
def test_workflow_matches_schema(validator, path):
    errors = sorted(validator.iter_errors(load_workflow(path)), key=lambda e: list(e.path))
    assert not errors, '\n'.join(f"{list(e.path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize('path', workflow_files(), ids=os.path.basename)
def test_every_action_pinned_by_sha(path):
    uses = list(iter_uses(load_workflow(path)))
    bad = [u for u in uses if not (u.startswith('./') or SHA_PIN.match(u))]
    assert not bad, f'actions not pinned to a 40-hex commit: {bad}'
    with open(path) as fh:
        text = fh.read()
    for line in text.splitlines():
        if re.search(r'\buses:\s*[^.\s]', line):
            pinned = re.search(r'@[0-9a-f]{40}\s+#\s*v\d', line)
            assert pinned, f'no version comment: {line.strip()}'


def test_validator_rejects_a_broken_workflow(validator):
    """Counterfactual: the schema really constrains workflows (a job without runs-on fails)."""
    broken = {'on': 'push', 'jobs': {'x': {'steps': [{'run': 'true'}]}}}
    assert list(validator.iter_errors(broken))


def test_sha_rule_rejects_tags():
    """Counterfactual for the pin rule."""
    assert not SHA_PIN.match('actions/checkout@v4')
    assert SHA_PIN.match('actions/checkout@' + 'a' * 40)


def test_series_matrix_covers_the_bases():
    wf = load_workflow(os.path.join(WORKFLOWS, 'series.yml'))
    assert wf['jobs']['status']['strategy']['matrix']['base'] == ['0.17.1', '0.18.2', '0.19.2']


def test_gpu_jobs_use_documented_runner_labels():
    wf = load_workflow(os.path.join(WORKFLOWS, 'containers.yml'))
    labels = {
        tuple(job['runs-on']) for job in wf['jobs'].values() if isinstance(job['runs-on'], list)
    }
    assert ('self-hosted', 'linux', 'x64', 'gpu-nvidia-h200') in labels
    assert ('self-hosted', 'linux', 'x64', 'gpu-amd-mi300x') in labels
    with open(os.path.join(REPO, 'docs', 'containers.md')) as fh:
        doc = fh.read()
    for label in ('gpu-nvidia-h200', 'gpu-amd-mi300x'):
        assert label in doc
