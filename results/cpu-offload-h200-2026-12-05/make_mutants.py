"""Copy a materialized tree once per mutation of tools/maint/mutations/NNNN.toml and apply it.

Usage: make_mutants.py TREE DEST SPEC... ; writes DEST/<id>/megatron (the mutated copy) and prints
one line per mutation. mutate.py does the same in place on a CPU machine, where these GPU-only
tests are skipped; this is how the mutants ran on the device.
"""

import shutil
import sys
import tomllib
from pathlib import Path


def main(tree, dest, *specs):
    for spec in specs:
        for mutation in tomllib.loads(Path(spec).read_text())['mutation']:
            out = Path(dest) / mutation['id']
            shutil.copytree(Path(tree) / 'megatron', out / 'megatron')
            path = out / mutation['file']
            text = path.read_text()
            assert text.count(mutation['old']) == 1, (mutation['id'], text.count(mutation['old']))
            path.write_text(text.replace(mutation['old'], mutation['new']))
            print(mutation['id'], ' '.join(mutation['tests']))


if __name__ == '__main__':
    main(*sys.argv[1:])
