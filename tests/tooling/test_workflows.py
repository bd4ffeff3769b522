"""Static checks of .github/workflows: schema validity and actions pinned by commit SHA.

The GitHub workflow schema is SchemaStore's, vendored under tests/vendor/ (see its README), so
these tests need no network.
"""

import hashlib
import json
import os
import re

import jsonschema
import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKFLOWS = os.path.join(REPO, '.github', 'workflows')
SCHEMA = os.path.join(REPO, 'tests', 'vendor', 'github-workflow.json')
SCHEMA_README = os.path.join(REPO, 'tests', 'vendor', 'README.md')
SHA_PIN = re.compile(r'^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$')


def workflow_files():
    """Every workflow file of the repository."""
    return sorted(
        os.path.join(WORKFLOWS, n) for n in os.listdir(WORKFLOWS) if n.endswith(('.yml', '.yaml'))
    )


def parse_workflow(text):
    """Parses workflow text with YAML 1.1 quirks undone: the key `on` must stay a string."""
    data = yaml.safe_load(text)
    if True in data:  # PyYAML reads a bare `on:` key as the boolean True
        data['on'] = data.pop(True)
    return data


def load_workflow(path):
    """Parses a workflow file (see parse_workflow)."""
    with open(path) as fh:
        return parse_workflow(fh.read())


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


def pin_findings(text):
    """What the pin rule finds in one workflow's text: every remote action must be pinned to a
    40-hex commit and carry a `# vX` comment naming the release."""
    findings = [
        f'not pinned to a 40-hex commit: {u}'
        for u in iter_uses(parse_workflow(text))
        if not (u.startswith('./') or SHA_PIN.match(u))
    ]
    for line in text.splitlines():
        if re.search(r'\buses:\s*[^.\s]', line):
            if not re.search(r'@[0-9a-f]{40}\s+#\s*v\d', line):
                findings.append(f'no version comment: {line.strip()}')
    return findings


@pytest.mark.parametrize('path', workflow_files(), ids=os.path.basename)
def test_every_action_pinned_by_sha(path):
    with open(path) as fh:
        findings = pin_findings(fh.read())
    assert not findings, findings


def test_validator_rejects_a_broken_workflow(validator):
    """Counterfactual: the schema really constrains workflows (a job without runs-on fails)."""
    broken = {'on': 'push', 'jobs': {'x': {'steps': [{'run': 'true'}]}}}
    assert list(validator.iter_errors(broken))


def test_pin_rule_rejects_tags_and_missing_release_comments():
    """Counterfactual for the pin rule: the same check the workflows pass, on a workflow that
    breaks it in each way (and with the forms it must accept)."""
    sha = '0123456789abcdef0123456789abcdef01234567'
    text = f"""on: push
jobs:
  x:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@{sha}
      - uses: actions/cache@{sha[:12]}  # v4.2.0
      - uses: actions/upload-artifact@{sha}  # v4.6.2
      - uses: ./.github/actions/local
  y:
    uses: org/repo/.github/workflows/reusable.yml@main
"""
    assert pin_findings(text) == [
        'not pinned to a 40-hex commit: actions/checkout@v4',
        f'not pinned to a 40-hex commit: actions/cache@{sha[:12]}',
        'not pinned to a 40-hex commit: org/repo/.github/workflows/reusable.yml@main',
        'no version comment: - uses: actions/checkout@v4',
        f'no version comment: - uses: actions/setup-python@{sha}',
        f'no version comment: - uses: actions/cache@{sha[:12]}  # v4.2.0',
        'no version comment: uses: org/repo/.github/workflows/reusable.yml@main',
    ]


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
