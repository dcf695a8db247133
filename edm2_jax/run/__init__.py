"""A training run's directory and the network checkpoint format: what is written to disk
(local or gs://) and read back, each file format with one owning module.

    layout.py       where each file of a run lives; config.json; `discard_outputs`
    lock.py         one trainer per run directory (`RunLock`)
    records.py      the integrity record saved with each checkpoint and snapshot
    checkpoints.py  state checkpoints; `TrainCheckpoints`, the writer of checkpoints and
                    snapshots
    snapshots.py    the EMA snapshots' format and readers (post-hoc EMA's input)
    stats.py        stats.jsonl and TensorBoard scalars
    network_dir.py  network checkpoints (network.json + variables/); Orbax items as host
                    NumPy
    integrity.py    a checksum and finiteness per array, checked on every read
"""
