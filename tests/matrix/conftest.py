"""The promise matrix's report hook: a cell's fixture learns whether its test passed."""

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.matrix_report = report
    return report
