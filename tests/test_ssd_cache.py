"""The SSD tier through real server processes: restarts, damaged files, the size
cap, SIGKILL at known points of a block write, and two models sharing one folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_server, stop_server, wait_until
from safetensors import SafetensorError
from safetensors.numpy import load as st_load

from tierlm.cache import block_file

MODEL = "SmolLM2-135M-Instruct"
BLOCK = "32"
DOC = "The history of the printing press and its effects on the spread of ideas in Europe. "


def prompt(i: int = 0, repeat: int = 12) -> list[dict]:
    return [{"role": "system", "content": f"Document {i}. " + DOC * repeat},
            {"role": "user", "content": "Summarize the document in one sentence."}]


def ask(server, messages, max_tokens=8, model=MODEL):
    return server.client().chat.completions.create(model=model, messages=messages, temperature=0,
                                                   max_tokens=max_tokens)


def stats(server) -> dict:
    return httpx.get(server.v1 + "/cache/stats").json()["prefix_cache"]


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.safetensors"))


def serve(model_path, folder: Path, *extra):
    folder.mkdir(parents=True, exist_ok=True)
    return start_server(model_path, folder / f"server-{time.monotonic_ns()}.log", "--cache-block-size", BLOCK,
                        "--ssd-cache-dir", str(folder / "ssd"), *extra)


class _Answers(dict):
    """Prompt i's answer computed with no cache at all, asked the first time it is wanted."""

    def __init__(self, server):
        super().__init__()
        self.server = server

    def __missing__(self, i: int) -> str:
        self[i] = ask(self.server, prompt(i)).choices[0].message.content
        return self[i]


@pytest.fixture(scope="module")
def reference(uncached_server):
    """Answers computed with no cache at all (the fast run wants two of them)."""
    return _Answers(uncached_server)


@pytest.fixture(scope="module")
def seeded(model_path, tmp_path_factory):
    """An SSD folder of the default model's blocks for prompts 0, 1 and 2, written by
    one server that answered them (prompt 0 twice: cold, then from the hot tier) and
    stopped gracefully, which flushes its hot tier to SSD; and its two answers to
    prompt 0. The tests that start from a model's blocks on disk each take a copy."""
    folder = tmp_path_factory.mktemp("seeded")
    first = serve(model_path, folder)
    try:
        answers = [ask(first, prompt(0)).choices[0].message.content for _ in range(2)]
        ask(first, prompt(1))
        ask(first, prompt(2))
    finally:
        stop_server(first)  # graceful: the hot tier is flushed to SSD
    return folder / "ssd", answers


def seeded_copy(seeded, tmp_path: Path) -> set[Path]:
    """The seeded folder copied to tmp_path/ssd (times kept); its block files."""
    shutil.copytree(seeded[0], tmp_path / "ssd")
    return set(block_files(tmp_path / "ssd"))


@pytest.fixture(scope="module")
def restarted(model_path, tmp_path_factory, seeded, tokenizer):
    """A second server, started on a copy of the seeded folder in which prompt 1's
    blocks are damaged (its chain's first block bit-flipped, another truncated) and
    prompt 0's are intact; and the damaged first block. Files are checked only when
    read, so each test asks its own prompt and judges the stats' change."""
    folder = tmp_path_factory.mktemp("restarted")
    files = _chain_of(sorted(seeded_copy(seeded, folder)), "Document 1.", tokenizer)  # prompt 1's blocks
    assert len(files) >= 4
    # bit-flip the first block of the chain, truncate another
    first_block = _chain_start(files)
    data = bytearray(first_block.read_bytes())
    data[-100] ^= 0xFF
    first_block.write_bytes(bytes(data))
    truncated = next(f for f in files if f != first_block)
    truncated.write_bytes(truncated.read_bytes()[:1000])

    second = serve(model_path, folder, "--no-ssd-preload")  # the blocks a lookup reads (test_ssd_preload.py: at start)
    try:
        yield second, first_block
    finally:
        stop_server(second)


def test_restart_hits_ssd_and_computes_only_the_last_token(restarted, reference, seeded):
    """Its full blocks and, after them, a part block found on SSD by its key."""
    second, _ = restarted  # on the first server's blocks, flushed at its graceful stop
    cold, hot = seeded[1]

    before = stats(second)
    after = ask(second, prompt(0))
    n = after.usage.prompt_tokens
    assert after.usage.prompt_tokens_details.cached_tokens == n - 1
    s = stats(second)
    assert s["ssd_hit_tokens"] - before["ssd_hit_tokens"] == n - 1
    assert s["part_hit_tokens"] - before["part_hit_tokens"] == (n - 1) % 32 > 0
    assert s["ssd"]["errors"] == before["ssd"]["errors"]  # prompt 0's files all passed their checks
    texts = {cold, hot, after.choices[0].message.content}
    assert texts == {reference[0]}  # cold, hot hit and SSD hit all agree with no cache


