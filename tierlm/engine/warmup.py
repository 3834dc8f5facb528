"""Batch shapes run once while the engine is idle, so that the first requests at
a new concurrency are as fast as the next ones.

MLX's CUDA backend compiles a kernel the first time a shape needs it (about a
second each, measured on an H200: the first request of a fresh machine took 13 s,
the first batch of nine 3.9 s) and keeps it on disk (`kernel_cache_dir`). A warm
shape is a few tiny requests through a BatchGenerator of its own: prefill and a
few decode steps, greedy and sampled, of prompts of two lengths (a padded batch),
half of them joining the others' running batch; nothing of it reaches the prefix
cache.
Where the engine speculates, on a GPU the decode steps are run again verifying
drafts at each width a step may take (padded to powers of two), every other
step: the first verification of a process compiled for ~33 s on the H200, each
new width a second or more after that, and a plain step after a verification
runs kernels of its own; then one step of rows that end at different places
(as after a verification that kept more of one row's drafts), whose key write
is a kernel of its own too. On a CPU (nothing to compile) they verify at full
width only.

The last shape job but the long context is requests, not a bare generator:
a few requests through a scheduler of the engine's kind with a prefix cache of
its own, then each again as a next turn, so that storing blocks, a hit's
rebuild and its remainder's prefill, and rows leaving the batch at different
steps have run once too. On a new H100, where the jobs before it had warmed
every batch shape, the first 8 concurrent requests still spent ~100 ms more
storing their blocks than the next 8, and ~90 ms more taking finished rows out
of the batch. With 256-token blocks (the default) a GPU's job stores two
blocks of its 512-token prompts and one of its 256-token ones, and hits them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
from mlx import nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from tierlm.backends import describe, gpu
from tierlm.engine.drafts import PromptLookup
from tierlm.engine.quantized_kv import quantized_slots
from tierlm.engine.request import Request, SamplingParams
from tierlm.engine.sampling import make_request_sampler
from tierlm.engine.speculative_batch import SpeculativeGenerator, padded_width, pads_widths, ragged

log = logging.getLogger(__name__)

LONG_PROMPT = 512  # one prompt this long at batch 1: the prefill kernels of a long chunk
LONG_CONTEXT = 65536  # a GPU's last warm job: one prompt up to this long, its prefill chunks' attention graphs
SHORT_PROMPT = 16
EVERY_WIDTH = 256  # run_widths runs every token count up to this (a block: a folded hit remainder's longest)
DECODE_STEPS = 3
REQUEST_ROWS = 8  # the requests job's rows at most: what it warms does not change with more
# a CPU's requests job (warming is off there by default: nothing compiles): short prompts, which hold
# whole blocks only where they are small (64 tokens: two and one, and a hit on them, in its test)
SHORT_REQUEST = 160
# tokens a next turn appends to a prompt and its answer: enough that a GPU's hit
# remainder runs its own attention kernel (backends.gpu.PAD_FROM_QUERIES and up),
# whose first use in a process compiles it (~1.7 s on an H100)
NEXT_TURN = list(range(5, 29))


class WarmJob(NamedTuple):
    batch: int
    prompt_len: int
    requests: bool = False  # through a scheduler of its own (`run_requests`), else a bare generator (`run_shape`)
    widths: bool = False  # the model's linear layers at each token count up to prompt_len (`run_widths`)


def batch_sizes(max_running: int) -> list[int]:
    """1, each power of two and the size after it, and the largest: kernels change
    at such bounds (eight rows and nine took different ones on the H200), and the
    sizes between share theirs."""
    sizes, k = {1, max_running}, 2
    while k <= max_running:
        sizes.update({k, min(k + 1, max_running)})
        k *= 2
    return sorted(sizes)


def warm_shapes(max_running: int, compiles: bool | None = None, long_context: int = 0,
                prefill_step: int = 2048) -> list[WarmJob]:
    """The warm jobs, in the order they run: each batch size with short prompts,
    then a few requests (`run_requests`; long prompts where kernels compile, else
    short ones). Where the device compiles kernels per shape (`compiles`;
    default: a GPU):
    - a full batch of long prompts: on a new H200, 8 streams of 500-token
      prompts ran their first run at 0.45x the second after every short shape
      had been warmed (a full batch's long prefill and its decode over longer
      KV compile kernels of their own);
    - one prompt of each length of `bucket_lengths` (but LONG_PROMPT's);
    - then one prompt of `long_context` tokens (`long_context_tokens`): cuDNN
      builds a graph per shape of queries and keys, per process, so each chunk
      of a long prefill (its queries against every key before them) waits for
      its own the first time: a server's first 20k-token prompt took 1.0 s to
      its first token on the H200, a later one 0.25 s.
    - and before those, the linear layers at each token count of a prefill
      chunk (`run_widths`): a hit's remainder is a new count nearly every turn."""
    compiles = mx.default_device() != mx.cpu if compiles is None else compiles
    requests = WarmJob(min(max_running, REQUEST_ROWS), LONG_PROMPT if compiles else SHORT_REQUEST, True)
    return [WarmJob(1, LONG_PROMPT)] + [WarmJob(b, SHORT_PROMPT) for b in batch_sizes(max_running)] + \
        ([WarmJob(max_running, LONG_PROMPT)] if compiles and max_running > 1 else []) + [requests] + \
        ([WarmJob(1, prefill_step, widths=True)] if compiles else []) + \
        ([WarmJob(1, n) for n in bucket_lengths(prefill_step) if n != LONG_PROMPT] if compiles else []) + \
        ([WarmJob(1, long_context)] if compiles and long_context > LONG_PROMPT else [])


def bucket_lengths(prefill_step: int) -> list[int]:
    """The prompt lengths, up to a prefill chunk, whose attention a GPU's cuDNN
    runs at its own shape (backends.gpu pads the queries to a multiple of
    QUERY_BUCKET): one prompt each builds every graph a chat's one-chunk
    prompts need (~40 ms each the first time)."""
    if not gpu.QUERY_BUCKET:
        return []
    first = (gpu.MAX_QUERIES // gpu.QUERY_BUCKET + 1) * gpu.QUERY_BUCKET
    return list(range(first, prefill_step + 1, gpu.QUERY_BUCKET))


def long_context_tokens(context: int | None, prefill_step: int, fits) -> int:
    """The long warm prompt's length: LONG_CONTEXT, or the model's `context`
    where shorter, halved until `fits(tokens)` (memory), in whole prefill
    chunks (a prompt's last, partial chunk is a shape of its own anyway)."""
    tokens = min(LONG_CONTEXT, context or LONG_CONTEXT)
    while tokens >= prefill_step and not fits(tokens):
        tokens //= 2
    return tokens // prefill_step * prefill_step


def linear_widths(up_to: int) -> list[int]:
    """Token counts `run_widths` runs: each up to EVERY_WIDTH, then each multiple of
    16 and the count after it (cuBLAS's choice of kernel went by such steps on an
    H100: 33 to 48 rows shared one, 49 to 56 another), up to `up_to`."""
    small = range(1, min(up_to, EVERY_WIDTH) + 1)
    larger = (w for k in range(EVERY_WIDTH, up_to + 1, 16) for w in (k, k + 1) if EVERY_WIDTH < w <= up_to)
    return sorted({*small, *larger})


def run_widths(model, stream, up_to: int) -> float:
    """Worker thread: each distinct linear layer of `model` on zeros of every
    count of `linear_widths(up_to)`; the seconds it took. MLX's CUDA backend
    asks cuBLAS for a kernel each time, and cuBLAS's first answer for a new
    number of rows took ~3 ms on an H100 (a 2048 x 2048 bfloat16 product of
    33 rows 3.0 ms, again 0.4; of 34 to 48 rows after it 0.2-0.8; of 49 rows
    2.6), while a hit's remainder (its tokens through every layer) is a new
    number nearly every turn of an agent. 1-1.5 s for a 1B model."""
    tic = time.perf_counter()
    layers = distinct_linears(model)
    with mx.stream(stream):
        for width in linear_widths(up_to):
            mx.eval([layer(mx.zeros((1, width, inputs), dtype)) for layer, inputs, dtype in layers])
    mx.synchronize(stream)
    return time.perf_counter() - tic


def distinct_linears(model) -> list[tuple[nn.Module, int, mx.Dtype]]:
    """One linear layer (plain or quantized) of each kind in `model` (type,
    weight shape and type, bias, bits): (layer, input width, activation type)."""
    kinds = {}
    for _, layer in model.named_modules():
        if isinstance(layer, nn.QuantizedLinear):
            inputs, dtype = layer.weight.shape[-1] * 32 // layer.bits, layer.scales.dtype
        elif isinstance(layer, nn.Linear):
            inputs, dtype = layer.weight.shape[-1], layer.weight.dtype
        else:
            continue
        if layer.weight.ndim != 2 or not mx.issubdtype(dtype, mx.floating):
            continue
        kind = (type(layer).__name__, tuple(layer.weight.shape), layer.weight.dtype, "bias" in layer,
                getattr(layer, "bits", None), getattr(layer, "mode", None))
        kinds.setdefault(kind, (layer, inputs, dtype))
    return list(kinds.values())


class RepeatDrafts(PromptLookup):
    """Drafts of the last token repeated: a warm job verifies drafts whatever
    its model writes."""

    def propose(self, k: int, last: int) -> list[int]:
        return [last] * k


def run_shape(model, stream, batch: int, prompt_len: int, prefill_step: int, drafts: int = 0,
              kv_bits: int = 16, key_scales: list | None = None) -> float:
    """Worker thread: `batch` requests of `prompt_len` tokens, a few tokens each,
    every other one sampled at a temperature, then again verifying drafts at each
    width a step may take with up to `drafts` draft tokens; the seconds it took.
    `kv_bits`: what the batch keeps attention KV at (engine.quantized_kv), its
    keys divided by `key_scales` (engine.key_scaling)."""
    tic = time.perf_counter()
    widths = [1, *draft_widths(drafts)] if pads_widths() else [drafts + 1]  # a CPU compiles nothing
    if prompt_len > LONG_PROMPT:  # the long prompt is for its prefill: once
        widths = widths[:1]
    for width in widths:
        _decode_a_few(model, stream, batch, prompt_len, prefill_step, width - 1, kv_bits, key_scales)
    if drafts and kv_bits == 16 and pads_widths():
        _rows_ending_apart(model, stream)
    return time.perf_counter() - tic


def _rows_ending_apart(model, stream) -> None:
    """A decode step of two rows that end at different places, as after a
    verification that kept more of one row's drafts than of the other's. MLX's
    CUDA backend compiles the scatter that writes such rows' keys
    (ragged_kv: put_along_axis) the first time, per dtype: on an H100 the first
    requests at four streams paid ~3.5 s for it, as the drafting jobs' rows
    had taken their drafts alike and never ended apart."""
    rows = [make_prompt_cache(model) for _ in range(2)]
    if any(type(layer) not in (KVCache, RotatingKVCache) for layer in rows[0]):
        return  # only these become ragged batch rows (speculative_batch.ragged)
    with mx.stream(stream):
        for length, cache in zip((3, 2), rows):
            model(mx.array([[1] * length]), cache=cache)
        batch = [ragged(type(layer[0]).merge(list(layer))) for layer in zip(*rows)]
        for cache in batch:
            cache.drop([1, 0])  # the first row gives back a token: the rows end apart
        mx.eval(model(mx.array([[1], [1]]), cache=batch))


def run_requests(new_scheduler: Callable[[], object], batch: int, prompt_len: int) -> float:
    """Worker thread: `batch` requests of up to `prompt_len` tokens (two lengths)
    through `new_scheduler()` (a Scheduler whose prefix cache, if any, is its
    own: nothing reaches the engine's), then each again with its answer and a
    few tokens more, as an agent's next turn: a hit on the blocks the first
    wave stored. Rows end a step apart, every other one sampled. The seconds
    it took."""
    tic = time.perf_counter()
    scheduler = new_scheduler()
    try:
        prompts = prompts_of_two_lengths(batch, prompt_len)
        answers = _serve(scheduler, prompts)
        _serve(scheduler, [prompt + answer + NEXT_TURN for prompt, answer in zip(prompts, answers)])
    finally:
        scheduler.close()
    return time.perf_counter() - tic


_warm_ids = itertools.count()


def _serve(scheduler, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt as a request, stepped to its end; the tokens of each answer."""
    ids = [f"warm-{next(_warm_ids)}" for _ in prompts]
    for i, (request_id, prompt) in enumerate(zip(ids, prompts)):
        params = SamplingParams(max_tokens=DECODE_STEPS + i % 2, temperature=0.7 if i % 2 else 0.0, seed=0,
                                ignore_eos=True)
        scheduler.add_request(Request(request_id, prompt, params))
    answers: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while scheduler.has_work():
        scheduler.step()
        for output in scheduler.take_outputs():
            if output.error:
                raise RuntimeError(f"warm request failed: {output.error}")
            answers[output.request_id] += output.token_ids
    return [answers[request_id] for request_id in ids]


def draft_widths(drafts: int) -> list[int]:
    """The widths of a verification with up to `drafts` draft tokens (a GPU pads
    them to a power of two: speculative_batch.padded_width)."""
    return sorted({padded_width(w, drafts + 1) for w in range(2, drafts + 2)})


def prompts_of_two_lengths(batch: int, prompt_len: int) -> list[list[int]]:
    """`batch` prompts of up to `prompt_len` tokens, every other one half as long:
    concurrent requests differ in length, so their prefill and decode run with
    a padding mask, whose kernels an unpadded batch never compiles (a new H200
    ran 8 streams' first run at 0.45-0.59x the second with every batch size
    warmed on prompts of one length)."""
    return [[(7 * i + j) % 97 + 3 for j in range(prompt_len - (i % 2) * (prompt_len // 2))]
            for i in range(batch)]


def _step(gen) -> int:
    """One step of `gen`; the sequences it ended."""
    _, responses = gen.next()
    return sum(r.finish_reason is not None for r in responses)


def _decode_a_few(model, stream, batch: int, prompt_len: int, prefill_step: int, drafts: int,
                  kv_bits: int, key_scales: list | None) -> None:
    options = dict(completion_batch_size=batch, prefill_batch_size=min(8, batch),
                   prefill_step_size=prefill_step, stream=stream)
    gen = SpeculativeGenerator(model, lookup=RepeatDrafts, **options) if drafts else BatchGenerator(model, **options)
    try:
        sampled = make_request_sampler(SamplingParams(temperature=0.7, seed=0), lambda message: None)
        greedy = make_request_sampler(SamplingParams(temperature=0), lambda message: None)
        prompts = prompts_of_two_lengths(batch, prompt_len)
        caches = None if kv_bits == 16 else \
            [quantized_slots(make_prompt_cache(model), kv_bits, key_scales, describe(model).kv_tail) for _ in prompts]
        samplers = [sampled if i % 2 else greedy for i in range(batch)]
        if drafts:
            gen.speculation.draft_alternately()
        # half the rows, then the rest joining the running batch, as requests come
        first = batch - batch // 2
        pending = 0
        for n, wave in enumerate([range(first), range(first, batch)][: 1 + (batch > 1)]):
            uids = gen.insert([prompts[i] for i in wave], max_tokens=[DECODE_STEPS + n] * len(wave),
                              caches=caches and [caches[i] for i in wave],
                              samplers=[samplers[i] for i in wave])
            if drafts:
                for uid in uids:
                    gen.speculation.limits[uid] = drafts
            pending += len(wave) - _step(gen)
        while pending:
            pending -= _step(gen)
    finally:
        gen.close()
        mx.synchronize(stream)
