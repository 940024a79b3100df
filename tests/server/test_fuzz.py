"""A bounded schema fuzz: schemathesis generates requests from the server's own OpenAPI schema, both bodies that
fit it and bodies that break it, and every answer must be a status the schema documents, never a 5xx, and
anything but a 200 in OpenAI's error shape. On a random model with SmolLM2's vocabulary, so that a generated
max_tokens costs milliseconds."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from servers import AUTH, KEY, tiny_server

from nanoserve.server.limits import ServerConfig

EXAMPLES = 40  # per operation and mode: a few seconds each on the tiny model


@pytest.fixture(scope="module")
def fuzzed(vocab_model, tok):
    with tiny_server(vocab_model, tok, ServerConfig(api_key=KEY), max_num_seqs=4) as (srv, ae, _):
        yield srv, ae


def fuzz(op, mode, url: str, session: requests.Session, seen: dict[str, set[int]]):
    """The hypothesis test of one operation: every answer a documented status, never a 5xx, errors in shape."""
    documented = {int(code) for code in op.definition.raw["responses"]}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(base_url=url, session=session, headers=AUTH, timeout=120)
        where = f"{case.method} {case.path} {case.body!r:.300}"
        assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:500]}"
        assert response.status_code in documented, f"{where} -> undocumented {response.status_code}"
        if response.status_code != 200:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        seen.setdefault(op.label, set()).add(response.status_code)

    return check


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error(fuzzed, mode):
    srv, ae = fuzzed
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    session = requests.Session()
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        raw = op.definition.raw
        if mode is schemathesis.GenerationMode.NEGATIVE and not raw.get("requestBody") and not raw.get("parameters"):
            continue  # nothing to break where there is no body and no parameter (the GETs, reset_prefix_cache)
        fuzz(op, mode, srv.url, session, seen)()
    assert ae.is_running
    if mode is schemathesis.GenerationMode.POSITIVE:  # the valid ones were served, not only refused
        assert 200 in seen["POST /v1/completions"] and 200 in seen["POST /v1/chat/completions"]
