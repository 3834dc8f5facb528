"""Embedding throughput, in process: texts per second of tierlm's encoder
(`load_encoder(path).embed`, MLX) against sentence-transformers
(`SentenceTransformer(path).encode`, PyTorch) on the same folder and the same
CPU, side by side in one run.

sentence-transformers and torch are not dependencies of tierlm: they run in a
subprocess with a python that has them (--st-python, e.g. a venv made with
`python3 -m venv /tmp/st-venv && /tmp/st-venv/bin/pip install torch
sentence-transformers`), which takes texts on its standard input and answers
its time. Both arms get the same texts cut into the same batches (one call per
batch: `embed(batch)`, `encode(batch, batch_size=len(batch))`), each batch
padded to its longest text by either side. Rounds alternate which arm goes
first; one warm-up round each is not counted. Figures are the medians of the
rounds, and the ratio is tierlm ÷ sentence-transformers texts per second.

The texts: windows of a fixed mixed corpus (prose, code, numbers), 4 to 120
words, seeded, so every run embeds the same texts. Both arms' vectors of the
first batch are compared too (cosine), so the arms are known to do the same work.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench_lab import lab_parser, write_result
from tierlm.loadgen.metrics import median

CORPUS = """
Embeddings map a piece of text to a vector so that texts with similar meaning lie close together.
Search engines, recommendation systems and retrieval-augmented generation all rely on them. A
sentence encoder reads the tokens of a text, lets every token attend to every other one, and pools
the result into a single vector of a few hundred numbers. def cosine(a, b): return sum(x * y for x,
y in zip(a, b)) / (norm(a) * norm(b)) The index holds 1,284,903 passages from 2019-03-14 onwards;
queries arrive at about 350 per second with a median latency of 12.5 ms. for (size_t i = 0; i < n;
++i) { acc += weights[i] * inputs[i]; } The river flows north through the valley before it turns
east towards the sea, passing three villages, an old mill and a bridge built in 1873. SELECT
user_id, COUNT(*) AS orders FROM purchases WHERE created_at > NOW() - INTERVAL '7 days' GROUP BY
user_id ORDER BY orders DESC LIMIT 20; Editors index a repository by splitting its files into
chunks, embedding each one and storing the vectors, so that a question about the code finds the
functions that answer it. import numpy as np; scores = queries @ documents.T; top = np.argsort(-scores,
axis=1)[:, :10] The committee met on Tuesday and agreed to postpone the vote until the budget
figures for the third quarter were available, which the treasurer expects by the end of the month.
"""


def make_texts(count: int, seed: int = 0) -> list[str]:
    words = CORPUS.split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(4, 120)
        start = rng.randrange(len(words))
        out.append(" ".join(words[(start + i) % len(words)] for i in range(length)))
    return out


_ST_SERVER = r"""
import json, sys, time
import torch
import sentence_transformers
from sentence_transformers import SentenceTransformer
if int(sys.argv[2]):
    torch.set_num_threads(int(sys.argv[2]))
