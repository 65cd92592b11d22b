"""The core messages survive msgpack unchanged, and chat templates render as transformers renders them."""
from __future__ import annotations

import pytest

from moe.engine.core import CoreRequest, CoreStepResult, SchedulerStats
from moe.engine.serialization import decode, encode, pack_request, pack_step, unpack_request, unpack_step
from moe.sampling_params import SamplingParams
from moe.worker.model_runner import TokenLogprobs
from scheduler.output import EngineCoreOutput
from tests.serve.helpers import make_chat_model


def test_request_round_trip():
    params = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=9, stop=["a", "bc"],
                            stop_token_ids=[4], logprobs=2, presence_penalty=0.5, ignore_eos=True)
    req = CoreRequest("r-1", [5, 6, 7], 9, params, (0, 2))
    back = unpack_request(decode(encode(pack_request(req))))
    assert back == req and back.params.stop_list == ["a", "bc"]


def test_step_round_trip():
    lp = TokenLogprobs(11, -0.25, 1, [11, 3], [-0.25, -1.5])
    result = CoreStepResult(
        [EngineCoreOutput("a", [11], [lp], None, None, 16), EngineCoreOutput("b", [1, 2], None, "stop", "x", 0),
         EngineCoreOutput("c", [], None, "error")],
        SchedulerStats(2, 1, 0.125, 3, 40, 16), {"a": 0.001}, {"c": "RuntimeError: boom"})
    back = unpack_step(decode(pack_step(result)))
    assert back == result


def test_no_pickle_for_unknown_objects():
    with pytest.raises(TypeError, match="cannot encode"):
        encode(["x", object()])


def test_chat_template_renders_like_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from moe.engine.chat_template import ChatTemplate

    folder = make_chat_model(str(tmp_path / "m"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    theirs = PreTrainedTokenizerFast.from_pretrained(folder)
    ours = ChatTemplate.load(folder)
    for gen in (True, False):
        assert ours.render(messages, add_generation_prompt=gen) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(ValueError, match="messages"):
        ours.render([])
    bad = ChatTemplate("{{ raise_exception('no system role') }}", {})
    with pytest.raises(ValueError, match="no system role"):
        bad.render(messages)
