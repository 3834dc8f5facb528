"""The Python API: `LLM(model).generate(prompts, sampling)` for offline batch
work, without HTTP.

One engine, the server's own (EngineCore on a model loaded as `tierlm serve`
loads it), runs on a private asyncio event loop in a background thread, so
`generate` is an ordinary blocking call that works where an event loop already
runs in the calling thread (Jupyter). Every prompt of a call is submitted at
once: continuous batching decodes up to `max_concurrent_requests` of them
together and queues the rest. Values are checked as the HTTP layer checks them
(tierlm.serving.validation), so a bad one raises ValueError before anything runs.

    from tierlm import LLM, SamplingParams

    with LLM("SmolLM2-135M-Instruct", max_concurrent_requests=16) as llm:
        outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, temperature=0))
        print(outputs[0].text)
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from tierlm.backends import choose_cuda_graphs
from tierlm.config import Settings, _checked, load_settings
from tierlm.engine.core import EngineCore
from tierlm.engine.request import MemoryGuardError, Request, RequestOutput, SamplingParams, TokenLogprobs
from tierlm.pool.discovery import read_entry
from tierlm.serving.assembly import resolve_model, serve
from tierlm.serving.errors import APIError
from tierlm.serving.templates import render_chat_template
from tierlm.serving.validation import check_request, check_template_args

__all__ = ["LLM", "Completion", "SamplingParams"]

Prompt = str | list[int]
Conversation = list[dict]
CLOSE_TIMEOUT_S = 120.0  # the engine's close writes the hot tier back to SSD


@dataclass
class Completion:
    """What one prompt gave."""

    index: int  # the prompt's place in the call
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache supplied
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # when SamplingParams.logprobs asked


class LLM:
    def __init__(self, model: str | Path | None = None, *, config: str | Path | None = None, **settings):
        """`model`: a model folder, a model's name in the model folder (the
        `model_dir` setting), or "default" (the built-in SmolLM2-135M-Instruct);
        None: the settings' `model`. `config`: the settings file (default
        ~/.tierlm/settings.toml). Keyword arguments are settings
        (tierlm.config.Settings: max_concurrent_requests=16, prefix_cache=False,
        ssd_cache=False, memory_limit="8GB", ...) and win over the environment's
        TIERLM_* and the file, as the command line's flags do."""
        overrides = _checked(settings, "LLM()")
        if model is not None:
            overrides["model"] = str(model)
        base = load_settings(overrides, str(config) if config is not None else None)
        choose_cuda_graphs(base.cuda_graphs)  # before the model's first kernel, as the server
        path = resolve_model(base)
        if not path.is_dir():
            raise FileNotFoundError(f"no model {base.model!r}: not a folder, nor a model in {base.model_dir}")
        name = base.for_model(path.name).served_model_name or path.name
        self.settings: Settings = base.for_model(name)
        self._runner = _LoopThread(f"tierlm-llm-{name}")
        try:  # loaded as the server loads it; a load that fails gives back what it took
            served = self._runner.submit(serve(read_entry(path, name), self.settings, grammars=False)).result()
        except BaseException:
            self._runner.stop()
            raise
        self.info, self.engine, self.vocab_size = served.info, served.engine, served.vocab_size
        self._close = weakref.finalize(self, _shut_down, self._runner, self.engine)
        # not at exit: by then concurrent.futures has shut the engine's worker down
        self._close.atexit = False

    # ---- what is loaded -----------------------------------------------------

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def context_length(self) -> int:
        return min(self.info.context_length, self.settings.context_limit or self.info.context_length)

    # ---- generating ---------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, progress: bool = True) -> list[Completion]:
        """Completions of `prompts` (texts, or lists of token ids), in their order.
        The text continues each prompt as it stands (a leading space is kept).
        `sampling`: one for all, or one per prompt; None: the model's defaults
        from the settings. A max_tokens that would run past the context is cut
        to fit (finish_reason "length"). `progress`: a progress bar (rich)."""
        self._check_open()
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        tokens = [self._prompt_tokens(i, p) for i, p in enumerate(prompts)]
        return self._run(tokens, sampling, progress, keep_leading_space=True)

    def chat(self, conversations: Conversation | Sequence[Conversation], sampling: SamplingParams
             | Sequence[SamplingParams] | None = None, *, progress: bool = True,
             chat_template_kwargs: dict | None = None) -> list[Completion]:
        """Replies to `conversations` (each a list of {"role", "content"}
        messages), in their order, through the model's chat template.
        `chat_template_kwargs`: template variables, over the settings' own."""
        self._check_open()
        conversations = [conversations] if _is_single_conversation(conversations) else list(conversations)
        try:
            variables = self.settings.template_kwargs(check_template_args(chat_template_kwargs))
        except APIError as e:
            raise ValueError(e.message) from None
        tokens = []
        for i, messages in enumerate(conversations):
            try:
                tokens.append(render_chat_template(self.tokenizer, list(messages), variables, None, False))
            except APIError as e:
                raise ValueError(f"conversation {i}: {e.message}") from None
        return self._run(tokens, sampling, progress, keep_leading_space=None)

    def _check_open(self) -> None:
        if not self._close.alive:
            raise RuntimeError(f"this LLM ({self.name}) is closed")

    def _prompt_tokens(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        # ids are ints, not bools (a type's set: 0.4 ms for 20k ids, against 1.6 for isinstance each)
        if isinstance(prompt, Sequence) and set(map(type, prompt)) <= {int}:
            return list(prompt)
        raise TypeError(f"prompt {index}: expected a string or a list of token ids, got {type(prompt).__name__}")

    def _run(self, tokens: list[list[int]], sampling, progress: bool,
             keep_leading_space: bool | None) -> list[Completion]:
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(tokens)
        elif len(sampling) != len(tokens):
            raise ValueError(f"{len(sampling)} SamplingParams for {len(tokens)} prompts")
        shared = len(set(map(id, sampling))) == 1
        requests = [self._request(i, t, p, keep_leading_space, "sampling" if shared else f"sampling[{i}]")
                    for i, (t, p) in enumerate(zip(tokens, sampling))]
        if not requests:
            return []
        with _progress_bar(len(requests), progress) as advance:
            future = self._runner.submit(_generate_all(self.engine, requests, advance))
            try:
                results = future.result()
            except BaseException:  # KeyboardInterrupt: the requests stop (stream_outputs aborts them)
                future.cancel()
                raise
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException) or r.error is not None]
        if failed:
            i, r = failed[0]
            why = f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else r.error
            more = f" ({len(failed) - 1} more prompts failed too)" if len(failed) > 1 else ""
            raise RuntimeError(f"prompt {i} failed: {why}{more}") from (r if isinstance(r, BaseException) else None)
        return [_completion(i, req, out) for i, (req, out) in enumerate(zip(requests, results))]

    def _request(self, index: int, tokens: list[int], params: SamplingParams | None,
                 keep_leading_space: bool | None, where: str) -> Request:
        """The engine request for one prompt, its values checked as the HTTP
        layer checks them; ValueError naming the prompt if one is off."""
        if params is None:
            params = SamplingParams(**self.settings.sampling_defaults())
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: expected a SamplingParams, got {type(params).__name__}")
        context = self.context_length
        if not tokens:
            raise ValueError(f"prompt {index} is empty")
        if len(tokens) >= context:
            raise ValueError(f"prompt {index} has {len(tokens)} tokens; this model's maximum context length is "
                             f"{context} tokens. Please shorten it.")
        if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
            raise ValueError(f"{where}: 'max_tokens': must be an integer of at least 1, got {params.max_tokens!r}")
        max_tokens = min(params.max_tokens, context - len(tokens))
        try:
            checked = check_request(dataclasses.replace(params, max_tokens=max_tokens), tokens, self.vocab_size)
            self.engine.scheduler.guard.check_alone(len(tokens), max_tokens)
        except APIError as e:
            raise ValueError(f"{f'prompt {index}' if e.param == 'prompt' else where}: {e.message}") from None
        except MemoryGuardError as e:
            raise ValueError(f"prompt {index}: {e}") from None
        if keep_leading_space is not None:
            checked.keep_leading_space = keep_leading_space
        return Request(self.engine.new_request_id("llm"), tokens, checked)

    # ---- life cycle ---------------------------------------------------------

    def close(self) -> None:
        """Stops the engine (the hot tier is written back to the SSD tier) and its
        threads, and frees the model. Also done when the LLM is garbage-collected."""
        self._close()

    def __enter__(self) -> LLM:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LLM({self.name!r}, path={str(self.info.path)!r})"


