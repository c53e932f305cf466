"""The examples in the package's docstrings run and print what they show (``doctest``), one test per docstring.

Every module of ``timm_sortconv`` is searched, so a new example is collected without a list to update;
``...`` in an expected output stands for any text (``doctest.ELLIPSIS``), for a value that is measured, not
fixed. An example that cannot run here (a data folder it needs) says so with ``# doctest: +SKIP``.
"""
import doctest
import importlib
import pkgutil

import pytest

import timm_sortconv


def docstring_examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for module in pkgutil.walk_packages(timm_sortconv.__path__, "timm_sortconv."):
        found += [test for test in finder.find(importlib.import_module(module.name)) if test.examples]
    return sorted(found, key=lambda test: test.name)


EXAMPLES = docstring_examples()


def test_the_examples_are_found():
    names = {test.name for test in EXAMPLES}
    assert {"timm_sortconv.layers.SortConv2d", "timm_sortconv.ops.functional.sort_conv2d",
            "timm_sortconv.sortify.sortify"} <= names


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name.removeprefix("timm_sortconv.") for test in EXAMPLES])
def test_docstring_example(example, one_thread):
    report = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(example, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)
