"""tierlm.serving.piece_store: a tokenizer's chat pieces kept across restarts,
in files read back by a new encoder (and a new server) of the same tokenizer."""

from __future__ import annotations

from array import array

import httpx
import pytest

from tierlm.serving import piece_store
from tierlm.serving.prompt_pieces import PieceEncoder

from conftest import start_server, stop_server

PIECES = [("plain", array("I", [1, 2, 3])), ("résumé 🙂\n\n", array("I", [4_000_000_000, 0])), ("", array("I"))]


def test_pieces_written_are_read_back_in_order(tmp_path):
    path = tmp_path / "pieces" / "a.bin"
    piece_store.write(path, PIECES)
    assert piece_store.read(path) == PIECES
    assert [p.name for p in path.parent.iterdir()] == ["a.bin"]  # nothing left aside


def test_a_file_cut_short_or_damaged_keeps_the_records_before_it(tmp_path):
    path = tmp_path / "a.bin"
    piece_store.write(path, PIECES)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    assert piece_store.read(path) == PIECES[:2]
    damaged = bytearray(data)
    damaged[len(piece_store.MAGIC) + 12 + 2] ^= 0xFF  # a byte of the first piece's text
    path.write_bytes(bytes(damaged))
    assert piece_store.read(path) == []
    path.write_bytes(b"something else")
    assert piece_store.read(path) == []
    assert piece_store.read(tmp_path / "none.bin") == []


def test_the_file_is_the_tokenizers_own(tmp_path, model_path):
    from tierlm.models.loader import tokenizer_stamp

    stamp = tokenizer_stamp(model_path)
    assert piece_store.path_for(tmp_path, model_path, stamp) == piece_store.path_for(tmp_path, model_path, stamp)
    changed = (*stamp[:-1], (stamp[-1][0], stamp[-1][1] + 1, stamp[-1][2]))  # a file of another size
    assert piece_store.path_for(tmp_path, model_path, changed) != piece_store.path_for(tmp_path, model_path, stamp)


def _chat(tokenizer, question: str) -> str:
    source = "def area(r):\n    return 3.14159 * r ** 2\n\n\n" * 200
    return tokenizer.apply_chat_template([{"role": "user", "content": f"Here:\n{source}"},
                                          {"role": "assistant", "content": "It computes areas."},
                                          {"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)


def test_a_new_encoder_reads_what_the_last_one_kept_and_tokenizes_only_new_text(tokenizer, tmp_path):
    store = tmp_path / "pieces" / "t.bin"
    first = PieceEncoder(tokenizer, store)
    text = _chat(tokenizer, "And the perimeter?")
    assert first.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    first.save()
    assert store.exists()

    second = PieceEncoder(tokenizer, store)
    misses = second.misses  # its probe's
    assert second.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert second.misses == misses and second.hits >= 5
    later = _chat(tokenizer, "And the volume of a sphere?")
    assert second.encode(later) == list(tokenizer.encode(later, add_special_tokens=False))
    assert second.misses == misses + 1  # the new question alone


def test_an_encoder_turned_off_leaves_no_file(tokenizer, tmp_path):
    store = tmp_path / "t.bin"
    encoder = PieceEncoder(tokenizer, store)
    encoder.encode(_chat(tokenizer, "Why?"))
    encoder.save()
    assert store.exists()
    encoder._disable("a test")
    encoder.save()
    assert not store.exists()


@pytest.mark.slow
def test_a_restarted_server_tokenizes_only_the_new_message(model_path, tmp_path):
    """The pieces go to the SSD folder when the server stops and come back when
    it starts: after a restart the next turn of a conversation tokenizes its new
    message alone (/stats counts the pieces). Clearing the SSD folder drops them."""
    messages = [{"role": "user", "content": "Here is a file:\n" + "x = 1\ny = 2\n\n" * 120},  # ~1.3k tokens
                {"role": "assistant", "content": "It sets x and y."}]
    body = {"model": model_path.name, "max_tokens": 1, "temperature": 0}
    srv = start_server(model_path, tmp_path / "first.log")
    try:
        r = httpx.post(srv.v1 + "/chat/completions", timeout=120,
                       json={**body, "messages": messages + [{"role": "user", "content": "What is x?"}]})
        assert r.status_code == 200, r.text
    finally:
        stop_server(srv)
    assert list((tmp_path / "ssd-cache" / "pieces").glob("*.bin"))

    srv = start_server(model_path, tmp_path / "second.log")
    try:
        before = srv.stats()["prompt_pieces"]
        assert before["store"] and before["tokens"] > 1000
        r = httpx.post(srv.v1 + "/chat/completions", timeout=120,
                       json={**body, "messages": messages + [{"role": "user", "content": "What is y?"}]})
        assert r.status_code == 200, r.text
        after = srv.stats()["prompt_pieces"]
        assert after["misses"] - before["misses"] == 1 and after["hits"] > before["hits"]
        # clearing the SSD folder clears the prompts' text kept beside it
        assert httpx.delete(srv.v1 + "/cache", params={"ssd": "true"}).status_code == 200
        assert srv.stats()["prompt_pieces"]["tokens"] == 0
        assert not list((tmp_path / "ssd-cache" / "pieces").glob("*.bin"))
    finally:
        stop_server(srv)
    assert not list((tmp_path / "ssd-cache" / "pieces").glob("*.bin"))
