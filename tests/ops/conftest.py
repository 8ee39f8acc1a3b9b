"""Op-test hygiene: no op error or weight resolver leaks from one test into the next."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import ep.ops as eo


@pytest.fixture(autouse=True)
def _no_leftover_op_state() -> Iterator[None]:
    resolver = eo.get_weight_resolver()
    yield
    eo.take_op_errors(all_threads=True)  # a failed test must not fail the next one's run()
    eo.set_weight_resolver(resolver)
