"""What `hsx extract` runs: dataset -> tokens -> server -> dumps by rid -> validated samples -> shards."""