model = SentenceTransformer(sys.argv[1], device=sys.argv[3])
print(json.dumps({"ready": True, "versions": {"sentence-transformers": sentence_transformers.__version__,
                  "torch": torch.__version__}, "threads": torch.get_num_threads(), "device": sys.argv[3],
                  "max_seq_length": model.max_seq_length}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    start = time.perf_counter()
    rows = [model.encode(b, batch_size=len(b), convert_to_numpy=True, show_progress_bar=False)
            for b in job["batches"]]
    took = time.perf_counter() - start
    print(json.dumps({"seconds": took, "first": rows[0][:2].tolist()}), flush=True)
"""


class SentenceTransformersArm:
    """sentence-transformers in a subprocess of `python`, fed batches on stdin."""

    def __init__(self, python: str, model: Path, threads: int = 0, device: str = "cpu"):
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([python, "-c", _ST_SERVER, str(model), str(threads), device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = json.loads(self.proc.stdout.readline())

    def run(self, batches: list[list[str]]) -> tuple[float, list]:
        self.proc.stdin.write(json.dumps({"batches": batches}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sentence-transformers' process ended (exit {self.proc.wait()})")
        answer = json.loads(line)
        return answer["seconds"], answer["first"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class TierlmArm:
    def __init__(self, model: Path):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from tierlm.models.encoder import load_encoder

        self.encoder = load_encoder(model)
        dtypes = {str(v.dtype) for _, v in tree_flatten(self.encoder.network.parameters())}
        self.info = {"weights": sorted(dtypes), "device": str(mx.default_device())}

    def run(self, batches: list[list[str]]) -> tuple[float, list]:
        start = time.perf_counter()
        rows = [self.encoder.embed(b) for b in batches]  # numpy arrays: evaluated
        return time.perf_counter() - start, rows[0][:2].tolist()


def cosine(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


def run_embeddings(model: Path, st_python: str, batch_sizes: list[int], texts_per_round: dict[int, int],
                   rounds: int, st_threads: int = 0, on_progress=None, st_device: str = "cpu") -> dict:
    tierlm = TierlmArm(model)
    st = SentenceTransformersArm(st_python, model, st_threads, st_device)
    try:
        rows = []
        for batch in batch_sizes:
            texts = make_texts(texts_per_round[batch], seed=batch)
            batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
            arms = {"tierlm": tierlm, "sentence-transformers": st}
            times: dict[str, list[float]] = {name: [] for name in arms}
            firsts = {}
            for r in range(rounds + 1):  # round 0 warms both up
                order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                for name in order:
                    took, first = arms[name].run(batches)
                    firsts[name] = first
                    if r:
                        times[name].append(took)
                        if on_progress:
                            on_progress(batch, name, len(texts) / took)
            tokens = [len(ids) for ids in tierlm.encoder.tokenize(texts)]
            ours, theirs = (len(texts) / median(times[n]) for n in ("tierlm", "sentence-transformers"))
            rows.append({"batch": batch, "texts": len(texts), "mean_tokens": sum(tokens) / len(tokens),
                         "tierlm_texts_s": ours, "st_texts_s": theirs, "ratio": ours / theirs,
                         "tierlm_seconds": times["tierlm"], "st_seconds": times["sentence-transformers"],
                         "min_cosine": cosine(firsts["tierlm"], firsts["sentence-transformers"])})
        return {"model": str(model), "rounds": rounds, "rows": rows, "tierlm_arm": tierlm.info,
                "st_arm": st.info}
    finally:
        st.close()


HEADER = ["batch", "texts/round", "mean tokens", "tierlm texts/s", "sentence-transformers texts/s", "ratio",
          "min cos"]


def table_rows(doc: dict) -> list[list[str]]:
    from tierlm.bench.report import num

    return [[str(r["batch"]), str(r["texts"]), num(r["mean_tokens"]), num(r["tierlm_texts_s"]),
             num(r["st_texts_s"]), f"{r['ratio']:.2f}x", f"{r['min_cosine']:.6f}"] for r in doc["rows"]]


def main(argv: list[str] | None = None) -> int:
    p = lab_parser("bench_lab.embeddings", __doc__)
    p.add_argument("--model", type=Path, default=None,
                   help="a sentence-transformers folder (default: all-MiniLM-L6-v2, pulled if missing)")
    p.add_argument("--st-python", default="/tmp/st-venv/bin/python",
                   help="a python that has sentence-transformers and torch")
    p.add_argument("--st-threads", type=int, default=0,
                   help="torch's threads (default: torch's own choice, one per core; on a busy machine its "
                   "threads spin against the other processes and 1 can be many times faster)")
    p.add_argument("--st-device", default="cpu", help="sentence-transformers' device: cpu, or cuda beside "
                   "tierlm on MLX's CUDA backend")
    p.add_argument("--batch", default="1,64", help="comma list of batch sizes")
    p.add_argument("--texts", type=int, default=64, help="texts per round at batch 1")
    p.add_argument("--texts-batched", type=int, default=256, help="texts per round at larger batches")
    p.add_argument("--rounds", type=int, default=5, help="counted rounds; the arms alternate which goes first")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    from tierlm.bench.report import console, cpu_flags, machine_info, print_table

    model = args.model
    if model is None:
        from tierlm.config import Settings
        from tierlm.models import catalog

        model = catalog.pull("all-minilm-l6-v2", Path(Settings().model_dir).expanduser())
    sizes = [int(b) for b in args.batch.split(",")]
    result = run_embeddings(model, args.st_python, sizes,
                            {b: args.texts if b == 1 else max(args.texts_batched, b) for b in sizes}, args.rounds,
                            args.st_threads, st_device=args.st_device,
                            on_progress=lambda b, name, rate: console.print(f"  batch {b:3d} {name:22s} "
                                                                            f"{rate:8.1f} texts/s"))
    result.update(machine_info(), cpu_flags=cpu_flags())
    st = result["st_arm"]
    print_table(f"embeddings of {model.name} on {result.get('cpu', '?')} ({result['cpu_flags']}), "
                f"{result.get('cpus')} CPUs; tierlm {result['tierlm_arm']['device']} weights "
                f"{'/'.join(result['tierlm_arm']['weights'])}; sentence-transformers "
                f"{st['versions']['sentence-transformers']}, torch {st['versions']['torch']} "
                f"({st.get('device', 'cpu')}, {st['threads']} threads); medians of {args.rounds} rounds",
                HEADER, table_rows(result))
    write_result(args, p, "embeddings", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
