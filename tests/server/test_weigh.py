"""Large bodies weighed in a child process: their shape read right, and bodies no request could use refused by field
before the server parses them."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.exceptions import RequestValidationError

from nanoserve.server.app import OTHER_VALUES, check_weight
from nanoserve.server.protocol import BadRequest
from nanoserve.server.weigh import Weigher, count, weigh


def test_count_is_the_number_of_json_values():
    assert count(7) == 1 and count([]) == 1 and count([1, 2, 3]) == 4
    assert count({"a": [1, [2, 3]], "b": "x"}) == 1 + (1 + 1 + 3) + 1


def test_weigh_reads_the_prompts_shape():
    assert weigh(b'{"prompt": [1, 2, 3], "n": 2}') == {"values": {"prompt": 4, "n": 1}, "prompt": ["ids", 3]}
    w = weigh(b'{"prompt": [[1], [1, 2, 3], "text"]}')
    assert w["prompt"] == ["batch", 3, 1, 3]
    assert weigh(b'{"prompt": "text"}') == {"values": {"prompt": 1}}
    assert weigh(b"[1, 2]") == {"values": {"": 3}}
    assert "invalid" in weigh(b'{"prompt": ') and "invalid" in weigh(b"[" * 100_000)


def refusal(weight: dict) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        check_weight(weight, 8192, 128)
    return e.value


def test_bodies_no_request_could_use_are_refused_by_field():
    e = refusal(weigh(json.dumps({"prompt": [0] * 9000}).encode()))
    assert e.param == "prompt" and "prompt has 9000 tokens; the model's context is 8192" in str(e)
    e = refusal(weigh(json.dumps({"prompt": [[0]] * 3 + [[0] * 9000]}).encode()))
    assert e.param == "prompt" and str(e).startswith("prompt 3: prompt has 9000 tokens")
    e = refusal(weigh(json.dumps({"prompt": ["a"] * 200}).encode()))
    assert e.param == "prompt" and "200 prompts; at most 128" in str(e)
    e = refusal(weigh(json.dumps({"prompt": "hi", "junk": [0] * (OTHER_VALUES + 1)}).encode()))
    assert e.param == "junk" and f"at most {OTHER_VALUES}" in str(e)
    e = refusal(weigh(json.dumps([0] * (OTHER_VALUES + 1)).encode()))
    assert e.param is None and str(e).startswith("the body holds")
    with pytest.raises(RequestValidationError):
        check_weight(weigh(b"{"), 8192, 128)
    check_weight(weigh(json.dumps({"prompt": [[0] * 8000] * 100, "stop": ["x"]}).encode()), 8192, 128)  # usable


def test_the_weigher_starts_again_after_its_child_dies():
    async def run() -> tuple[dict, dict]:
        weigher = Weigher()
        try:
            first = await weigher.weigh(b'{"prompt": [1]}')
            weigher.proc.kill()
            await weigher.proc.wait()
            return first, await weigher.weigh(b'{"prompt": [1, 2]}')
        finally:
            await weigher.aclose()

    first, second = asyncio.run(run())
    assert first["prompt"] == ["ids", 1] and second["prompt"] == ["ids", 2]
