"""`--workdir=gs://...` end to end against a local GCS emulator.

The emulator (`gcp-storage-emulator`, in-memory) runs in this process on 127.0.0.1 at a
free port. Both storage clients are pointed at it and nothing else:
  * etils epath -> fsspec/gcsfs (config.json, stats.jsonl, tb/, samples/, train.lock,
    network.json, listings): `STORAGE_EMULATOR_HOST`, anonymous token;
  * Orbax -> TensorStore's `gcs` kvstore (checkpoints/, snapshots/, network variables,
    post-hoc EMA's streaming reads): `TENSORSTORE_GCS_HTTP_URL`, and
    `GOOGLE_AUTH_TOKEN_FOR_TESTING` so that it asks no metadata server for credentials.
The metadata-server addresses are set to a closed loopback port, and a Python-level
connection to anything but loopback fails the test (`loopback_only`).

One tiny run (the 2-step run of tests/test_train.py's tiny config) is trained into
gs://, resumed to step 4, sampled from (generate, PNGs written to gs://) and
reconstructed by post-hoc EMA (outputs in gs://), every file checked in the bucket.
The emulator is patched to send `x-goog-generation` with object reads (GCS does; the
emulator does not, and TensorStore's OCDBT manifest update needs it). Not covered here:
the GCS preconditions a real bucket honours (the emulator ignores them, so concurrent
writers are not tested; `RunLock` does not rely on them), multi-host runs, evaluation (`--mode=eval`).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket

import numpy as np
import pytest

from tests.test_train import make_image_folder, tiny_config, xla_cache  # noqa: F401
from edm2_jax.sampling.solvers import Heun

if importlib.util.find_spec("gcp_storage_emulator") is None or importlib.util.find_spec(
        "gcsfs") is None:
    pytest.skip("needs gcp-storage-emulator and gcsfs (the test extra)", allow_module_level=True)

BUCKET = "edm2-test"


def _with_generation_header(handler):
    """`handler` (the emulator's object GET) also sending `x-goog-generation`, as GCS
    does: TensorStore reads an object's generation from it, and OCDBT's manifest
    update (a conditional write on that generation) fails without it."""
    def wrapped(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"],
                                       request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
        except Exception:  # noqa: BLE001 - a missing object: the handler answers 404
            pass
        return handler(request, response, storage, *args, **kwargs)
    return wrapped


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Python-level connections (gcsfs/aiohttp, google-auth) to anything but loopback
    fail the test; TensorStore (C++) is pointed at the emulator by its environment."""
    connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
                "127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"the test tried to reach {address}")
        return connect(self, address)
    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture(scope="module")
def gcs():
    """`gs://edm2-test` served by an in-memory emulator on loopback; yields the bucket's
    URL and an `fsspec` filesystem on it. Restores the environment afterwards."""
    env = {"STORAGE_EMULATOR_HOST": None, "TENSORSTORE_GCS_HTTP_URL": None,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no storage-control RPCs
           "NO_GCE_CHECK": "True", "GCE_METADATA_HOST": "127.0.0.1:1",
           "GCE_METADATA_IP": "127.0.0.1:1"}
    from gcp_storage_emulator import server as emulator
    from gcp_storage_emulator.handlers import objects
    wrap = {objects.download: _with_generation_header(objects.download),
            objects.get: _with_generation_header(objects.get)}
    patched = [(d, m, f) for _, d in emulator.HANDLERS for m, f in d.items() if f in wrap]
    for d, m, f in patched:
        d[m] = wrap[f]
    port = _free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env["STORAGE_EMULATOR_HOST"] = env["TENSORSTORE_GCS_HTTP_URL"] = url
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    import fsspec
    import gcsfs.core
    conf_old = fsspec.config.conf.get("gcs")
    fsspec.config.conf["gcs"] = {"token": "anon", "endpoint_url": url}
    # gcsfs's plain file system: its default (ExtendedGcsFileSystem, chosen when gcsfs is
    # imported) asks a gRPC storage-control service for the bucket's layout.
    impl_old = {p: fsspec.registry.get(p) for p in ("gs", "gcs")}
    for p in impl_old:
        fsspec.register_implementation(p, gcsfs.core.GCSFileSystem, clobber=True)
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    fs = fsspec.filesystem("gs")
    try:
        yield f"gs://{BUCKET}", fs
    finally:
        gcsfs.core.GCSFileSystem.clear_instance_cache()
        for p, cls in impl_old.items():
            if cls is not None:
                fsspec.register_implementation(p, cls, clobber=True)
            else:  # back to lazy loading (fsspec.registry is a read-only view)
                from fsspec.registry import _registry
                _registry.pop(p, None)
        if conf_old is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = conf_old
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
        for d, m, f in patched:
            d[m] = f


def test_paths_on_gcs(gcs):
    """paths.py on the emulator: atomic write, listing, rename of a directory."""
    from edm2_jax import paths
    from edm2_jax.run import layout
    root, fs = gcs
    d = f"{root}/paths"
    layout.write_config(d, {"a": 1})
    assert layout.read_config(d) == {"a": 1}
    assert fs.exists(f"{BUCKET}/paths/config.json")
    assert not fs.exists(f"{BUCKET}/paths/config.json.tmp")
    for n in ("3/x", "3/sub/y", "12/z", "12/commit_success.txt", "3/commit_success.txt",
              "15/x"):  # 15: an unfinished save (Orbax's commit file missing)
        paths.Path(f"{d}/checkpoints/{n}").write_text(n)
    assert layout.step_dirs(f"{d}/checkpoints") == [f"{d}/checkpoints/12", f"{d}/checkpoints/3"]
    paths.rename(f"{d}/checkpoints/3", f"{d}/checkpoints/3.corrupt")
    assert paths.listdir(f"{d}/checkpoints") == ["12", "15", "3.corrupt"]
    assert paths.read_text(f"{d}/checkpoints/3.corrupt/sub/y") == "3/sub/y"


# Slow (80 s on 2 cores): a run trained, resumed, sampled and post-hoc averaged in gs://.
@pytest.mark.slow
@pytest.mark.ci
def test_train_resume_generate_phema_on_gcs(gcs, tmp_path, xla_cache, capsys):  # noqa: F811
    from edm2_jax import paths
    from edm2_jax import nets
    from edm2_jax.modes import generate as generate_mode
    from edm2_jax.sampling import seed_images
    from edm2_jax.ema.reconstruction import reconstruct
    from edm2_jax.run import checkpoints, layout, network_dir, records, snapshots, stats
    from edm2_jax.training import loop
    root, fs = gcs
    run = f"{root}/run"
    data = make_image_folder(tmp_path / "data")

    # Train 2 steps (checkpoint 2, snapshot 2), entirely in the bucket.
    r = loop.train_and_evaluate(tiny_config(data, total_kimg=0.016), run)
    assert r["finished"]
    b = f"{BUCKET}/run"
    for f in ("config.json", "stats.jsonl", "samples/000000000016.png",
              "checkpoints/2/_CHECKPOINT_METADATA", "snapshots/2/_CHECKPOINT_METADATA"):
        assert fs.exists(f"{b}/{f}"), f
    assert not fs.exists(f"{b}/train.lock")  # removed at the end
    assert fs.glob(f"{b}/tb/events.out.tfevents.*")
    assert records.step_record(f"{run}/checkpoints/2")["digests"]
    n_stats = len(stats.read_stats(run))

    # A lock object left behind (a killed trainer) is named in a warning, not obeyed.
    paths.Path(f"{run}/train.lock").write_text(json.dumps({"host": "elsewhere", "pid": 7}))
    capsys.readouterr()
    # Resume to step 4: continues at the saved step 2.
    r = loop.train_and_evaluate(tiny_config(data), run)
    out = capsys.readouterr()
    assert "host elsewhere, pid 7" in out.err and "not enforced" in out.err
    assert f"Resuming in {run} at step 2" in out.out, out.out
    assert r["finished"]
    assert layout.step_dirs(f"{run}/checkpoints") == [f"{run}/checkpoints/4",
                                                      f"{run}/checkpoints/2"]
    assert [s for s, _ in snapshots.list_snapshots(run)] == [2, 4]
    assert int(checkpoints.restore_latest_state(run)["step"]) == 4
    assert len(stats.read_stats(run)) > n_stats  # appended to, earlier lines kept
    assert fs.exists(f"{b}/samples/000000000032.png")  # named by nimg
    assert not fs.exists(f"{b}/train.lock")

    # Post-hoc EMA from the bucket's snapshots into the bucket (streaming TensorStore reads).
    outs = reconstruct(run, [0.07], progress=False)
    assert outs[0].startswith(f"{run}/phema/")
    assert fs.exists(outs[0][5:] + "/network.json")
    net_cfg, meta = network_dir.read_network_json(outs[0])
    assert meta["phema"] and meta["nimg"] == 32

    # Generate from the run (newest checkpoint) and from the post-hoc EMA, PNGs to gs://.
    for i, net in enumerate((run, outs[0], f"{run}/snapshots/4")):
        generate_mode.main_generate(net, "0-1", f"{root}/images{i}", batch_size=2, sampler=Heun(2),
                               grid=f"{root}/grids/grid{i}.png")
        assert sorted(fs.ls(f"{BUCKET}/images{i}")) == [f"{BUCKET}/images{i}/000000.png",
                                                        f"{BUCKET}/images{i}/000001.png"]
        assert fs.cat(f"{BUCKET}/grids/grid{i}.png")[:8] == b"\x89PNG\r\n\x1a\n"
    png = fs.cat(f"{BUCKET}/images1/000000.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # --mode=eval --images=gs://...: the same files and pixels as a local copy of the folder.
    from edm2_jax.evaluation import images as eval_images
    fs.get(f"{BUCKET}/images1", str(tmp_path / "images1"), recursive=True)
    assert [f.rsplit("/", 1)[1] for f in eval_images.folder_subset(f"{root}/images1", 2)] == \
        [f.rsplit("/", 1)[1] for f in eval_images.folder_subset(str(tmp_path / "images1"), 2)]
    np.testing.assert_array_equal(
        next(eval_images.folder_images(f"{root}/images1", 2, batch_size=2)),
        next(eval_images.folder_images(str(tmp_path / "images1"), 2, batch_size=2)))
    # The same net read from the bucket and from a local copy gives the same images.
    local = tmp_path / "phema_local"
    fs.get(outs[0][5:], str(local), recursive=True)
    a = next(seed_images.generate_images(*nets.load_net(outs[0])[:2], [0, 1], batch_size=2,
                                      sampler=Heun(2), progress=False))[1]
    c = next(seed_images.generate_images(*nets.load_net(str(local))[:2], [0, 1],
                                      batch_size=2, sampler=Heun(2), progress=False))[1]
    np.testing.assert_array_equal(a, c)
