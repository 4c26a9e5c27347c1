"""Engine API on the shipped SmolLM2: seeds, stops, logprobs, aborts, bad input."""

from __future__ import annotations

import pytest

from pdserve.engine.engine import Engine
from pdserve.errors import InvalidRequestError
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.outputs import RequestOutput

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def chat_ids(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def run(engine: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    ids = [engine.add_request(p, sp) for p, sp in reqs]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def assert_nothing_held(engine: Engine) -> None:
    kv = engine.core.kv
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks + kv.num_cached_blocks == 512
    s = engine.core.scheduler
    assert not (s.waiting or s.running or s.swapped or engine.core.requests)


# ---- outputs --------------------------------------------------------------------


def test_eos_ends_the_request_and_is_not_rendered(make_engine) -> None:
    engine = make_engine()
    (out,) = run(engine, [(chat_ids(engine, FRANCE), SamplingParams(max_tokens=64, temperature=0))])
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == 2  # <|im_end|>
    assert engine.tokenizer.decode(out.token_ids[:-1]) == out.text
    assert out.metrics is not None and out.metrics.ttft is not None and out.metrics.e2e


def test_max_tokens_gives_length(make_engine) -> None:
    engine = make_engine()
    (out,) = run(engine, [(chat_ids(engine, FRANCE), SamplingParams(max_tokens=3, temperature=0))])
    assert out.text == "The capital of"
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_stop_string_is_cut_and_reported(make_engine) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=32, temperature=0, stop=["France is", "Paris"])
    (out,) = run(engine, [(chat_ids(engine, FRANCE), params)])
    assert out.text == "The capital of "
    assert out.finish_reason == "stop" and out.stop_reason == "France is"


def test_stop_token_id(make_engine) -> None:
    engine = make_engine()
    capital = engine.tokenizer.encode(" capital", add_special_tokens=False)
    assert len(capital) == 1
    params = SamplingParams(max_tokens=32, temperature=0, stop_token_ids=capital)
    (out,) = run(engine, [(chat_ids(engine, FRANCE), params)])
    assert out.text == "The"
    assert out.finish_reason == "stop" and out.stop_reason == capital[0]


def test_logprobs_follow_the_model(make_engine) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    (out,) = run(engine, [(chat_ids(engine, FRANCE), params)])
    assert out.logprobs is not None and len(out.logprobs) == 4
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tok
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0] == (tok, lp.logprob)  # greedy picks the top token
        assert lp.top_logprobs[0][1] >= lp.top_logprobs[1][1] >= lp.top_logprobs[2][1]
        assert lp.logprob <= 0


def test_same_seed_same_text_alone_or_in_a_batch(make_engine) -> None:
    engine = make_engine()
    prompt = chat_ids(engine, [{"role": "user", "content": "Write a short poem about rain."}])
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    (alone,) = run(engine, [(prompt, seeded)])
    others = [
        (
            chat_ids(engine, [{"role": "user", "content": f"Count to {n}."}]),
            SamplingParams(max_tokens=20 + n, temperature=1.0, seed=n),
        )
        for n in range(6)
    ]
    batch = run(engine, [*others[:3], (prompt, seeded), *others[3:]])
    assert batch[3].token_ids == alone.token_ids and batch[3].text == alone.text
    (other_seed,) = run(
        engine, [(prompt, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99))]
    )
    assert other_seed.token_ids != alone.token_ids


# ---- abort ------------------------------------------------------------------------


def test_abort_returns_blocks_immediately(make_engine) -> None:
    engine = make_engine()
    rid = engine.add_request(
        chat_ids(engine, FRANCE), SamplingParams(max_tokens=50, ignore_eos=True)
    )
    engine.step()
    engine.step()
    assert engine.core.kv.num_used_blocks > 0
    out = engine.abort(rid)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert len(out.token_ids) == 2
    assert engine.abort(rid) is None
    assert_nothing_held(engine)


# ---- bad input: refused at add_request, nothing allocated ------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        ([], {}, "prompt", "prompt must contain at least one token"),
        ("", {}, "prompt", "prompt must not be empty"),
        ([1, 49152], {}, "prompt", "prompt token id 49152 is outside the vocabulary [0, 49152)"),
        ([1, -3], {}, "prompt", "prompt token id -3 is outside the vocabulary [0, 49152)"),
        (
            [1] * 100,
            {"max_tokens": 1},
            "prompt",
            "this model's maximum context length is 96 tokens, but 100 prompt tokens plus "
            "max_tokens=1 would need 101",
        ),
        (
            [1] * 40,
            {"max_tokens": 60},
            "max_tokens",
            "this model's maximum context length is 96 tokens, but 40 prompt tokens plus "
            "max_tokens=60 would need 100",
        ),
        (
            [1, 2],
            {"stop_token_ids": [50000]},
            "stop_token_ids",
            "stop token id 50000 is outside the vocabulary [0, 49152)",
        ),
    ],
)
def test_bad_input_is_refused_with_nothing_allocated(
    make_engine, prompt, params, param, message
) -> None:
    engine = make_engine(max_model_len=96)
    with pytest.raises(InvalidRequestError) as exc:
        engine.add_request(prompt, SamplingParams(**params))
    assert (exc.value.param, exc.value.message) == (param, message)
    assert_nothing_held(engine)


def test_duplicate_request_id_is_refused(make_engine) -> None:
    engine = make_engine()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(InvalidRequestError, match="request id 'x' is already in use"):
        engine.add_request([4, 5], SamplingParams(max_tokens=2), request_id="x")
    while engine.has_unfinished():
        engine.step()
    assert_nothing_held(engine)


def test_sampling_params_refuse_unknown_fields() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_dict({"max_tokens": 4, "temprature": 0.5})
    assert exc.value.param == "temprature"
    assert exc.value.message == "unknown sampling parameter 'temprature'"


def test_engine_config_refuses_context_beyond_the_model(smollm2) -> None:
    from pdserve.config import EngineConfig

    model, tok = smollm2
    with pytest.raises(
        ValueError, match="max_model_len=9000 exceeds the model's max_position_embeddings=8192"
    ):
        Engine(EngineConfig(max_model_len=9000), model, tok)


def test_llm_generate_and_chat_keep_input_order(make_engine) -> None:
    from pdserve.engine.llm import LLM

    engine = make_engine()
    llm = LLM.from_engine(engine)
    greedy = SamplingParams(max_tokens=64, temperature=0)
    assert llm.chat(FRANCE, greedy).text == "The capital of France is Paris."
    prompts = ["The first law of thermodynamics", chat_ids(engine, FRANCE), "Hello"]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in (5, 64, 2)])
    assert [len(o.token_ids) for o in outs[::2]] == [5, 2]
    assert outs[1].text == "The capital of France is Paris."
    assert outs[0].prompt_token_ids == engine.tokenizer.encode("The first law of thermodynamics")
    with pytest.raises(ValueError, match="got 1 SamplingParams for 3 prompts"):
        llm.generate(prompts, [greedy])
