"""The Python API (tierlm.LLM): offline batches through the server's engine, on
the default model, without HTTP."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_testing import run, started

from tierlm import LLM, SamplingParams
from tierlm.engine.request import Request, RequestOutput

PROMPTS = [
    "The capital of France is",
    "One, two, three,",
    "def fibonacci(n):",
    "The best way to learn a language is",
    "Once upon a time",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def llm(model_path, tmp_path_factory):
    """The default model by its name in the model folder; no settings file, no SSD tier."""
    no_file = tmp_path_factory.mktemp("llm") / "settings.toml"
    with LLM(model_path.name, config=no_file, model_dir=str(model_path.parent), ssd_cache=False) as llm:
        yield llm


def test_a_batch_gives_what_one_by_one_and_the_servers_engine_give(llm, loaded):
    steps = llm.engine.scheduler.counters.steps
    batch = llm.generate(PROMPTS, GREEDY, progress=False)
    batch_steps = llm.engine.scheduler.counters.steps - steps
    assert [o.index for o in batch] == list(range(len(PROMPTS)))
    assert all(o.completion_tokens == len(o.token_ids) > 0 for o in batch)
    # decoded together: about one step per token of the longest, not one per token of all
    assert batch_steps < sum(o.completion_tokens for o in batch) * 0.6

    alone = [llm.generate(p, GREEDY, progress=False)[0] for p in PROMPTS]
    assert [o.token_ids for o in alone] == [o.token_ids for o in batch]
    assert [o.text for o in alone] == [o.text for o in batch]

    async def engine_outputs() -> list[RequestOutput]:
        engine = await started(loaded)
        try:
            params = SamplingParams(max_tokens=12, temperature=0, keep_leading_space=True)
            return [await engine.generate(Request(engine.new_request_id(), o.prompt_token_ids, params))
                    for o in batch]
        finally:
            await engine.close()

    served = run(engine_outputs())
    assert [o.token_ids for o in served] == [o.token_ids for o in batch]
    assert [o.text for o in served] == [o.text for o in batch]
    assert batch[0].text.startswith(" ")  # the completion continues the prompt as it stands


def test_chat_goes_through_the_chat_template(llm):
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is 2+2?"}]]
    replies = llm.chat(conversations, SamplingParams(max_tokens=24, temperature=0), progress=False)
    assert len(replies) == 2
    for reply, messages in zip(replies, conversations):
        assert reply.prompt_token_ids == list(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert reply.text.strip() and reply.finish_reason in ("stop", "length")
    one = llm.chat(conversations[0], SamplingParams(max_tokens=24, temperature=0), progress=False)
    assert one[0].text == replies[0].text  # a single conversation is a batch of one


def test_token_id_prompts(llm):
    ids = list(llm.tokenizer.encode(PROMPTS[0]))
    by_ids, by_text = llm.generate([ids, PROMPTS[0]], GREEDY, progress=False)
    assert by_ids.prompt_token_ids == ids
    assert by_ids.token_ids == by_text.token_ids
    assert llm.generate(ids, GREEDY, progress=False)[0].token_ids == by_text.token_ids  # one prompt of ids


def test_bad_values_raise_value_error_and_the_llm_still_works(llm):
    with pytest.raises(ValueError, match="top_k"):
        llm.generate(PROMPTS, SamplingParams(top_k=10**9), progress=False)
    with pytest.raises(ValueError, match=r"sampling\[1\]: 'temperature'"):
        llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(temperature=-1)], progress=False)
    with pytest.raises(ValueError, match="prompt 1: prompt token id 999999999"):
        llm.generate([[1, 2], [999999999]], GREEDY, progress=False)
    with pytest.raises(ValueError, match=f"prompt 0 has {llm.context_length} tokens.*maximum context length"):
        llm.generate([[1] * llm.context_length], GREEDY, progress=False)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate([[]], GREEDY, progress=False)
    for not_ids in ([1, True], [1, 2.0], [1, "2"]):
        with pytest.raises(TypeError, match="prompt 1: expected a string or a list of token ids"):
            llm.generate([[1, 2], not_ids], GREEDY, progress=False)
    assert llm.engine.is_alive
    assert llm.generate(PROMPTS[0], GREEDY, progress=False)[0].token_ids


def test_an_engine_error_names_the_prompt(llm, monkeypatch):
    engine, real = llm.engine, llm.engine.generate
    doomed = llm.tokenizer.encode(PROMPTS[2])

    async def failing(request: Request) -> RequestOutput:
        output = await real(request)
        if request.prompt_tokens == doomed:
            output.error, output.error_type = "generation failed: boom", "internal"
        return output

    monkeypatch.setattr(engine, "generate", failing)
    with pytest.raises(RuntimeError, match="prompt 2 failed: generation failed: boom"):
        llm.generate(PROMPTS, GREEDY, progress=False)


@pytest.mark.slow  # a long prompt; the cache is in test_prefix_cache_api
def test_a_repeated_long_prompt_hits_the_prefix_cache(llm):
    prompt = "Here is a long story about a lighthouse keeper and the sea. " * 42  # ~550 tokens
    params = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate(prompt, params, progress=False)[0]
    again = llm.generate(prompt, params, progress=False)[0]
    block = llm.engine.scheduler.cache.block_size  # the setting's, or the device's default
    assert first.prompt_tokens > 2 * block
    assert again.cached_tokens >= block
    assert again.token_ids == first.token_ids


@pytest.mark.slow  # a second LLM
def test_a_small_context_limit_cuts_max_tokens_and_the_context_manager_closes(model_path, tmp_path):
    def ours() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith(("tierlm-llm-", "mlx-"))}

    before = ours()
    with LLM(str(model_path), config=tmp_path / "none.toml", prefix_cache=False, context_limit=40) as llm:
        assert ours() - before
        assert llm.context_length == 40
        [cut] = llm.generate([[1] * 37], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
                             progress=False)
        assert cut.completion_tokens == 3 and cut.finish_reason == "length"  # cut to fit the context
        with pytest.raises(ValueError, match="prompt 0 has 40 tokens.*maximum context length is 40"):
            llm.generate([[1] * 40], GREEDY, progress=False)

        async def in_a_notebook_cell():  # Jupyter's loop runs in the calling thread
            return llm.generate(PROMPTS[:2], GREEDY, progress=True)

        outputs = asyncio.run(in_a_notebook_cell())
        assert len(outputs) == 2 and all(o.token_ids for o in outputs)
        engine = llm.engine
    assert not engine.is_alive and engine.model is None
    # the loop's thread ended; the engine's worker, if this LLM made one, is parked
    # for the next engine (engine/workers.py), not running for this one
    assert {t.name for t in ours() - before} <= {"mlx-idle"}
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS[0], GREEDY)
    llm.close()  # twice is fine


def test_settings_are_checked_like_the_command_lines(tmp_path):
    with pytest.raises(ValueError, match="LLM\\(\\): unknown setting 'max_concurent_requests'"):
        LLM("default", config=tmp_path / "none.toml", max_concurent_requests=4)
    with pytest.raises(FileNotFoundError, match="no model 'no-such-model'"):
        LLM("no-such-model", config=tmp_path / "none.toml", model_dir=str(tmp_path))
