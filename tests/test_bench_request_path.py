"""bench_lab.request_path's table: each hit against its own round's cold
prompt; a row a round below three rounds, the rounds' medians from three on."""

from __future__ import annotations

from bench_lab import request_path


def _round(cold: float, hot: float, ssd: float) -> dict:
    turn = lambda s: {"ttft_s": s, "before_engine_ms": 3.0, "engine_ms": 1000 * s - 3.0}  # noqa: E731
    return {"cold": turn(cold), "hot": turn(hot), "ssd": turn(ssd)}


def _size(rounds: list[dict]) -> dict:
    median = lambda kind, what: sorted(r[kind][what] for r in rounds)[len(rounds) // 2]  # noqa: E731
    return {"prompt_tokens": 20000, "rounds": rounds,
            **{f"median_{k}_{w}": median(k, w) for k in ("cold", "hot", "ssd")
               for w in ("ttft_s", "before_engine_ms", "engine_ms")}}


def test_two_rounds_are_two_rows_each_against_its_own_cold():
    table = request_path.table({"sizes": [_size([_round(0.33, 0.037, 0.045), _round(1.2, 0.043, 0.040)])]})
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| 20000, round 1 | 0.330 s | 0.037 s (0.112) | 0.045 s (0.136)")
    assert rows[1].startswith("| 20000, round 2 | 1.200 s | 0.043 s (0.036)")


def test_three_rounds_are_one_row_of_medians_and_the_median_ratio():
    rounds = [_round(0.33, 0.037, 0.045), _round(1.2, 0.043, 0.040), _round(0.36, 0.036, 0.05)]
    assert request_path.over_cold(rounds, "hot") == 0.036 / 0.36
    (row,) = request_path.table({"sizes": [_size(rounds)]}).splitlines()[2:]
    assert row.startswith("| 20000 | 0.360 s | 0.037 s (0.100) | 0.045 s")


def test_a_run_under_other_mlx_or_tierlm_variables_is_another_benchmark(monkeypatch, tmp_path):
    """The variables a run had (the servers it starts inherit them) go into its
    file, its command line and request_path's title, secrets left out: a run
    with MLX_USE_CUDA_GRAPHS=1 is not the newer figure of one without."""
    import json
    import sys

    from tierlm.bench import runs
    from tierlm.bench.report import write_json

    for name in [n for n in list(__import__("os").environ) if n.startswith(("MLX_", "TIERLM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "1")
    monkeypatch.setenv("TIERLM_API_KEY", "sk-secret")
    monkeypatch.setattr(sys, "argv", ["x", "--sizes", "20000"])
    command = runs.command_line("python -m bench_lab.request_path")
    assert command == "MLX_USE_CUDA_GRAPHS=1 python -m bench_lab.request_path --sizes 20000"
    doc = json.loads(write_json(tmp_path / "r.json", "request_path", {"model": "m", "sizes": []}, command).read_text())
    assert doc["environment"] == {"MLX_USE_CUDA_GRAPHS": "1"} and "sk-secret" not in json.dumps(doc)
    sizes = [{"prompt_tokens": 20000}]
    assert request_path.title(doc | {"sizes": sizes}).endswith(", under MLX_USE_CUDA_GRAPHS=1: 20000 tokens")
    assert request_path.title({"model": "m", "sizes": sizes}).endswith("m: 20000 tokens")
