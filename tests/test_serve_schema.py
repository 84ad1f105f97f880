"""A bounded schemathesis run against a real server's own `/openapi.json`: whatever the description admits (and
what it does not, in negative cases), the server answers without a 5xx and stays up."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from serving import Served

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"
EXAMPLES = 30  # per operation: enough to reach every field, a minute or so in all on two cores

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory, checkpoint):
    served = Served(tmp_path_factory.mktemp("schema"), SPEC, checkpoint)
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case, served):
    response = case.call(base_url=served.url, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text[:500]}"
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