def test_damaged_files_are_deleted_and_the_request_still_succeeds(restarted, reference):
    second, first_block = restarted
    errors_before = stats(second)["ssd"]["errors"]
    answer = ask(second, prompt(1))
    assert answer.choices[0].message.content == reference[1]
    assert answer.usage.prompt_tokens_details.cached_tokens == 0  # the chain's first block was bad
    assert stats(second)["ssd"]["errors"] >= errors_before + 1
    assert not first_block.exists()


def _chain_start(files: list[Path]) -> Path:
    """The block file whose parent is no other file's key: the prompt's first block."""
    metas = {f: _metadata(f) for f in files}
    keys = {m["key"] for m in metas.values()}
    return next(f for f, m in metas.items() if m["parent"] not in keys)


def _chain_of(files: list[Path], text: str, tokenizer) -> list[Path]:
    """The blocks of the one prompt (of several in `files`) whose first block holds `text`."""
    metas = {f: _metadata(f) for f in files}
    keys = {m["key"] for m in metas.values()}
    starts = [f for f, m in metas.items() if m["parent"] not in keys]
    start = [f for f in starts if text in tokenizer.decode(st_load(f.read_bytes())["tokens"].tolist())]
    assert len(start) == 1, (text, starts)
    chain, key = [start[0]], metas[start[0]]["key"]
    while child := next((f for f, m in metas.items() if m["parent"] == key), None):
        chain.append(child)
        key = metas[child]["key"]
    return chain


def _metadata(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]


@pytest.mark.slow  # a server of its own, many prompts
def test_size_cap_holds_under_a_stream_of_new_prompts(model_path, tmp_path):
    cap = 12 * 2**20
    srv = serve(model_path, tmp_path, "--ssd-write-through", "--ssd-cache-size", str(cap))
    try:
        for i in range(6):
            ask(srv, prompt(10 + i), max_tokens=2)
        # every stored block written (each store is enqueued; none is on disk already)
        # and the writer idle; stores land a step after the answer, so both are needed
        wait_until(lambda: (s := stats(srv))["ssd"]["pending_bytes"] == 0
                   and s["ssd"]["writes"] + s["ssd"]["write_drops"] == s["stored_blocks"] + s["stored_parts"])
        s = stats(srv)["ssd"]
        on_disk = sum(f.stat().st_size for f in block_files(tmp_path / "ssd"))
        assert s["writes"] > 0 and s["evictions"] > 0
        assert on_disk <= cap and s["bytes"] <= cap
    finally:
        stop_server(srv)


# (point, n): the writer stops at that point of its n-th write and the server is
# SIGKILLed there. Writes go in chain order, so the n-th write is the prompt's n-th block.
# One kill per point (each costs a server start), each at a different n.
KILLS = [("partial", 4), ("written", 2), ("renamed", 6)]
BEFORE_RENAME = ("partial", "written")


@pytest.mark.slow  # SIGKILLs servers at each point of a write
def test_sigkill_mid_write_never_leaves_a_block_that_loads_wrong(model_path, tmp_path, reference, monkeypatch):
    """Kills the server at known points of a block write (TIERLM_TEST_SSD_PAUSE, a hook
    of the SSD writer): half the temp file written; the temp file whole and fsynced
    but not renamed; renamed but its folder not yet fsynced. Before the rename no
    file may be visible under the block's name; after it the file is whole. A server
    started afterwards gives the answers of no cache at all, using exactly the
    blocks that were renamed into place, and rejects nothing."""
    ssd, marker = tmp_path / "ssd", tmp_path / "ssd.test-pause.json"
    for i, (point, n) in enumerate(KILLS):
        marker.unlink(missing_ok=True)
        monkeypatch.setenv("TIERLM_TEST_SSD_PAUSE", f"{point}:{n}")
        srv = serve(model_path, tmp_path, "--ssd-write-through")
        monkeypatch.delenv("TIERLM_TEST_SSD_PAUSE")
        try:
            assert ask(srv, prompt(i)).choices[0].message.content == reference[i]
            wait_until(marker.exists, timeout=60)  # the writer stopped there and sleeps
        finally:
            os.killpg(srv.process.pid, signal.SIGKILL)
            srv.process.wait()
            stop_server(srv)  # closes its log
        where = json.loads(marker.read_text())
        tmp, final = Path(where["tmp"]), Path(where["path"])
        assert where["point"] == point
        if point in BEFORE_RENAME:
            assert not final.exists(), f"killed at {point}: a file is already under the block's name"
            assert tmp.exists() and _whole(tmp) == (point == "written"), f"killed at {point}: temp file wrong"
        else:
            assert not tmp.exists() and _whole(final)
    assert all(_whole(f) for f in block_files(ssd))  # whatever is under a block's name is whole

    # no hook; the temp files left by the kills are there (its scan removes those older than 60 s)
    srv = serve(model_path, tmp_path)
    try:
        for i, (point, n) in enumerate(KILLS):
            answer = ask(srv, prompt(i))
            assert answer.choices[0].message.content == reference[i]
            landed = n - 1 if point in BEFORE_RENAME else n  # blocks before the n-th, and the n-th once renamed
            assert answer.usage.prompt_tokens_details.cached_tokens == landed * int(BLOCK), (point, n)
        s = stats(srv)["ssd"]
        assert s["errors"] == 0 and s["reads"] == sum(n - (p in BEFORE_RENAME) for p, n in KILLS)
    finally:
        stop_server(srv)


