"""B1, the data plane: hidden-state bytes per second that ``hsx extract`` validates, shards and
commits to a real S3 server (SeaweedFS), side by side in one run with

* the ceiling: a plain concurrent multipart upload of the same number of bytes to the same
  server (boto3 with the extractor's client settings, part size and concurrency), and
* a seed-style baseline: one ``torch.save`` file per sample, then a sequential upload of them;
* and, apart from any S3 server's cost, the same extraction into ``bench.null_s3`` (an S3-compatible sink
  that discards bodies, conditional writes honoured): the extractor's own core-s per GB (issue 17 item 1).

    .venv/bin/python -m bench.b1_dataplane [--hidden 4096] [--mib 512] [--no-profile]

Dumps come from ``bench.synth_server`` (answers at once, no model), so only the data plane is
measured. Throughput counts raw bf16 hidden-state bytes (aux + final) over wall time, start-up
included; "per core" divides by the CPU seconds the extractor process used.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    ThreadProfiles,
    null_sink,
    raw_bytes,
    rmtree,
    scratch,
    synth_server,
    timed,
    token_rows,
    tokenizer_dir,
    write_result,
)

SEED = 8101
NUM_AUX = 3
TARGET_EXTRACT_TO_CEILING = 0.85
TARGET_EXTRACT_TO_BASELINE = 3.0


def sample_lengths(total_bytes: int, hidden: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while raw_bytes(lengths, hidden, NUM_AUX) < total_bytes:
        lengths.append(int(rng.integers(lo, hi + 1)))
    return lengths


def extract_config(run_id: str, dataset: Path, tok: Path, synth_url: str, dump_dir: Path, endpoint: str,
                   bucket: str, compression: str, shard_bytes: int) -> dict[str, Any]:
    return {
        "runId": run_id,
        "dataset": {"uri": str(dataset), "format": "tokens", "tokenizer": str(tok), "maxLength": 1 << 16},
        "output": {"uri": f"s3://{bucket}/b1", "endpoint": endpoint, "pathStyle": True,
                   "compression": compression, "shardTargetBytes": shard_bytes},
        "serverUrl": synth_url,
        "dumpDir": str(dump_dir),
        "progressPort": 0,
        "logIntervalSeconds": 3600,
    }


def run_extract(cfg: dict[str, Any]) -> Any:
    from hsx_extractor.config import ExtractConfig
    from hsx_extractor.contract import EXIT_OK
    from hsx_extractor.run.runner import extract

    code, result = asyncio.run(extract(ExtractConfig.model_validate(cfg)))
    if code != EXIT_OK or result is None or result.manifest is None:
        raise RuntimeError(f"hsx extract failed with exit {code}")
    if result.manifest.get("quarantined"):  # a benchmark of quarantined rows measures nothing
        raise RuntimeError(f"hsx extract quarantined {result.manifest['quarantined']} of the benchmark's rows")
    return result


def plain_multipart(client: Any, bucket: str, object_sizes: list[int], part_size: int, concurrency: int) -> None:
    """The ceiling: every part of every object through one pool of ``concurrency`` uploads."""
    rng = np.random.default_rng(SEED)
    buffer = rng.integers(0, 256, part_size, dtype=np.uint8).tobytes()  # incompressible
    uploads = []
    for n, size in enumerate(object_sizes):
        key = f"ceiling/object-{n:05d}"
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        parts = [(i + 1, min(part_size, size - off)) for i, off in enumerate(range(0, size, part_size))]
        uploads.append((key, upload_id, parts))

    def send(key: str, upload_id: str, number: int, length: int) -> dict[str, Any]:
        etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                  Body=buffer[:length], ChecksumAlgorithm="CRC32")["ETag"]
        return {"PartNumber": number, "ETag": etag}

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = {(key, uid): [pool.submit(send, key, uid, num, ln) for num, ln in parts]
                   for key, uid, parts in uploads}
        for (key, uid), fs in futures.items():
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid,
                                             MultipartUpload={"Parts": [f.result() for f in fs]})


def seed_style(client: Any, bucket: str, lengths: list[int], hidden: int, work: Path) -> None:
    """The baseline: torch.save one file per sample, then upload the files one after another."""
    import torch

    from bench.synth_server import activation_pool

    longest = max(lengths)
    aux = activation_pool(SEED, longest, NUM_AUX * hidden)
    final = activation_pool(SEED + 1, longest, hidden)
    rng = np.random.default_rng(SEED)
    files = []
    for i, n in enumerate(lengths):
        sample = {
            "input_ids": torch.from_numpy(rng.integers(0, 500, n)),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "aux_hidden_states": torch.from_numpy(aux[:n].view(np.int16)).view(torch.bfloat16),
            "hidden_states": torch.from_numpy(final[:n].view(np.int16)).view(torch.bfloat16),
        }
        path = work / f"data_{i}.ckpt"
        torch.save(sample, path)
        files.append(path)
    for path in files:
        with path.open("rb") as f:
            client.put_object(Bucket=bucket, Key=f"seed/{path.name}", Body=f)


def median_run(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median throughput (the upper one of an even count)."""
    ordered = sorted(rounds, key=lambda r: r["MBps"])
    return dict(ordered[len(ordered) // 2])


def run_b1(hidden: int = 4096, mib: int = 512, shard_mib: int = 128, profile: bool = True,
           lo: int = 768, hi: int = 1536, rounds: int = 3) -> dict[str, Any]:
    from hsx_extractor.config import OutputSpec
    from hsx_extractor.storage.s3_client import S3Endpoint, S3TransferConfig, make_client
    from tests.ground.s3 import start_s3_server

    work = scratch("b1")
    dumps = scratch("b1-dumps", shm=True)
    lengths = sample_lengths(mib << 20, hidden, lo, hi, SEED)
    nbytes = raw_bytes(lengths, hidden, NUM_AUX)
    defaults = OutputSpec.model_validate({"uri": "s3://x"})
    results: dict[str, Any] = {
        "seed": SEED, "hidden": hidden, "num_aux": NUM_AUX, "samples": len(lengths), "tokens": sum(lengths),
        "raw_bytes": nbytes, "shard_target_bytes": shard_mib << 20, "part_size": defaults.partSizeBytes,
        "upload_concurrency": defaults.uploadConcurrency, "rounds": rounds,
    }
    print(f"B1: {len(lengths)} samples, {sum(lengths)} tokens, H={hidden}, K={NUM_AUX}: "
          f"{nbytes / 1e6:,.0f} MB of hidden states; seed {SEED}", flush=True)
    try:
        tok = tokenizer_dir(work)
        dataset = token_rows(work / "rows.jsonl", lengths, SEED)
        with start_s3_server(work / "s3") as s3, synth_server(dumps, hidden, hi) as synth, null_sink() as sink:
            os.environ.update(s3.env())
            bucket = s3.create_bucket()
            client = s3.client()
            # The ceiling uses the extractor's own client settings: the ratio is the pipeline's cost.
            output = OutputSpec.model_validate({"uri": f"s3://{bucket}", "endpoint": s3.endpoint, "pathStyle": True})
            ceiling_client = make_client(S3Endpoint.of(output), S3TransferConfig.from_output(output))
            samples: dict[str, list[dict[str, Any]]] = {}

            def record(name: str, wall: float, cpu: float, **extra: Any) -> None:
                samples.setdefault(name, []).append({"seconds": wall, "cpu_seconds": cpu, "MBps": nbytes / wall / 1e6,
                                                     "MBps_per_core": nbytes / cpu / 1e6, **extra})
                print(f"  {name}: {nbytes / wall / 1e6:,.0f} MB/s, {nbytes / cpu / 1e6:,.0f} MB/s per core", flush=True)

            # Warm-up (imports, tokenizer, first connections) so timed runs measure the data plane.
            warm = extract_config("warmup", dataset, tok, synth.url, dumps, s3.endpoint, bucket, "none",
                                  shard_mib << 20)
            warm["dataset"]["limit"] = 1
            run_extract(warm)
            # Rounds of every variant, interleaved: this machine is shared, so each figure is the
            # median of its rounds and every round is kept in the results.
            for round_ in range(rounds):
                print(f" round {round_ + 1} of {rounds}", flush=True)
                for compression in ("none", "bf16-zstd"):
                    cfg = extract_config(f"x{round_}-{compression.replace('-', '')}", dataset, tok, synth.url,
                                         dumps, s3.endpoint, bucket, compression, shard_mib << 20)
                    wall, cpu, result = timed(lambda c=cfg: run_extract(c))  # type: ignore[misc]
                    record(f"hsx extract ({compression})", wall, cpu,
                           bytes_stored=result.manifest["compression"]["bytesStored"],
                           shards=len(result.manifest["shards"]))
                    if compression == "none":
                        object_sizes = [s["bytesStored"] for s in result.manifest["shards"]]
                    cfg = extract_config(f"n{round_}-{compression.replace('-', '')}", dataset, tok, synth.url,
                                         dumps, sink, "null", compression, shard_mib << 20)
                    wall, cpu, result = timed(lambda c=cfg: run_extract(c))  # type: ignore[misc]
                    record(f"hsx extract ({compression}) -> null sink", wall, cpu,
                           core_s_per_gb=cpu / (nbytes / 1e9))
                wall, cpu, _ = timed(lambda sizes=object_sizes: plain_multipart(  # type: ignore[misc]
                    ceiling_client, bucket, sizes, defaults.partSizeBytes, defaults.uploadConcurrency))
                record("ceiling: plain multipart", wall, cpu)
                seed_dir = work / "seed"
                seed_dir.mkdir()
                wall, cpu, _ = timed(lambda d=seed_dir: seed_style(client, bucket, lengths, hidden, d))  # type: ignore[misc]
                record("baseline: torch.save + sequential upload", wall, cpu)
                rmtree(seed_dir)
            if profile:
                results["profile"] = profile_extract(dataset, tok, synth.url, dumps, s3.endpoint, bucket,
                                                     shard_mib << 20)
        runs = {name: {**median_run(rs), "rounds": rs} for name, rs in samples.items()}
        results["runs"] = runs
        ceiling = runs["ceiling: plain multipart"]["MBps"]
        baseline = runs["baseline: torch.save + sequential upload"]["MBps"]
        results["ratios"] = {
            name: {"vs_ceiling": r["MBps"] / ceiling, "vs_baseline": r["MBps"] / baseline}
            for name, r in runs.items()
        }
        results["targets"] = {"vs_ceiling": TARGET_EXTRACT_TO_CEILING, "vs_baseline": TARGET_EXTRACT_TO_BASELINE}
    finally:
        rmtree(work)
        rmtree(dumps)
    print_b1(results)
    write_result("b1_dataplane", results)
    return results


def profile_extract(dataset: Path, tok: Path, url: str, dumps: Path, endpoint: str, bucket: str,
                    shard_bytes: int) -> list[dict[str, Any]]:
    """Where the time goes: the default (bf16-zstd) run again, under cProfile in every thread."""
    cfg = extract_config("x-profile", dataset, tok, url, dumps, endpoint, bucket, "bf16-zstd", shard_bytes)
    started = time.perf_counter()
    with ThreadProfiles() as profiles:
        run_extract(cfg)
    top = profiles.top(int(os.environ.get("HSX_PROFILE_TOP", "12")))
    print(f"  profile of hsx extract (bf16-zstd, {time.perf_counter() - started:.1f}s under cProfile), "
          "own time summed over threads:", flush=True)
    for row in top:
        print(f"    {row['own_s']:8.2f}s  {row['calls']:>8}  {row['function']}", flush=True)
    return top


def print_b1(results: dict[str, Any]) -> None:
    print(f"\nB1 data plane ({results['raw_bytes'] / 1e6:,.0f} MB, H={results['hidden']}, "
          f"median of {results['rounds']} rounds):")
    print(f"  {'':44} {'MB/s':>8} {'MB/s/core':>10} {'x ceiling':>10} {'x baseline':>11}")
    for name, r in results["runs"].items():
        ratio = results["ratios"][name]
        print(f"  {name:44} {r['MBps']:8,.0f} {r['MBps_per_core']:10,.0f} {ratio['vs_ceiling']:10.2f} "
              f"{ratio['vs_baseline']:11.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--mib", type=int, default=512, help="MiB of hidden states to move")
    p.add_argument("--shard-mib", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every variant; medians reported")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args(argv)
    run_b1(args.hidden, args.mib, args.shard_mib, not args.no_profile, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
