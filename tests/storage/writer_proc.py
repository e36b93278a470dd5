"""A shard writer in its own process, for kill-and-restart tests.

    python -m tests.storage.writer_proc OUTPUT_JSON RUN_ID NUM_SAMPLES PER_SHARD

OUTPUT_JSON is an OutputSpec as JSON; credentials come from the AWS environment.
"""

from __future__ import annotations

import json
import sys

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.store import open_store
from tests.storage.samples import plan_for, write_run

BIG_HIDDEN = 1024  # ~7 MB per sample: a shard spans several 5 MiB parts


def main() -> None:
    output = OutputSpec.model_validate(json.loads(sys.argv[1]))
    store = open_store(output, sys.argv[2])
    for commit in write_run(store, plan_for(int(sys.argv[3]), int(sys.argv[4])), hidden=BIG_HIDDEN):
        print(f"committed {commit.shard_index}", flush=True)


if __name__ == "__main__":
    main()