def _whole(path: Path) -> bool:
    """A block file that loads and passes its own checks (checksum included)."""
    try:
        data, meta = path.read_bytes(), _metadata(path)
        tokens = tuple(st_load(data)["tokens"].tolist())
        block_file.verify(data, bytes.fromhex(meta["key"]), tokens, bytes.fromhex(meta["fingerprint"]),
                          meta["signature"])
    except (OSError, ValueError, KeyError, SafetensorError):  # missing, truncated, garbled
        return False
    return True


def _twin(model_path: Path, folder: Path, variant: int) -> Path:
    """The default model's files (linked) with a config that differs: the same weights,
    another model as far as the cache knows."""
    twin = folder / "twin-model"
    twin.mkdir()
    for item in model_path.iterdir():
        if item.name != "config.json":
            (twin / item.name).symlink_to(item.resolve())
    config = json.loads((model_path / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps({**config, "tierlm_test_variant": variant}))
    return twin


@pytest.mark.slow  # servers of their own
def test_two_models_sharing_a_folder_never_read_each_others_blocks(model_path, tmp_path, reference, seeded,
                                                                   tokenizer):
    twin = _twin(model_path, tmp_path, 1)
    files_of_a = seeded_copy(seeded, tmp_path)  # the default model's blocks of prompts 0-2

    b = serve(twin, tmp_path)
    try:
        answer = ask(b, prompt(2), model="twin-model")
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        assert answer.choices[0].message.content == reference[2]
        assert stats(b)["ssd"]["reads"] == 0
    finally:
        stop_server(b)
    assert files_of_a <= set(block_files(tmp_path / "ssd"))  # left alone

    # a file of A's under the name of one of B's blocks is caught by its metadata: each of
    # B's blocks of prompt 2 replaced by A's block of the same tokens
    files_of_b = set(block_files(tmp_path / "ssd")) - files_of_a
    chain_of_a = _chain_of(sorted(files_of_a), "Document 2.", tokenizer)
    chain_of_b = _chain_of(sorted(files_of_b), "Document 2.", tokenizer)
    assert len(chain_of_b) == len(chain_of_a) >= 4
    for donor, f in zip(chain_of_a, chain_of_b):
        f.write_bytes(donor.read_bytes())
    b = serve(twin, tmp_path)
    try:
        answer = ask(b, prompt(2), model="twin-model")
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        assert answer.choices[0].message.content == reference[2]
        assert stats(b)["ssd"]["errors"] >= 1
    finally:
        stop_server(b)


@pytest.mark.slow  # servers of their own
def test_clearing_one_models_ssd_files_leaves_the_other_models_files(model_path, tmp_path, seeded):
    twin = _twin(model_path, tmp_path, 2)
    files_of_a = seeded_copy(seeded, tmp_path)  # the default model's, written at its server's stop
    b = serve(twin, tmp_path, "--ssd-write-through")
    try:
        ask(b, prompt(1), model="twin-model")
        wait_until(lambda: stats(b)["ssd"]["pending_bytes"] == 0)
        files_of_b = set(block_files(tmp_path / "ssd")) - files_of_a
        assert files_of_a and files_of_b
        cleared = httpx.delete(b.v1 + "/cache", params={"ssd": "true"}).json()["cleared_blocks"]
        assert cleared >= len(files_of_b)  # its hot blocks and its files
        assert set(block_files(tmp_path / "ssd")) == files_of_a
    finally:
        stop_server(b)


@pytest.mark.slow  # two servers at once
def test_a_replica_serves_from_ssd_what_another_replica_computed(model_path, tmp_path, reference):
    """Two servers over one --ssd-cache-dir, both started on an empty folder: what A
    computed and wrote is a hit for B, found on disk though B's start-up scan saw none
    of it (tests/test_ssd_shared_folder.py stresses the folder itself)."""
    a = serve(model_path, tmp_path, "--ssd-write-through")
    b = serve(model_path, tmp_path)
    try:
        assert ask(a, prompt(3)).choices[0].message.content == reference[3]
        wait_until(lambda: (s := stats(a))["ssd"]["pending_bytes"] == 0
                   and s["ssd"]["writes"] == s["stored_blocks"] + s["stored_parts"] > 0)
        answer = ask(b, prompt(3))
        assert answer.choices[0].message.content == reference[3]
        assert answer.usage.prompt_tokens_details.cached_tokens == stats(a)["stored_blocks"] * int(BLOCK) > 0
        s = stats(b)
        assert s["ssd"]["reads"] == stats(a)["stored_blocks"] and s["ssd"]["errors"] == 0
    finally:
        stop_server(a)
        stop_server(b)
