"""StructuredOutputsParams' validation and its trip to the engine-core process (msgpack through
moe/engine/serialization.py), and the output flag that keeps a grammar's last token in the text."""
from __future__ import annotations

import pytest

from moe import SamplingParams, StructuredOutputsParams
from moe.engine.core import CoreRequest
from moe.engine.serialization import decode, encode, pack_output, pack_request, unpack_output, unpack_request
from scheduler.output import EngineCoreOutput


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                            disable_any_whitespace=True, disable_additional_properties=True),
    StructuredOutputsParams(json='{"type": "string"}', whitespace_pattern=" ?"),
    StructuredOutputsParams(regex=r"\d+"),
    StructuredOutputsParams(choice=["a", "b c"]),
    StructuredOutputsParams(grammar='start: "x"'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(structural_tag='{"structures": [], "triggers": []}'),
])
def test_structured_outputs_survive_the_message(spec):
    params = SamplingParams(temperature=0.5, seed=3, structured_outputs=spec)
    got = unpack_request(decode(encode(pack_request(CoreRequest("r", [1, 2], 8, params, (0,), []))))).params
    assert got.structured_outputs == spec and isinstance(got.structured_outputs, StructuredOutputsParams)
    assert got.seed == 3 and got.temperature == 0.5
    plain = unpack_request(decode(encode(pack_request(CoreRequest("p", [1], 8, SamplingParams(), (0,), []))))).params
    assert plain.structured_outputs is None


def test_the_grammar_stop_flag_survives_the_message():
    for flag in (False, True):
        co = EngineCoreOutput("r", [5, 6], None, "stop", None, 0, None, flag)
        assert unpack_output(decode(encode(pack_output(co)))).stopped_by_grammar is flag


@pytest.mark.parametrize("kwargs, says", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json=3), "JSON schema"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", 1]), "non-empty list"),
    (dict(regex=5), "must be a string"),
])
def test_bad_params_name_the_field(kwargs, says):
    with pytest.raises(ValueError, match=says):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_only_the_dataclass():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