# ---- the engine's loop ------------------------------------------------------------


class _LoopThread:
    """A private asyncio event loop, run by a daemon thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_default_executor())  # asyncio.to_thread's
            self.loop.close()

    def submit(self, coro) -> Future:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("an LLM cannot be called from its own engine's thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join()


def _shut_down(runner: _LoopThread, engine: EngineCore) -> None:
    """Close the engine on its loop, then end the loop's thread (the LLM's
    finalizer: it must not hold the LLM itself)."""
    if threading.current_thread() is runner.thread:  # collected on the loop's own thread: cannot wait
        task = runner.loop.create_task(engine.close())
        task.add_done_callback(lambda _: runner.loop.stop())
        return
    try:
        runner.submit(engine.close()).result(CLOSE_TIMEOUT_S)
    finally:
        runner.stop()


async def _generate_all(engine: EngineCore, requests: list[Request], advance: Callable[[], None]) -> list:
    """Every request's merged output (or the exception it raised), in order; all
    added to the engine in one turn of the loop, so they batch."""

    async def one(request: Request) -> RequestOutput:
        try:
            return await engine.generate(request)
        finally:
            advance()

    return await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)


def _completion(index: int, request: Request, output: RequestOutput) -> Completion:
    reason = output.finish_reason
    return Completion(
        index=index, text=output.text, token_ids=list(output.token_ids),
        finish_reason=None if reason is None else reason.value,
        prompt_tokens=output.prompt_tokens or len(request.prompt_tokens),
        completion_tokens=output.completion_tokens, cached_tokens=output.cached_tokens,
        prompt_token_ids=request.prompt_tokens, logprobs=output.logprobs,
    )


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, Sequence) and bool(prompts)
                                        and all(isinstance(t, int) for t in prompts))


def _is_single_conversation(conversations) -> bool:
    return isinstance(conversations, Sequence) and bool(conversations) and isinstance(conversations[0], dict)


class _progress_bar:
    """A rich progress bar of finished prompts (nothing when `show` is off);
    `advance` may be called from any thread."""

    def __init__(self, total: int, show: bool):
        self.total, self.show, self.bar = total, show, None

    def __enter__(self) -> Callable[[], None]:
        if not self.show:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True))
        self.bar.start()
        task = self.bar.add_task("generating", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
