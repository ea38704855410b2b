"""Fixtures of the fault suite: every process a test starts is SIGKILLed
(its whole process group) when the test ends, pass or fail."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--n", type=int, default=None, help="faults of the seeded random run (env KVFERRY_FAULTS_N)")
    parser.addoption("--seed", type=int, default=None, help="seed of the random run (env KVFERRY_FAULTS_SEED)")


@pytest.fixture(autouse=True)
def reap():
    yield
    harness.reap_all()


@pytest.fixture
def hosts():
    """make(*names): simulated hosts (harness.Hosts), one network namespace a
    name; skips without root or netns. Every process is reaped and the
    namespaces and bridge removed when the test ends."""
    made = []

    def make(*names):
        try:
            h = harness.Hosts(names)
        except harness.HostsUnavailable as e:
            pytest.skip(f"simulated hosts: {e}")
        made.append(h)
        return h

    yield make
    harness.reap_all()  # no process may keep a namespace alive
    left = [ns for h in made for ns in h.close()]
    assert not left, f"namespaces left behind: {left}"


def pytest_configure(config):
    if not os.path.exists(harness.CLI):
        raise pytest.UsageError(f"kvferry CLI not found at {harness.CLI}: build first (make build) or set KVFERRY_CLI")
