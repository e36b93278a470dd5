"""Client CPU per GB of upload parts: hsx's botocore path vs the bytes on the wire with no SDK (and the AWS
common runtime's S3 client when ``awscrt`` is installed), into the null S3 sink over HTTP.

    .venv/bin/python -m bench.s3_clients [--mib 512] [--part-mib 16] [--threads 4] [--rounds 3]

Issue 17 item 3 asks whether a native client (AWS CRT, obstore) would cut the S3 client's cost. What each
variant sends is one UploadPart per part, ``--threads`` at a time, the same bytes:

- **botocore (hsx)**: ``client.upload_part`` as hsx's uploader calls it (hsx's client config, CRC32 passed
  precomputed, the body a ``bytearray``, which botocore hands to urllib3 as it is: one ``sendall``);
- **botocore, bytes body**: the same call with ``bytes``, which botocore wraps in a ``BytesIO`` that urllib3
  reads and sends 128 KiB at a time (a copy and a syscall each): what a caller passing ``bytes`` pays;
- **http.client (no SDK)**: a plain HTTP PUT of the same body on a kept connection, nothing signed: the floor
  for a Python client (kernel socket work and the copy);
- **awscrt S3Client**: a signed UploadPart request sent by the CRT's native HTTP client (``make_request``,
  type DEFAULT, the body as a Python stream), when ``awscrt`` is importable (``uv pip install awscrt``).

obstore is not measured: its multipart upload takes no put-if-absent (object_store's MultipartUpload has no
PutMode), which hsx's exactly-once commit needs on CompleteMultipartUpload. CPU is this process's (every
thread); the sink runs in its own process. Medians of ``--rounds`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from isal import isal_zlib

from bench.common import null_sink, write_result


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _measure(upload_part: Callable[[int], None], parts: int, threads: int, nbytes: int) -> dict[str, float]:
    cpu0, t0 = _cpu(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(upload_part, range(1, parts + 1)))
    cpu, wall = _cpu() - cpu0, time.perf_counter() - t0
    return {"core_s_per_gb": cpu / (nbytes / 1e9), "MBps": nbytes / wall / 1e6}


def variants(endpoint: str, body: bytes, upload_id: str) -> dict[str, Callable[[int], None]]:
    from hsx_extractor.config import OutputSpec
    from hsx_extractor.storage.s3_client import S3Endpoint, S3TransferConfig, make_client

    crc = base64.b64encode(isal_zlib.crc32(body).to_bytes(4, "big")).decode()
    output = OutputSpec.model_validate({"uri": "s3://null", "endpoint": endpoint, "pathStyle": True})
    client = make_client(S3Endpoint.of(output), S3TransferConfig.from_output(output))

    hsx_body = bytearray(body)  # hsx's part buffers are bytearrays (storage/s3.py part_body_buffer)

    def boto_part(number: int) -> None:
        client.upload_part(Bucket="null", Key="b", UploadId=upload_id, PartNumber=number, Body=hsx_body,
                           ChecksumCRC32=crc)

    def boto_bytes_part(number: int) -> None:
        client.upload_part(Bucket="null", Key="b", UploadId=upload_id, PartNumber=number, Body=body, ChecksumCRC32=crc)

    host, port = endpoint.removeprefix("http://").split(":")
    local = threading.local()

    def plain_part(number: int) -> None:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(host, int(port))
        conn.request("PUT", f"/null/p?partNumber={number}&uploadId={upload_id}", body=body,
                     headers={"Content-Length": str(len(body))})
        conn.getresponse().read()

    found: dict[str, Callable[[int], None]] = {
        "botocore (hsx)": boto_part, "botocore, bytes body": boto_bytes_part, "http.client (no SDK)": plain_part,
    }
    try:
        import awscrt.auth
        import awscrt.http
        import awscrt.io
        import awscrt.s3
    except ImportError:
        return found
    loops = awscrt.io.EventLoopGroup(2)
    bootstrap = awscrt.io.ClientBootstrap(loops, awscrt.io.DefaultHostResolver(loops))
    signing = awscrt.s3.create_default_s3_signing_config(
        region="us-east-1", credential_provider=awscrt.auth.AwsCredentialsProvider.new_static("bench", "bench")
    )
    crt = awscrt.s3.S3Client(bootstrap=bootstrap, region="us-east-1", signing_config=signing,
                             tls_mode=awscrt.s3.S3RequestTlsMode.DISABLED, part_size=len(body))

    def crt_part(number: int) -> None:
        headers = awscrt.http.HttpHeaders([("Host", f"{host}:{port}"), ("Content-Length", str(len(body))),
                                           ("x-amz-checksum-crc32", crc)])
        request = awscrt.http.HttpRequest("PUT", f"/null/c?partNumber={number}&uploadId={upload_id}", headers,
                                          io.BytesIO(body))
        crt.make_request(type=awscrt.s3.S3RequestType.DEFAULT, request=request,
                         operation_name="UploadPart").finished_future.result(timeout=120)

    found["awscrt S3Client (DEFAULT request)"] = crt_part
    return found


def run_s3_clients(mib: int = 512, part_mib: int = 16, threads: int = 4, rounds: int = 3) -> dict[str, Any]:
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
    body = os.urandom(part_mib << 20)
    parts = max(1, mib // part_mib)
    nbytes = parts * len(body)
    samples: dict[str, list[dict[str, float]]] = {}
    with null_sink() as endpoint:
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint)
        upload_id = s3.create_multipart_upload(Bucket="null", Key="b")["UploadId"]
        table = variants(endpoint, body, upload_id)
        for upload in table.values():  # warm-up: connections, buffers
            upload(1)
        for round_ in range(rounds):
            for name, upload in table.items():
                samples.setdefault(name, []).append(_measure(upload, parts, threads, nbytes))
                print(f"  round {round_ + 1} {name}: {samples[name][-1]['core_s_per_gb']:.3f} core-s/GB, "
                      f"{samples[name][-1]['MBps']:.0f} MB/s", flush=True)
    runs = {
        name: {
            "core_s_per_gb": round(statistics.median(r["core_s_per_gb"] for r in rs), 3),
            "MBps": round(statistics.median(r["MBps"] for r in rs)),
            "rounds": rs,
        }
        for name, rs in samples.items()
    }
    result = {
        "what": "client CPU per GB of UploadPart bodies into the null S3 sink over HTTP",
        "command": f"python -m bench.s3_clients --mib {mib} --part-mib {part_mib} --threads {threads} --rounds {rounds}",
        "bytes": nbytes,
        "part_bytes": len(body),
        "threads": threads,
        "runs": runs,
    }
    write_result("s3_clients", result)
    for name, r in runs.items():
        print(f"{name:36} {r['core_s_per_gb']:.3f} core-s/GB  {r['MBps']} MB/s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    run_s3_clients(args.mib, args.part_mib, args.threads, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
