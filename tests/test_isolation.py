"""Requests without our tag are left alone by the capture."""

from __future__ import annotations

import pytest
from conftest import ENGINE_OPTS
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from genlm_vlm.capture import TAG_KEY


@pytest.fixture(scope="module")
def plain_llm(model_paths):
    llm = LLM(model=model_paths["llama"], enforce_eager=True, **ENGINE_OPTS)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_untagged_requests_generate_the_same_tokens(llama_lm, plain_llm):
    prompt = TokensPrompt(prompt_token_ids=[5, 17, 33, 90, 12])
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    tagged = [
        SamplingParams(max_tokens=1, temperature=0.0, extra_args={TAG_KEY: f"iso:{i}"}) for i in range(3)
    ]
    tagged_prompts = [TokensPrompt(prompt_token_ids=[7 + i, 8, 9]) for i in range(3)]

    expected = [o.outputs[0].token_ids for o in plain_llm.generate([prompt, prompt], [greedy, seeded], use_tqdm=False)]

    driver = llama_lm._driver
    outs = driver.call(
        driver.llm.generate,
        [prompt, *tagged_prompts, prompt],
        sampling_params=[greedy, *tagged, seeded],
        use_tqdm=False,
    )
    got = [outs[0].outputs[0].token_ids, outs[-1].outputs[0].token_ids]
    assert got == expected
    assert len(expected[0]) == 12
    # the tagged requests were captured, the untagged ones were not
    captured = {t for t in driver.sink.rows if t.startswith("iso:")}
    assert captured == {"iso:0", "iso:1", "iso:2"}
    driver.sink.discard(list(captured))
